"""Checkpoints a user can trust: whole or invisible, proven on read, one verdict on every rank.

Each failure a sceptical user found (two jobs racing into one directory, a rank directory
replaced by a later save's, flipped bytes, DCP's BaseException escaping, a full disk at the
marker, a rank given another directory, a stock DCP directory saved into, bad metadata on one
rank, and the weaker five) is a case here, on real gloo ranks. Every spawned job runs several
cases (every rank pays seconds of imports on this machine).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import threading
import time
from typing import Any

import pytest
from test_checkpoint import (
    PLAN_A,
    PLAN_B,
    _build,
    _diff,
    _error_of,
    _local,
    _stock_save,
    _train,
)
from test_checkpoint import SPEC as _SPEC

from fastinit.testing.dist import RanksFailed, run_ranks


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _copy(src: str, dst: str) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
    dist.barrier()
    return dst


def _flip(path: str, where: int) -> None:
    with open(path, "r+b") as f:
        f.seek(where)
        data = bytearray(f.read(4))
        f.seek(where)
        f.write(bytes(b ^ 0xFF for b in data))


def _data_dir(path: str) -> str:
    from fastinit.checkpoint import format as fmt

    return os.path.join(path, fmt.read_commit(path).data_dir)


def _item_middle(path: str, rank: int | None) -> tuple[str, int]:
    """A file of a part and a byte offset in the middle of its largest tensor item's data."""
    from fastinit.checkpoint import format as fmt

    commit = fmt.read_commit(path)
    manifest, _ = fmt.read_manifest(path, commit, rank)
    item = max((i for i in manifest.items if i.chunk_offsets is not None), key=lambda i: i.nbytes)
    part = fmt.REPLICATED_DIR if rank is None else fmt.RANK_DIR_PATTERN.format(rank=rank)
    return os.path.join(path, commit.data_dir, part, item.file), item.offset + item.nbytes // 2


# -- one job: the single-job promises ----------------------------------------------------------


def _trust_rank(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fastinit import checkpoint, knobs
    from fastinit.checkpoint import format as fmt
    from fastinit.checkpoint.state import build_state
    from fastinit.testing.faults import inject

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    model, opts = _build(PLAN_A, seed=1)
    _train(model, opts, seed=10)
    reference = _local(model, opts)
    good = f"{root}/good"
    checkpoint.save(good, model, opts, blocking=True, metadata={"step": 1})

    # 6. A rank given another directory: refused on every rank before a byte is written.
    mine = f"{root}/step-10" if rank == 0 else f"{root}/step-11"
    out["elsewhere"] = _error_of(lambda: checkpoint.save(mine, model, opts))
    _barrier()
    out["elsewhere_written"] = sorted(
        p for p in glob.glob(f"{root}/step-1*/**", recursive=True) if os.path.isfile(p)
    )

    # 8. Bad metadata on rank 0 only: every rank raises at once, nobody waits for a timeout.
    t0 = time.perf_counter()
    meta = {"step": 2, "bad": object()} if rank == 0 else {"step": 2}
    out["bad_meta"] = _error_of(lambda: checkpoint.save(f"{root}/meta", model, opts, metadata=meta))
    out["bad_meta_s"] = time.perf_counter() - t0

    # 5. A full disk exactly at the commit marker: every rank raises, no marker on disk.
    full = f"{root}/full-marker"
    with inject("checkpoint.marker", "oserror", ranks=[0]):
        out["marker_full"] = _error_of(lambda: checkpoint.save(full, model, opts).wait())
    out["marker_on_disk"] = fmt.is_committed(full)

    # 7. A stock DCP checkpoint's directory: save refused, consolidate refused, stock intact.
    stock = f"{root}/stock"
    _stock_save(stock, model, opts)
    before = sorted(os.listdir(stock))
    out["into_stock"] = _error_of(lambda: checkpoint.save(stock, model, opts, blocking=True))
    out["consolidate_stock"] = _error_of(lambda: checkpoint.consolidate(stock)) if rank == 0 else ""
    _barrier()
    out["stock_untouched"] = sorted(os.listdir(stock)) == before
    # ... and a fastinit checkpoint holding a .metadata consolidate did not write: refused.
    foreign = _copy(good, f"{root}/foreign")
    if rank == 0:
        shutil.copy(os.path.join(stock, ".metadata"), os.path.join(foreign, ".metadata"))
        with open(os.path.join(foreign, ".metadata"), "rb") as f:
            foreign_bytes = f.read()
        out["consolidate_foreign"] = _error_of(lambda: checkpoint.consolidate(foreign))
        with open(os.path.join(foreign, ".metadata"), "rb") as f:
            out["foreign_untouched"] = f.read() == foreign_bytes
    _barrier()

    # c. Two saves in flight into one directory: the second is refused on every rank, the
    # first commits.
    twice = f"{root}/twice"
    first = checkpoint.save(twice, model, opts)
    out["first_times"] = (first.blocking_s, first.agree_s, first.stage_s)
    out["second_save"] = _error_of(lambda: checkpoint.save(twice, model, opts))
    out["first_committed"] = first.committed

    # 2. A rank's part replaced by the same rank's files of a later save of the same model.
    _train(model, opts, seed=11)
    later = f"{root}/later"
    checkpoint.save(later, model, opts, blocking=True)
    mixed = _copy(good, f"{root}/mixed")
    if rank == 0:
        dst = os.path.join(_data_dir(mixed), "rank_00001")
        src = os.path.join(_data_dir(later), "rank_00001")
        shutil.rmtree(dst)
        shutil.copytree(src, dst)
    _barrier()
    target, target_opts = _build(PLAN_A, seed=9)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="off"):
        out["mixed"] = _error_of(lambda: checkpoint.load(mixed, target, target_opts))

        # 3. Four flipped bytes in the middle of a data file: own shards (rank 1's part) and
        # replicated values; the same plan and resharded.
        for name, part in (("flip_own", 1), ("flip_replicated", None)):
            flipped = _copy(good, f"{root}/{name}")
            if rank == 0:
                _flip(*_item_middle(flipped, part))
            _barrier()
            out[name] = _error_of(lambda p=flipped: checkpoint.load(p, target, target_opts))
        other, other_opts = _build(PLAN_B, seed=9)
        out["flip_resharded"] = _error_of(
            lambda: checkpoint.load(f"{root}/flip_own", other, other_opts)
        )
        # The verification itself: every file of the good checkpoint proves itself.
        out["verify_good"] = checkpoint.verify(good)["files"] if rank == 0 else 0
        if rank == 0:
            from fastinit.cli import main

            out["cli_verify"] = (
                main(["checkpoint", "verify", good]),
                main(["checkpoint", "verify", f"{root}/flip_own"]),
            )
        out["verify_flipped"] = _error_of(lambda: checkpoint.verify(f"{root}/flip_own"))
        # The good checkpoint still loads, bit-equal.
        ok_report = checkpoint.load(good, target, target_opts)
        out["good_diff"] = _diff(reference, _local(target, target_opts))
        out["good_tier"] = ok_report.tier

    # 4. DCP's CheckpointException (a BaseException) never escapes: a damaged stock item, and
    # another model's stock checkpoint.
    damaged = _copy(stock, f"{root}/stock-damaged")
    if rank == 0:
        for path in glob.glob(os.path.join(damaged, "*.distcp")):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 3)
    _barrier()
    t2, t2_opts = _build(PLAN_A, seed=5)

    def load_catching_exception() -> str:
        try:
            checkpoint.load(damaged, t2, t2_opts)
        except Exception as e:  # noqa: BLE001 - the point: an Exception, not a BaseException
            return f"{type(e).__name__}: {e}"
        return "no error"

    out["stock_damaged"] = load_catching_exception()
    other_model, other_model_opts = _build(PLAN_A, seed=1, spec_kwargs={**_SPEC, "rows": 41})
    out["stock_other_model"] = _error_of(
        lambda: checkpoint.load(stock, other_model, other_model_opts)
    )

    # f. The three messages that misled. (iii) an empty marker:
    empty = _copy(good, f"{root}/empty-marker")
    if rank == 0:
        with open(os.path.join(empty, fmt.COMMIT_FILE), "wb"):
            pass
    _barrier()
    out["empty_marker"] = _error_of(lambda: checkpoint.load(empty, target, target_opts))
    # (i) an optimizer the checkpoint lacks: named in the report (strict: refused).
    lacking = {**target_opts, "extra": _dense(target)}
    report = checkpoint.load(good, target, lacking)
    out["lacking_missing"] = sorted(report.missing)[:3]
    out["lacking_strict"] = _error_of(lambda: checkpoint.load(good, target, lacking, strict=True))
    # (ii) another fused optimizer: its state is not the saved one's.
    adam, adam_opts = _build(PLAN_A, seed=9, fused="adagrad")
    out["other_optimizer"] = _error_of(lambda: checkpoint.load(good, adam, adam_opts, strict=True))
    report = checkpoint.load(good, adam, adam_opts)
    out["other_optimizer_missing"] = sorted(report.missing.values())[:1]

    # the stock DCP checkpoint still loads through DCP, as it was
    state = build_state(t2, t2_opts)
    dcp.load(state, checkpoint_id=stock)
    return out


