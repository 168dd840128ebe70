"""A rank fails at each of ``fastinit.setup``'s phases: the survivor gets a clear fastinit error
within a bounded time, never a hang.

Every start-up fault point (``STARTUP_POINTS`` in ``fastinit.testing.faults``, one per phase in the
order setup reaches them) × {rank 1 raises, rank 1 dies with ``os._exit``}, on 2 gloo ranks with
``FASTINIT_COLLECTIVE_TIMEOUT`` small. Rank 0 plans (no plan, no cache), so every start-up message
runs: the record all_gather, the plan broadcast, the replica digest all_reduce.

The two ranks are started once by the harness (``run_ranks``, no process group) and pay their imports
once; each case is a pair of processes forked from them that form a fresh gloo group on the
harness's store under a prefix of the case's own, so a rank can die in one case and the next case
still has both.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from fastinit.testing.dist import run_ranks
from fastinit.testing.faults import STARTUP_POINTS

#: FASTINIT_COLLECTIVE_TIMEOUT in the ranks, seconds.
COLLECTIVE_TIMEOUT = 4
#: A survivor must have its answer this long after setup started: the timeout plus planning and
#: construction of a 3-table model on a loaded 2-core host. A wait bounded only by the process
#: group's timeout (PG_TIMEOUT_S) would pass it.
BOUND_S = 45.0
PG_TIMEOUT_S = 300.0
#: How long a rank that raised stays alive (its group open) waiting for its peer to finish, so
#: the peer meets a silent rank and not a closed connection: the timeout path.
LINGER_S = 30.0
KINDS = ("error", "exit")
CASES = [(point, kind) for point in STARTUP_POINTS for kind in KINDS]
#: What the survivor's error names: the start-up message during which it found its peer gone.
#: Planning failing on rank 1 travels in its record, so rank 0 learns it from the record itself.
NAMES = {
    "startup.prepare": "start-up record all_gather",
    "startup.plan": "start-up record all_gather",
    "startup.exchange": "start-up record all_gather",
    "startup.agree_on_plan": "plan broadcast",
    "startup.materialize": "replica digest check",
    "startup.construct": "replica digest check",
    "startup.verify": "replica digest check",
}
#: After the replica digests, setup sends nothing (DDP without its init sync): a peer lost there
#: is not start-up's to see, and the survivor's setup returns; its first training collective
#: meets the loss.
AFTER_THE_LAST_MESSAGE = {"startup.init_data_parallel"}


def _case(point: str, kind: str, case: int, rank: int) -> dict[str, Any]:
    """One side of one case, in a forked process: a fresh group, setup with the fault."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import fastinit
    from fastinit import knobs
    from fastinit.testing.faults import inject
    from fastinit.testing.models import ModelSpec, build_model

    timeout = timedelta(seconds=PG_TIMEOUT_S)
    harness = dist.TCPStore(  # the harness's store, hosted by the test process
        "127.0.0.1", int(os.environ["MASTER_PORT"]), 2, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"fault-case-{case}/", harness)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    module = build_model(ModelSpec(num_tables=3, rows=64, dims=(8,)), device="meta")
    out: dict[str, Any] = {"raised": None, "message": ""}
    t0 = time.monotonic()
    with (
        knobs.override(FASTINIT_COLLECTIVE_TIMEOUT=str(COLLECTIVE_TIMEOUT), FASTINIT_PLAN_CACHE=""),
        inject(point, kind, ranks=[1]),
    ):
        try:
            fastinit.setup(module, seed=1)
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            out.update(raised=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - t0
    try:
        store.set(f"done/{rank}", "1")
        if out["raised"] is not None and rank == 1:
            store.wait(["done/0"], timedelta(seconds=LINGER_S))  # stay silent, group open
    except Exception:  # noqa: BLE001 - the peer (or the store's host) may be gone
        pass
    return out


def _child(point: str, kind: str, case: int, rank: int, conn: Any) -> None:
    try:
        conn.send(_case(point, kind, case, rank))
    except BaseException as e:  # noqa: BLE001 - reported to the rank that forked this one
        conn.send({"raised": "harness:" + type(e).__name__, "message": str(e), "seconds": -1})
    finally:
        conn.close()
        os._exit(0)  # skip teardown: a dead peer can block torch's atexit hooks


def _all_cases() -> dict[str, dict[str, Any]]:
    """On each harness rank: every case in a forked process; its outcome, or how it ended."""
    import multiprocessing

    rank = int(os.environ["RANK"])
    ctx = multiprocessing.get_context("fork")
    outcomes: dict[str, dict[str, Any]] = {}
    for case, (point, kind) in enumerate(CASES):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(point, kind, case, rank, child))
        proc.start()
        child.close()
        got = None
        if parent.poll(BOUND_S + LINGER_S + 30):
            with contextlib.suppress(EOFError):  # EOF: it died without a word (the "exit" fault)
                got = parent.recv()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        outcome = got or {"raised": None, "message": "no result", "seconds": None}
        outcome["exitcode"] = proc.exitcode
        outcomes[f"{point}/{kind}"] = outcome
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_all_cases, 2, init_pg=False, timeout=1500)


def test_every_phase_has_a_point_and_a_case() -> None:
    assert STARTUP_POINTS[0] == "startup.prepare"
    assert set(STARTUP_POINTS) == set(NAMES) | AFTER_THE_LAST_MESSAGE


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("point", STARTUP_POINTS)
def test_a_rank_failing_at_a_phase_gives_the_survivor_a_clear_error(
    outcomes: list[dict[str, dict[str, Any]]], point: str, kind: str
) -> None:
    survivor, failed = outcomes[0][f"{point}/{kind}"], outcomes[1][f"{point}/{kind}"]
    story = f"survivor {survivor}, failed rank {failed}"
    if kind == "exit":
        assert failed["exitcode"] == 1 and failed["seconds"] is None, story  # it died there
    else:
        assert failed["raised"] in ("RuntimeError", "StartupError"), story
        assert f"fault injected at {point} (rank 1)" in failed["message"], story
    assert survivor["exitcode"] == 0 and survivor["seconds"] is not None, story
    assert survivor["seconds"] < BOUND_S, story  # bounded: no hang
    if point in AFTER_THE_LAST_MESSAGE:
        assert survivor["raised"] is None, story
        return
    assert survivor["raised"] == "StartupError", story
    message = survivor["message"]
    if point == "startup.plan" and kind == "error":
        # the failure travelled in rank 1's record: every rank names it and the failed rank
        assert "failed on 1 rank(s): ranks [1]" in message, story
        assert "fault injected at startup.plan" in message, story
    else:
        assert f"the {NAMES[point]} failed" in message, story
        assert "a peer died, hung or has not called fastinit.setup" in message, story
        assert f"FASTINIT_COLLECTIVE_TIMEOUT={COLLECTIVE_TIMEOUT}s" in message, story
