"""The multi-rank harness: results, tracebacks, deaths and hangs, all processes reaped."""

from __future__ import annotations

import os
import time

import pytest

from fastinit.testing.dist import RanksFailed, on_ranks, run_ranks


def _rank_info(scale: int) -> tuple[int, int, str, str, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return (
        dist.get_rank() * scale,
        int(t.item()),
        os.environ["LOCAL_RANK"],
        os.environ["GROUP_RANK"],
        os.getpid(),
    )


def _fails_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")


def _hangs() -> None:
    time.sleep(600)


def _dies() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_results_come_back_in_rank_order() -> None:
    out = run_ranks(_rank_info, 4, args=(10,), local_world_size=2)
    assert [o[0] for o in out] == [0, 10, 20, 30]
    assert all(o[1] == 6 for o in out)
    assert [o[2:4] for o in out] == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]
    assert not any(_alive(o[4]) for o in out)


def test_failing_rank_traceback_is_in_the_error() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fails_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "rank one is unhappy" in message
    assert "===== rank 1" in message
    assert "_fails_on_rank_one" in message


def test_hang_is_killed_with_stacks_and_reaped() -> None:
    t0 = time.monotonic()
    # Long enough for a loaded 2-core machine to import torch and reach the hang.
    results = run_ranks(_hangs, 2, timeout=30, return_failures=True)
    assert time.monotonic() - t0 < 75
    for r in results:
        assert not r.ok and "timed out" in r.error
        assert "_hangs" in r.log  # faulthandler's dump names the function it hung in
        assert r.exitcode is not None  # reaped


def test_dead_rank_is_reported() -> None:
    results = run_ranks(_dies, 2, timeout=60, grace=5, return_failures=True)
    assert results[0].exitcode == 3
    assert "died" in results[0].error


@on_ranks(2, timeout=60)
def test_decorator_runs_the_body_on_every_rank() -> None:
    import torch.distributed as dist

    assert dist.get_world_size() == 2
    assert os.environ["RANK"] == str(dist.get_rank())