def _dense(model: Any) -> Any:
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.01),
    )
    opt.init_state()
    return opt


@pytest.mark.timeout(900)
def test_one_job_refuses_proves_and_agrees(tmp_path: Any) -> None:
    results = run_ranks(_trust_rank, 2, args=(str(tmp_path),), timeout=840)
    for rank, out in enumerate(results):
        assert "CheckpointError" in out["elsewhere"], out["elsewhere"]
        assert "different checkpoint directories" in out["elsewhere"], out["elsewhere"]
        assert out["elsewhere_written"] == []
        assert (
            "CheckpointError" in out["bad_meta"]
            and "JSON" in out["bad_meta"]
            or (rank == 1 and "refused on rank 0" in out["bad_meta"])
        ), out["bad_meta"]
        assert out["bad_meta_s"] < 60, out["bad_meta_s"]
        assert "CheckpointError" in out["marker_full"], out["marker_full"]
        assert not out["marker_on_disk"]
        assert "stock DCP checkpoint" in out["into_stock"], out["into_stock"]
        assert out["stock_untouched"]
        assert "already holds a committed" in out["second_save"], out["second_save"]
        assert out["first_committed"]
        blocking, agree, stage = out["first_times"]  # the start message and the copy, within it
        assert 0 < agree < blocking and 0 < stage < blocking and agree + stage <= blocking
        assert (
            "CheckpointError" in out["mixed"]
            and "rank 1" in out["mixed"]
            or ("failed on rank 1" in out["mixed"])
        ), out["mixed"]
        for key in ("flip_own", "flip_replicated", "flip_resharded"):
            assert "CheckpointError" in out[key], (key, out[key])
        assert out["good_diff"] == [] and out["good_tier"] == "storage"
        assert "CheckpointError" in out["verify_flipped"] and "rank 1" in out["verify_flipped"]
        assert out["stock_damaged"].startswith("CheckpointError"), out["stock_damaged"]
        assert out["stock_other_model"].startswith("CheckpointError"), out["stock_other_model"]
        assert "is empty" in out["empty_marker"], out["empty_marker"]
        assert out["lacking_missing"] and all(
            k.startswith("extra.") for k in out["lacking_missing"]
        )
        assert "strict=True" in out["lacking_strict"], out["lacking_strict"]
        assert "another optimizer" in out["other_optimizer"], out["other_optimizer"]
        assert "another optimizer" in out["other_optimizer_missing"][0]
    # the ranks reading a damaged file name it; the others name the rank that failed
    assert "rank 1's" in results[1]["flip_own"] or "rank_00001" in results[1]["flip_own"]
    assert "failed on rank 1" in results[0]["flip_own"], results[0]["flip_own"]
    assert "JSON" in results[0]["bad_meta"] and "refused on rank 0" in results[1]["bad_meta"]
    assert "stock DCP checkpoint" in results[0]["consolidate_stock"]
    assert "not consolidate's output" in results[0]["consolidate_foreign"]
    assert results[0]["foreign_untouched"]
    assert results[0]["verify_good"] > 0
    assert results[0]["cli_verify"][0] == 0 and results[0]["cli_verify"][1] != 0


# -- two jobs into one directory ----------------------------------------------------------------


def _racer_rank(root: str, seed: int, gate: str | None, release: str | None) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=seed)
    _train(model, opts, seed=seed * 10)
    torch.save(_local(model, opts), f"{root}/ref-{seed}-rank{_rank()}.pt")
    out: dict[str, Any] = {}
    if gate is not None:  # wait until the other job's save returned
        while not os.path.exists(gate):
            time.sleep(0.05)
    handle = checkpoint.save(f"{root}/shared", model, opts)
    if release is not None:
        if _rank() == 0:
            open(release, "w").close()
        # hold the verdict until the other job has committed
        while not os.path.exists(f"{root}/other-done"):
            time.sleep(0.05)
    out["verdict"] = _error_of(handle.wait)
    if out["verdict"] == "no error" and _rank() == 0:
        open(f"{root}/other-done", "w").close()
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _compare_rank(root: str, seeds: list[int]) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint, knobs

    model, opts = _build(PLAN_A, seed=99)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="off"):
        checkpoint.load(f"{root}/shared", model, opts)
    got = _local(model, opts)
    return {
        seed: _diff(torch.load(f"{root}/ref-{seed}-rank{_rank()}.pt", weights_only=False), got)
        for seed in seeds
    }


def _run_jobs(jobs: list[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
    results: list[Any] = [None] * len(jobs)

    def run(i: int, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            results[i] = run_ranks(fn, 2, args=args, timeout=400, grace=120)
        except RanksFailed as e:
            results[i] = e

    threads = [
        threading.Thread(target=run, args=(i, fn, args)) for i, (fn, args) in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.timeout(900)
def test_two_jobs_into_one_directory_one_commits_and_loads_as_itself(tmp_path: Any) -> None:
    root = str(tmp_path)
    # Job A's save returns first and holds its verdict until job B has committed.
    a, b = _run_jobs(
        [
            (_racer_rank, (root, 1, None, f"{root}/a-saved")),
            (_racer_rank, (root, 2, f"{root}/a-saved", None)),
        ]
    )
    assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
    assert all(out["verdict"] == "no error" for out in b), b
    for out in a:  # the job that lost is told so on every rank, and its state never loads
        assert "committed by another save" in out["verdict"], out["verdict"]
    loaded = run_ranks(_compare_rank, 2, args=(root, [1, 2]), timeout=400)
    for out in loaded:
        assert out[2] == [] and out[1] != [], out
    # Unslowed: both race; at most one commits, and what loads is exactly that job's state.
    root2 = str(tmp_path / "free")
    os.makedirs(root2)
    open(f"{root2}/other-done", "w").close()
    c, d = _run_jobs([(_racer_rank, (root2, 3, None, None)), (_racer_rank, (root2, 4, None, None))])
    won = [
        seed
        for seed, res in ((3, c), (4, d))
        if not isinstance(res, Exception) and all(o["verdict"] == "no error" for o in res)
    ]
    assert len(won) <= 1, (c, d)
    for seed, res in ((3, c), (4, d)):
        if seed not in won and not isinstance(res, Exception):
            # refused at the start (the other had committed) or told it lost at the commit
            assert all(
                o["verdict"].startswith(("CheckpointError", "Taken"))
                and "committed" in o["verdict"]
                for o in res
            ), res
    if won:
        loaded = run_ranks(_compare_rank, 2, args=(root2, [3, 4]), timeout=400)
        for out in loaded:
            assert out[won[0]] == [], out


# -- writers: bounded waits, exits without wait, trainers killed --------------------------------


def _stalled_then_no_wait_rank(root: str) -> dict[str, Any]:
    from fastinit import checkpoint, knobs
    from fastinit.checkpoint import saving
    from fastinit.testing.faults import inject

    model, opts = _build(PLAN_A, seed=1)
    # A writer kept to a rate (1 byte/s) writes at full speed once its trainer waits.
    with knobs.override(FASTINIT_CHECKPOINT_WRITE_RATE="1"):
        t0 = time.perf_counter()
        checkpoint.save(f"{root}/paced", model, opts).wait()
        paced_s = time.perf_counter() - t0
    # A writer that stalls: wait() is bounded by the knob.
    with knobs.override(FASTINIT_COLLECTIVE_TIMEOUT="8"):
        with inject("checkpoint.write", "sleep", ranks=[1], seconds=60):
            handle = checkpoint.save(f"{root}/stalled", model, opts)
        t0 = time.perf_counter()
        err = _error_of(handle.wait)
    out = {"error": err, "seconds": time.perf_counter() - t0, "paced_s": paced_s}
    # A save, and the process ends without wait(): what the interpreter runs at exit (the
    # harness leaves its ranks with os._exit, so it is called here).
    checkpoint.save(f"{root}/no-wait", model, opts)
    saving._at_exit()
    return out


def _killed_after_save_rank(root: str) -> None:
    import signal

    import torch

    from fastinit import checkpoint, knobs

    model, opts = _build(PLAN_A, seed=7)
    _train(model, opts, seed=70)
    torch.save(_local(model, opts), f"{root}/ref-7-rank{_rank()}.pt")
    # Kept to 1 byte/s while the trainer lives: the writers commit in time only if its death
    # lifts the limit.
    with knobs.override(FASTINIT_CHECKPOINT_WRITE_RATE="1"):
        checkpoint.save(f"{root}/killed", model, opts)
    os.kill(os.getpid(), signal.SIGKILL)  # every trainer, right after save returned


def _killed_before_return_rank(root: str) -> dict[str, Any]:
    from fastinit import checkpoint, knobs
    from fastinit.testing.faults import inject

    model, opts = _build(PLAN_A, seed=7)
    manager = checkpoint.CheckpointManager(f"{root}/runs")
    manager.save(1, model, opts, blocking=True)
    with (
        knobs.override(FASTINIT_COLLECTIVE_TIMEOUT="8"),
        inject("checkpoint.handoff", "kill", ranks=[1]),
    ):
        handle = manager.save(2, model, opts)
        err = _error_of(handle.wait) if handle is not None else "no handle"
    return {"error": err, "latest": manager.latest()}


def _load_killed_rank(root: str, name: str) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=99)
    report = checkpoint.load(f"{root}/{name}", model, opts)
    ref = torch.load(f"{root}/ref-7-rank{_rank()}.pt", weights_only=False)
    return {"diff": _diff(ref, _local(model, opts)), "memory": report.memory_bytes}


def _killed_while_writing_rank(root: str) -> None:
    import signal

    import torch

    from fastinit import checkpoint
    from fastinit.testing.faults import inject

    model, opts = _build(PLAN_A, seed=7)
    manager = checkpoint.CheckpointManager(f"{root}/slow")
    manager.save(1, model, opts, blocking=True)
    _train(model, opts, seed=71)
    torch.save(_local(model, opts), f"{root}/ref-slow-rank{_rank()}.pt")
    with inject("checkpoint.write", "sleep", seconds=15):  # the writers take 15 s more
        manager.save(2, model, opts)
    os.kill(os.getpid(), signal.SIGKILL)  # every trainer, right after save returned


def _restarted_rank(root: str) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=99)
    manager = checkpoint.CheckpointManager(f"{root}/slow")
    manager.load_latest(model, opts)
    ref = torch.load(f"{root}/ref-slow-rank{_rank()}.pt", weights_only=False)
    return {"step": manager.loaded_step, "diff": _diff(ref, _local(model, opts))}


def test_a_restart_resumes_from_the_save_its_killed_predecessor_was_writing(
    tmp_path: Any,
) -> None:
    """Trainers killed right after save returned, restarted at once by the same launcher (as
    torchrun does, ~1 s later): the restart waits for the dead trainers' writers and resumes
    from that save, bit-equal, not from the one before it (which it did: the writers commit
    seconds after the restart looked)."""
    root = str(tmp_path)
    with pytest.raises(RanksFailed):
        run_ranks(_killed_while_writing_rank, 2, args=(root,), timeout=400)
    assert not os.path.exists(f"{root}/slow/step-2/fastinit-commit.json")  # still writing
    for out in run_ranks(_restarted_rank, 2, args=(root,), timeout=400):
        assert out["step"] == 2, out
        assert out["diff"] == [], out


def _writers_of(root: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"fastinit.checkpoint._writer_main" in cmd:
            out.append(int(pid))
    return out


def _wait_for(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(900)
def test_writer_process_outlives_trainers_and_waits_are_bounded(tmp_path: Any) -> None:
    root = str(tmp_path)
    before = set(_writers_of(root))
    # A stalled writer: every rank's wait() raises within the knob's bound. Then a process that
    # exits without wait(): a loud warning, and the writers still commit it.
    for res in run_ranks(
        _stalled_then_no_wait_rank, 2, args=(root,), timeout=400, return_failures=True
    ):
        assert res.ok, res.error
        assert "CheckpointError" in res.value["error"], res.value["error"]
        assert res.value["seconds"] < 40, res.value["seconds"]
        assert res.value["paced_s"] < 60, res.value["paced_s"]
        assert "still in flight at exit" in res.log, res.log
    assert _wait_for(f"{root}/no-wait/fastinit-commit.json", 120)
    # Every trainer SIGKILLed right after save returned: committed, and bit-equal.
    with pytest.raises(RanksFailed):
        run_ranks(_killed_after_save_rank, 2, args=(root,), timeout=400)
    assert _wait_for(f"{root}/killed/fastinit-commit.json", 120)
    for out in run_ranks(_load_killed_rank, 2, args=(root, "killed"), timeout=400):
        assert out["diff"] == [], out
    # A trainer killed before its save returned: the previous checkpoint stays the latest.
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_killed_before_return_rank, 2, args=(root,), timeout=400, grace=120)
    rank0 = failed.value.results[0]
    assert rank0.ok and "CheckpointError" in rank0.value["error"], rank0
    from fastinit.checkpoint import CheckpointManager

    latest = CheckpointManager(f"{root}/runs").latest()
    assert latest is not None and latest[0] == 1, latest
    # No writer outlives its job.
    deadline = time.monotonic() + 60
    while set(_writers_of(root)) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_writers_of(root)) - before


def _wait_idle(writer: Any) -> None:
    """Until the writer is idle: blocked reading its pipe twice in a row (its start-up done, the
    hello read)."""
    pid, fd = writer.proc.pid, int(writer.proc.args[-1])
    idle, deadline, call = 0, time.monotonic() + 120, []
    while idle < 2 and time.monotonic() < deadline:
        with open(f"/proc/{pid}/syscall") as f:
            call = f.read().split()
        idle = idle + 1 if call[1:2] == [hex(fd)] else 0  # read or poll of its pipe
        time.sleep(0.2)
    assert idle == 2, f"the writer never waited on its pipe ({call})"


def test_the_writer_process_waits_for_its_first_job_to_import_torch() -> None:
    """A writer starts beside its trainer's start-up; torch and DCP (2 s of CPU) load only with
    its first job, so they do not slow a restart's start-up."""
    from fastinit.checkpoint.writer import WriterProcess

    writer = WriterProcess()
    pid = writer.proc.pid
    try:
        _wait_idle(writer)
        with open(f"/proc/{pid}/maps") as f:
            loaded = f.read()
        assert "libtorch" not in loaded and writer.alive()
    finally:
        writer.close()
        writer.proc.wait(60)


def _nice_of(pid: int, tid: int | None = None) -> int:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19, nice


def test_the_writer_and_the_staging_threads_run_below_the_trainer() -> None:
    """Checkpoint work beside the loop yields the CPU to the steps: the writer process runs
    ``BACKGROUND_NICE`` below its trainer, every thread of it and its session's autogroup too
    (where autogroup is on, a nice value ranks a thread only inside its session); a thread that
    lowers itself leaves the others, the trainer's, as they were."""
    from fastinit.checkpoint.priority import BACKGROUND_NICE, autogroup_nice, lower_priority
    from fastinit.checkpoint.writer import WriterProcess

    # the boot session's group (a container's processes that never called setsid) shows nothing
    assert autogroup_nice("") is None and autogroup_nice("/autogroup-7 nice -3\n") == -3
    mine = _nice_of(os.getpid())
    expect = min(19, mine + BACKGROUND_NICE)
    writer = WriterProcess()
    pid = writer.proc.pid
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            if all(_nice_of(pid, t) == expect for t in tids):
                break
            time.sleep(0.1)
        assert {t: _nice_of(pid, t) for t in tids} == {t: expect for t in tids}
        try:
            with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
                autogroup = f.read().strip() == "1"
        except OSError:
            autogroup = False
        if autogroup:
            with open(f"/proc/{pid}/autogroup") as f:
                group = f.read()
            with open("/proc/self/autogroup") as f:
                ours = f.read()  # empty in the boot session's group (a container without setsid)
            # the writer's setsid made it a group of its own, which shows its nice
            assert autogroup_nice(group) == min(19, BACKGROUND_NICE), (group, ours)
            assert group.split()[0] != (ours.split() or [""])[0], (group, ours)
    finally:
        writer.close()
        writer.proc.wait(60)
    seen: list[int] = []

    def background() -> None:
        assert lower_priority()
        seen.append(_nice_of(os.getpid(), threading.get_native_id()))

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen == [expect] and _nice_of(os.getpid(), threading.get_native_id()) == mine

    # A writer started by a thread that lowered itself (``prepare``'s) is still set against
    # the trainer, not 10 below that thread.
    started: list[Any] = []

    def start_writer() -> None:
        lower_priority()
        started.append(WriterProcess())

    t = threading.Thread(target=start_writer)
    t.start()
    t.join()
    writer = started[0]
    try:
        _wait_idle(writer)  # its own lowering done (it inherited ``expect`` already)
        assert _nice_of(writer.proc.pid) == expect
    finally:
        writer.close()
        writer.proc.wait(60)


# -- the host-memory tier --------------------------------------------------------------------------


def test_an_adopted_buffer_is_reused_with_the_tier_off(tmp_path: Any) -> None:
    """FASTINIT_CHECKPOINT_TIER=off keeps one buffer: a restarted worker that loaded the save
    its predecessor's buffer holds adopts it, and its next save stages into it (it was kept as
    "the tier", which nothing frees with the tier off: every later save failed)."""
    from fastinit.checkpoint.staging import HEADER_BYTES, Layout, Pool, Segment

    segment = Segment.create(str(tmp_path), "left-by-a-predecessor", HEADER_BYTES + (1 << 20))
    pool = Pool(0, keep_tier=False, shared=False)
    pool.adopt(segment, "a" * 32, tier=True)
    layout = Layout(slots=(), size=HEADER_BYTES + 64)
    assert pool.acquire(layout, "b" * 32, {"job": "test"}) is segment
    pool.release()


def test_an_adopted_buffer_names_its_new_owner() -> None:
    """A restarted worker adopts the buffer its dead predecessor left; its header then names
    the adopter, so another process's reclaim (a test session ending, another job starting)
    leaves it alone (it named the dead predecessor, and a reclaim removed it under the worker:
    its next save failed with FileNotFoundError)."""
    import subprocess

    from fastinit.checkpoint import saving, tier
    from fastinit.checkpoint.staging import HEADER_BYTES, PREFIX, Pool, Segment, shm_dir

    directory = shm_dir()
    if directory is None:
        pytest.skip("no /dev/shm")
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}.{os.getuid()}.test-adopt-{os.getpid()}.r0"
    segment = Segment.create(directory, name, HEADER_BYTES + (1 << 20))
    segment.write_header(
        {"job": saving._job(), "pid": dead.pid, "ppid": os.getppid(), "writer": None,
         "rank": 0, "save_id": "a" * 32}
    )  # fmt: skip
    segment.close()
    saver = saving._Saver()
    saver.pool = Pool(0, keep_tier=True, shared=True)
    saver.writer = saving.WriterThread()
    try:
        saver._take_over(0)
        assert [b[3] for b in saver.pool.buffers()] == [segment.path]
        assert segment.path not in tier.reclaim(launcher=os.getppid())  # even its own launcher's
        assert os.path.exists(str(segment.path))
    finally:
        saver.pool.release()
        saver.writer.close()
        with contextlib.suppress(OSError):
            os.unlink(str(segment.path))


def test_spare_buffers_of_a_dead_trainer_are_reclaimed_or_adopted() -> None:
    """A buffer allocated ahead of the first save (no save has named it yet) says who holds it
    from its creation: a trainer killed before its first save leaves one that a reclaim
    removes once its trainer and launcher are gone, and that a restarted worker of the same
    launcher adopts (it was never reclaimed: /dev/shm kept a dead job's spare buffers). A spare
    buffer of an older fastinit (no header; its creator's pid in its name) is removed once that
    process is gone, and left alone while it runs."""
    import subprocess

    from fastinit.checkpoint import saving, tier
    from fastinit.checkpoint.staging import HEADER_BYTES, PREFIX, Pool, Segment, shm_dir

    directory = shm_dir()
    if directory is None:
        pytest.skip("no /dev/shm")
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = {"job": saving._job(), "pid": dead.pid, "ppid": os.getppid(), "writer": None}
    size = HEADER_BYTES + (1 << 20)
    paths = []
    try:
        for _ in range(2):
            spare = Pool(0, keep_tier=True, shared=True)
            spare.owner = owner
            spare.reserve(size, count=1)
            paths += [b[3] for b in spare.buffers()]
            for state, _, _, path in spare.buffers():
                assert state == "free"
                with open(str(path), "rb") as f:
                    assert b'"pid": %d' % dead.pid in f.read(HEADER_BYTES)
            spare._entries.clear()  # as a killed trainer leaves it: not released
        # A restart of the same launcher adopts one (with the tier off it keeps one buffer).
        saver = saving._Saver()
        saver.pool = Pool(0, keep_tier=False, shared=True)
        saver.writer = saving.WriterThread()
        saver._take_over(0)
        adopted = [b[3] for b in saver.pool.buffers()]
        assert len(adopted) == 1 and adopted[0] in paths
        saver.pool.release()
        (other,) = set(paths) - set(adopted)
        # The other: removed then (no room for it), or by a reclaim once its launcher is gone.
        assert not os.path.exists(str(other)) or tier.reclaim(launcher=os.getppid()) == [other]
        assert not os.path.exists(str(other))
        # An older fastinit's spare buffers: no header, the creator's pid in the name.
        old = {}
        for pid in (dead.pid, os.getpid()):
            name = f"{PREFIX}.{os.getuid()}.free-{pid}-{os.urandom(4).hex()}.r0"
            Segment.create(directory, name, size).close()
            old[pid] = os.path.join(directory, name)
            paths.append(old[pid])
        removed = tier.reclaim(launcher=os.getppid())
        assert old[dead.pid] in removed and old[os.getpid()] not in removed
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(str(path))


def _newest_seen_rank(root: str) -> dict[str, Any]:
    """Steps 1 and 2 committed; rank 0 lists the directory before step 2's commit landed (as a
    restarted job sees its predecessor's writers finish the last save), rank 1 after it."""
    import warnings

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=4)
    manager = checkpoint.CheckpointManager(f"{root}/newest")
    refs = {}
    for step in (1, 2):
        _train(model, opts, seed=40 + step)
        refs[step] = _local(model, opts)
        manager.save(step, model, opts)
        manager.wait()
    fresh, fresh_opts = _build(PLAN_A, seed=5)
    late = checkpoint.CheckpointManager(f"{root}/newest")
    if _rank() == 0:
        late.committed = lambda: [1]  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        late.load_latest(fresh, fresh_opts)
    out: dict[str, Any] = {
        "step": late.loaded_step,
        "diff": _diff(refs[1], _local(fresh, fresh_opts)),
        "warned": any("step 1 to step 2" in str(w.message) for w in caught),
    }
    # A rank that sees no checkpoint where the others see some: the same error on every rank.
    blind = checkpoint.CheckpointManager(f"{root}/newest")
    if _rank() == 1:
        blind.committed = lambda: []  # type: ignore[method-assign]
    out["blind"] = _error_of(lambda: blind.load_latest(fresh, fresh_opts))
    return out


def test_every_rank_loads_the_same_step_when_a_commit_lands_while_they_look(
    tmp_path: Any,
) -> None:
    for out in run_ranks(_newest_seen_rank, 2, args=(str(tmp_path),), timeout=400):
        assert out["step"] == 1 and out["diff"] == [] and out["warned"], out
        assert "is the directory shared" in out["blind"], out


def _tier_save_rank(root: str) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=3)
    _train(model, opts, seed=30)
    torch.save(_local(model, opts), f"{root}/ref-3-rank{_rank()}.pt")
    manager = checkpoint.CheckpointManager(f"{root}/job")
    handle = manager.save(1, model, opts)
    assert handle is not None
    manager.wait()
    # the job dies here: the harness leaves with os._exit, so the staging buffers stay
    return {"staged": handle.staged_bytes}


def _tier_load_rank(root: str) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=99)
    report = checkpoint.CheckpointManager(f"{root}/job").load_latest(model, opts)
    assert report is not None
    ref = torch.load(f"{root}/ref-3-rank{_rank()}.pt", weights_only=False)
    return {
        "diff": _diff(ref, _local(model, opts)),
        "memory": report.memory_bytes,
        "storage": report.bytes_read,
        "tier": report.tier,
        "fallbacks": report.tier_fallbacks,
    }


def _restarted_prepare_then_load_rank(root: str, attempt: int) -> dict[str, Any]:
    """One attempt of a job (torchelastic's run id kept, as torchrun keeps it): attempt 0
    saves and dies; attempt 1 calls ``prepare`` (which allocates and fills buffers, and takes
    over its predecessor's) before it loads: the load still reads the predecessor's buffer
    from memory."""
    from fastinit import checkpoint
    from fastinit.checkpoint import saving

    os.environ["TORCHELASTIC_RUN_ID"] = f"prepare-then-load-{os.getppid()}"
    if attempt == 0:
        return _tier_save_rank(root)
    model, opts = _build(PLAN_A, seed=99)
    checkpoint.prepare(model, opts, background=False)
    out = _tier_load_rank(root)
    out["adopted"] = sum(1 for b in saving.staging_info()["buffers"] if b[1])
    return out


@pytest.mark.timeout(600)
def test_a_prepare_before_the_load_keeps_the_host_memory_tier(tmp_path: Any) -> None:
    root = str(tmp_path)
    run_ranks(_restarted_prepare_then_load_rank, 2, args=(root, 0), timeout=400)
    for out in run_ranks(_restarted_prepare_then_load_rank, 2, args=(root, 1), timeout=400):
        assert out["adopted"] >= 1, out  # prepare took over the predecessor's buffer...
        assert out["diff"] == [] and out["storage"] == 0 and out["memory"] > 0, out  # ...intact


def _tier_load_then_no_shm_rank(root: str) -> dict[str, Any]:
    """The load (this process has no staging buffer yet), then a save with /dev/shm full."""
    import warnings

    from fastinit import checkpoint
    from fastinit.checkpoint import saving
    from fastinit.testing.faults import inject

    out = _tier_load_rank(root)
    model, opts = _build(PLAN_A, seed=3)
    with warnings.catch_warnings(record=True) as caught, inject("checkpoint.shm_alloc"):
        warnings.simplefilter("always")
        checkpoint.save(f"{root}/no-shm", model, opts, blocking=True)
    report = checkpoint.load(f"{root}/no-shm", model, opts)
    out["no_shm"] = {
        "warnings": [str(w.message) for w in caught if "shared memory" in str(w.message)],
        "writer": saving.staging_info()["writer"],
        "tier": report.tier,
    }
    return out


def _segments_of(save_id: str) -> dict[int, str]:
    from fastinit.checkpoint.staging import segment_name

    return {
        r: f"/dev/shm/{segment_name(save_id, r)}"
        for r in range(2)
        if os.path.exists(f"/dev/shm/{segment_name(save_id, r)}")
    }


@pytest.mark.timeout(900)
def test_restart_on_the_same_host_loads_from_memory_and_falls_back_to_storage(
    tmp_path: Any,
) -> None:
    from fastinit.checkpoint import CheckpointManager
    from fastinit.checkpoint import format as fmt

    root = str(tmp_path)
    run_ranks(_tier_save_rank, 2, args=(root,), timeout=400)
    step, path = CheckpointManager(f"{root}/job").latest()  # type: ignore[misc]
    save_id = fmt.read_commit(path).save_id
    segments = _segments_of(save_id)
    assert sorted(segments) == [0, 1], segments
    for seg in segments.values():  # owner-only
        assert os.stat(seg).st_mode & 0o777 == 0o600

    # The same host: no tensor data read from the checkpoint directory, bit-equal.
    for out in run_ranks(_tier_load_rank, 2, args=(root,), timeout=400):
        assert out["diff"] == [] and out["storage"] == 0 and out["memory"] > 0, out
        assert out["tier"] == "memory"

    # A staging buffer that differs from the commit: those items come from storage.
    manifest, _ = fmt.read_manifest(path, fmt.read_commit(path), 1)
    item = max(manifest.items, key=lambda i: i.nbytes)
    _flip(segments[1], item.segment_offset + item.nbytes // 2)
    # Another user's buffer (rank 0's, chowned): never opened.
    os.chown(segments[0], 65534, 65534)
    outs = run_ranks(_tier_load_rank, 2, args=(root,), timeout=400)
    assert outs[0]["diff"] == [] and outs[0]["memory"] == 0 and outs[0]["storage"] > 0, outs[0]
    assert outs[1]["diff"] == [] and outs[1]["fallbacks"] and outs[1]["memory"] > 0, outs[1]
    assert outs[1]["tier"] == "mixed"

    # A buffer under the right name holding another save: never read.
    os.chown(segments[0], os.getuid(), os.getgid())
    with open(segments[0], "r+b") as f:
        f.write(b'{"save_id": "' + b"0" * 32 + b'", "rank": 0}'.ljust(64))
    # A replaced host: rank 1's buffer is not there. Then a full /dev/shm: one warning, the
    # trainer's own memory and a thread, storage on load.
    os.remove(segments[1])
    for out in run_ranks(_tier_load_then_no_shm_rank, 2, args=(root,), timeout=400):
        assert out["diff"] == [] and out["memory"] == 0 and out["tier"] == "storage", out
        assert len(out["no_shm"]["warnings"]) == 1, out
        assert out["no_shm"]["writer"] == "thread" and out["no_shm"]["tier"] == "storage", out
    os.remove(segments[0])


# -- re-plans that move a table between data-parallel and sharded ---------------------------------

# t4 data-parallel and t0 table-wise, then the other way round (every other table kept).
PLAN_DP = {**PLAN_A, "t4": "data_parallel", "t0": "table_wise"}
PLAN_TW = {**PLAN_A, "t4": "table_wise", "t0": "data_parallel"}


def _replan_save_rank(root: str, types: dict[str, str], tag: str) -> None:
    from fastinit import checkpoint

    model, opts = _build(types, seed=5)
    _train(model, opts, seed=50)
    checkpoint.save(f"{root}/{tag}", model, opts, blocking=True)
    _stock_save(f"{root}/{tag}-stock", model, opts)


def _stock_load(path: str, model: Any, optimizers: dict[str, Any]) -> dict[str, Any]:
    """DCP's own resharded load of ``path`` (what it can carry) into ``model`` and
    ``optimizers``: the reference a re-planned load is compared with; their local values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from fastinit.checkpoint.state import build_state

    state = build_state(model, optimizers)
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    model.load_state_dict(state["model"])
    for name, opt in optimizers.items():
        opt.load_state_dict(state[name])
    return _local(model, optimizers)


def _replan_load_rank(root: str, types: dict[str, str], tag: str) -> dict[str, Any]:
    from fastinit import checkpoint, knobs

    ours, ours_opts = _build(types, seed=21)
    fresh = _local(ours, ours_opts)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="off"):
        report = checkpoint.load(f"{root}/{tag}", ours, ours_opts)
        strict = _error_of(lambda: checkpoint.load(f"{root}/{tag}", ours, ours_opts, strict=True))
    got = _local(ours, ours_opts)
    ref = _stock_load(f"{root}/{tag}-stock", *_build(types, seed=22))
    missing = sorted(report.missing)
    carried = {k: v for k, v in got.items() if k not in report.missing}
    return {
        "mode": report.mode,
        "missing": missing,
        "reasons": sorted(set(report.missing.values())),
        "carried_diff": _diff(carried, {k: v for k, v in ref.items() if k in carried}),
        "missing_kept_fresh": _diff({k: fresh[k] for k in missing}, {k: got[k] for k in missing}),
        "strict": strict,
    }


@pytest.mark.timeout(900)
def test_replan_moving_tables_between_data_parallel_and_sharded(tmp_path: Any) -> None:
    root = str(tmp_path)
    run_ranks(_replan_save_rank, 2, args=(root, PLAN_DP, "dp"), timeout=400)
    run_ranks(_replan_save_rank, 2, args=(root, PLAN_TW, "tw"), timeout=400)
    for tag, types in (("dp", PLAN_TW), ("tw", PLAN_DP)):
        outs = run_ranks(_replan_load_rank, 2, args=(root, types, tag), timeout=400)
        # A rank holds only its own tables' fused state: each names what it lacks of its own.
        missing = sorted({k for out in outs for k in out["missing"]})
        assert missing and all(".t4." in k or ".t0." in k for k in missing), missing
        assert any(k.startswith("optim.") for k in missing), missing  # a fused state
        assert any(k.startswith("dense.") for k in missing), missing  # a dense one
        assert not any(k.startswith("model.") for k in missing), missing  # weights carried
        for out in outs:
            assert out["mode"] in ("resharded", "same-plan"), out
            assert out["carried_diff"] == [], out["carried_diff"]
            assert out["missing_kept_fresh"] == [], out
            # strict: refused on every rank (the rank lacking a value says which)
            assert "strict=True" in out["strict"] or "failed on rank" in out["strict"], out
        assert any("strict=True" in out["strict"] for out in outs)


# The default planner's own choices move tables between data-parallel and table-wise when the
# world size changes (with 200-row tables: w0, t1 and t3 are table-wise at 2 ranks and
# data-parallel at 4).
SPEC_PLANNED = {**_SPEC, "rows": 200}


def _planned(seed: int) -> Any:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model

    module = build_model(ModelSpec(**SPEC_PLANNED), device="meta", seed=seed)
    params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharders = [
        EmbeddingBagCollectionSharder(fused_params=dict(params)),
        EmbeddingCollectionSharder(fused_params=dict(params)),
    ]
    model = fastinit.setup(module, sharders=sharders, seed=seed)  # the default planner plans
    # (SGD: Adam's and Adagrad's eps underflow in the fp16 tables the dense optimizer gets when
    # they are data-parallel, and their first step makes NaNs, stock as fastinit)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    )
    dense.init_state()
    types = {t: ps.sharding_type for mp in model.plan.plan.values() for t, ps in mp.items()}
    return model, {"optim": model.fused_optimizer, "dense": dense}, types


def _planned_save_rank(root: str, tag: str) -> dict[str, str]:
    from fastinit import checkpoint
    from fastinit.testing.models import ModelSpec, make_batch

    model, opts, types = _planned(seed=6)
    loss, _ = model(make_batch(ModelSpec(**SPEC_PLANNED), 16, seed=60 + _rank()))
    loss.backward()
    opts["dense"].step()
    checkpoint.save(f"{root}/{tag}", model, opts, blocking=True)
    _stock_save(f"{root}/{tag}-stock", model, opts)
    return types


def _planned_load_rank(root: str, tag: str) -> dict[str, Any]:
    from fastinit import checkpoint, knobs

    ours, ours_opts, types = _planned(seed=21)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="off"):
        report = checkpoint.load(f"{root}/{tag}", ours, ours_opts)
    got = _local(ours, ours_opts)
    ref = _stock_load(f"{root}/{tag}-stock", *_planned(seed=22)[:2])
    carried = [k for k in got if k not in report.missing]
    return {
        "types": types,
        "missing": sorted(report.missing),
        "carried_diff": _diff({k: got[k] for k in carried}, {k: ref[k] for k in carried}),
    }


@pytest.mark.timeout(1500)
def test_replan_across_world_sizes_with_the_default_planners_choices(tmp_path: Any) -> None:
    root = str(tmp_path)
    four = run_ranks(_planned_save_rank, 4, args=(root, "w4"), local_world_size=2, timeout=700)
    two = run_ranks(_planned_save_rank, 2, args=(root, "w2"), timeout=700)
    moved = sorted(
        t for t in two[0] if (two[0][t] == "data_parallel") != (four[0][t] == "data_parallel")
    )
    assert moved, (two[0], four[0])  # the planner itself moved a table between DP and sharded
    outs = run_ranks(_planned_load_rank, 2, args=(root, "w4"), timeout=700)  # 4 -> 2
    outs += run_ranks(  # 2 -> 4
        _planned_load_rank, 4, args=(root, "w2"), local_world_size=2, timeout=700
    )
    for out in outs:
        assert out["carried_diff"] == [], out["carried_diff"]
        assert not any(k.startswith("model.") for k in out["missing"]), out["missing"]
        assert all(any(f".{t}." in k for t in moved) for k in out["missing"]), out["missing"]
    assert any(out["missing"] for out in outs)


def _rss_kb(path: str) -> int:
    """Resident kB of this process's mapping of ``path`` (``/proc/self/smaps``)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1])
    return rss


def test_a_buffer_opened_for_saves_has_its_pages_mapped() -> None:
    """A restarted worker's adopted buffer (``Segment.open(writable=True)``) is mapped with its
    pages present: the first save after a restart faulted in 1 GB on the loop (3.2x the warm
    copy in the checkpoint-heavy scenario)."""
    from fastinit.checkpoint.staging import HEADER_BYTES, PREFIX, Segment, shm_dir

    directory = shm_dir()
    if directory is None or not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /dev/shm or /proc")
    size = HEADER_BYTES + (64 << 20)
    made = Segment.create(directory, f"{PREFIX}.{os.getuid()}.test-populate-{os.getpid()}.r0", size)
    made.close()
    path = str(made.path)
    try:
        opened = Segment.open(path, writable=True)
        try:
            assert _rss_kb(path) >= size // 1024 * 9 // 10
        finally:
            opened.close()
    finally:
        os.unlink(path)
