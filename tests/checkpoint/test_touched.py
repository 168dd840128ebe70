"""Saves that copy only the rows training touched (fastinit/checkpoint/touched.py): every
checkpoint is still the whole state at its save, bit for bit, whatever wrote the tables between
saves (the fused backward, torch in place, a load, a write behind torch's back)."""

from __future__ import annotations

from typing import Any

import pytest

from fastinit.testing.dist import run_ranks

# Tables big enough that a save copies them by rows (a slot of at least 1 MiB, rows of 128 or
# 256 B): bags (one of them fp16), weighted bags and sequence tables, every sharding type.
SPEC = {
    "num_tables": 4,
    "num_weighted_tables": 1,
    "num_ec_tables": 2,
    "rows": 8192,
    "dims": (64,),
    "ec_dim": 64,
    "fp16_every": 4,
}
PLAN = {
    "t0": "table_wise",
    "t1": "row_wise",
    "t2": "column_wise",
    "t3": "table_row_wise",
    "w0": "table_wise",
    "e0": "row_wise",
    "e1": "table_wise",
}


def _nice(tid: int | None = None) -> int:
    """The nice value of thread ``tid`` of this process (None: the calling thread)."""
    import os
    import threading

    tid = threading.get_native_id() if tid is None else tid
    with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19, nice


def _save(path: str, model: Any, opts: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from fastinit import checkpoint
    from tests.checkpoint.test_checkpoint import _local

    state = _local(model, opts)
    handle = checkpoint.save(path, model, opts)
    handle.wait()
    return handle, state


def _loads_as(path: str, want: dict[str, Any], seed: int) -> list[str]:
    """What differs between ``want`` and the checkpoint at ``path`` loaded from storage into
    a fresh model."""
    from fastinit import checkpoint, knobs
    from tests.checkpoint.test_checkpoint import _build, _diff, _local

    fresh, fresh_opts = _build(PLAN, seed=seed, spec_kwargs=SPEC)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="off"):
        checkpoint.load(path, fresh, fresh_opts)
    return _diff(want, _local(fresh, fresh_opts))


def _touched_rank(root: str) -> dict[str, Any]:
    import warnings

    import torch

    from fastinit import checkpoint
    from fastinit.checkpoint import saving
    from tests.checkpoint.test_checkpoint import _build, _train

    model, opts = _build(PLAN, seed=1, spec_kwargs=SPEC)
    out: dict[str, Any] = {"saves": []}
    states: dict[str, Any] = {}

    pipeline: list[Any] = []  # once there, the steps are its steps

    def one(name: str, steps: int = 1) -> None:
        for i in range(steps):
            if pipeline:
                pipeline[0].progress(data)
            else:
                _train(model, opts, seed=100 * len(states) + i, spec=SPEC)
        handle, states[name] = _save(f"{root}/{name}", model, opts)
        out["saves"].append((name, handle.copied_bytes, handle.staged_bytes))

    # The first save fills a buffer whole, which a thread copies into the other buffer; the
    # next saves copy the touched rows.
    for name in ("c0", "c1", "c2", "c3"):
        one(name)
    # torch writes a row no batch touched, in place: that table is copied whole.
    table = model.state_dict()["sparse.ebc.embedding_bags.t0.weight"]
    if table.local_shards():
        with torch.no_grad():
            table.local_shards()[0].tensor[-1].add_(1.0)
    one("inplace")
    # Roll back to c1 with a load (it writes through files, behind the version counters).
    checkpoint.load(f"{root}/c1", model, opts)
    out["cleared_by_load"] = not saving._SAVER.touched._acc
    one("rollback")
    one("after-rollback")
    one("rows-again")
    # Steps of TrainPipelineSparseDist (its rewrite of the model, the next batch's input
    # distribution in flight at the save): still by rows, still the whole state.
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from fastinit.testing.models import ModelSpec, batches

    pipeline.append(TrainPipelineSparseDist(model, opts["dense"], torch.device("cpu")))
    it = batches(ModelSpec(**SPEC), 16, seed=500 + torch.distributed.get_rank())
    data = iter([next(it) for _ in range(9)])
    one("pipe-1", 2)
    one("pipe-2", 2)
    # A write no one counts (through numpy): the sampled check sees it and copies whole.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shard in model.state_dict()["sparse.ebc.embedding_bags.t2.weight"].local_shards():
            shard.tensor.detach().numpy()[:] += 1.0
        one("behind")
        one("after-behind")
    out["warned"] = [str(w.message) for w in caught if "writes the tables" in str(w.message)]
    out["broken"] = saving._SAVER.touched.broken is not None
    out["ahead"] = saving._SAVER.touched.ahead_bytes
    out["diffs"] = {name: _loads_as(f"{root}/{name}", want, 7) for name, want in states.items()}
    return out


@pytest.mark.timeout(600)
def test_saves_by_touched_rows_hold_the_whole_state(tmp_path: Any) -> None:
    results = run_ranks(_touched_rank, 2, args=(str(tmp_path),), timeout=540)
    for r in results:
        out = r
        assert all(not d for d in out["diffs"].values()), out["diffs"]
        copied = {name: (c, s) for name, c, s in out["saves"]}
        assert copied["c0"][0] == copied["c0"][1]
        # by rows: a small part of the state (one step of 16 samples per save); c1 into the
        # buffer the first save's copy was mirrored into
        for name in ("c1", "c2", "c3", "rows-again", "pipe-1", "pipe-2"):
            assert 0 < copied[name][0] < copied[name][1] / 4, (name, copied[name])
        # the save after the rollback copies the state whole: the load cleared every buffer's
        # record; its copy is mirrored into the spare buffer, which the next save copies rows
        # into (FASTINIT_CHECKPOINT_AHEAD, on by default)
        assert copied["rollback"][0] == copied["rollback"][1]
        assert 0 < copied["after-rollback"][0] < copied["after-rollback"][1] / 4
        # after the write behind torch's back: whole, from then on, with one warning
        assert copied["after-behind"][0] == copied["after-behind"][1]
        assert out["broken"] and len(out["warned"]) >= 1
        assert out["cleared_by_load"]
        assert out["ahead"] > 0  # rows were copied ahead between the saves


def _off_rank(root: str) -> list[tuple[int, int]]:
    from fastinit import knobs
    from fastinit.checkpoint import saving
    from tests.checkpoint.test_checkpoint import _build, _train

    with knobs.override(FASTINIT_CHECKPOINT_DELTA="off"):
        model, opts = _build(PLAN, seed=1, spec_kwargs=SPEC)
        sizes = []
        for i in range(3):
            _train(model, opts, seed=i, spec=SPEC)
            handle, _ = _save(f"{root}/c{i}", model, opts)
            sizes.append((handle.copied_bytes, handle.staged_bytes))
        assert saving._SAVER.touched is None
    return sizes


@pytest.mark.timeout(300)
def test_delta_off_copies_every_byte(tmp_path: Any) -> None:
    (r,) = run_ranks(_off_rank, 1, args=(str(tmp_path),), timeout=240)
    assert all(c == s > 0 for c, s in r)


def _ahead_off_rank(root: str) -> dict[str, Any]:
    from fastinit import knobs
    from fastinit.checkpoint import saving
    from tests.checkpoint.test_checkpoint import _build, _train

    out: dict[str, Any] = {"saves": [], "diffs": []}
    with knobs.override(FASTINIT_CHECKPOINT_AHEAD="off"):
        model, opts = _build(PLAN, seed=1, spec_kwargs=SPEC)
        for i in range(4):
            _train(model, opts, seed=i, spec=SPEC)
            handle, want = _save(f"{root}/c{i}", model, opts)
            out["saves"].append((handle.copied_bytes, handle.staged_bytes, handle.ahead_bytes))
            out["diffs"].append(_loads_as(f"{root}/c{i}", want, 7))
        out["buffers"] = len(saving.staging_info()["buffers"])
        out["ahead"] = saving._SAVER.touched.ahead_bytes
    return out


@pytest.mark.timeout(300)
def test_ahead_off_keeps_two_buffers_and_still_copies_rows(tmp_path: Any) -> None:
    """FASTINIT_CHECKPOINT_AHEAD=off: no spare buffer (the save in flight's and the tier's),
    nothing copied ahead, and the saves after the first still copy only touched rows."""
    (r,) = run_ranks(_ahead_off_rank, 1, args=(str(tmp_path),), timeout=240)
    assert all(not d for d in r["diffs"]), r["diffs"]
    assert r["buffers"] == 2 and r["ahead"] == 0
    assert all(a == 0 for _, _, a in r["saves"])
    assert r["saves"][0][0] == r["saves"][0][1]
    assert all(0 < c < s / 4 for c, s, _ in r["saves"][1:]), r["saves"]


def test_rows_of_a_batch_and_unknown_layouts() -> None:
    import numpy as np
    import torch

    from fastinit.checkpoint.touched import Touched, _Module

    t = Touched()
    # two tables of 10 and 5 rows; features 0 -> table 0, 1 and 2 -> table 1; batch of 2
    mod = _Module(None, 15, np.array([0, 10]), np.array([0, 1, 1]), None)
    indices = torch.tensor([1, 4, 2, 3, 3, 4, 0])
    offsets = torch.tensor([0, 1, 3, 4, 5, 6, 7])
    assert t._rows_of(mod, indices, offsets, None).tolist() == [1, 4, 2, 13, 13, 14, 10]
    # variable batch sizes per feature (one rank each: 1, 2 and 3 samples)
    vbe = t._rows_of(mod, indices, offsets, [[1], [2], [3]])
    assert vbe.tolist() == [1, 14, 12, 13, 13, 14, 10]
    # offsets that do not split into the features, or do not end at the indices: unknown
    assert t._rows_of(mod, indices, torch.tensor([0, 1, 3, 5, 7]), None) is None
    assert t._rows_of(mod, indices, torch.tensor([0, 1, 3, 4, 5, 6, 9]), None) is None
    assert t._rows_of(mod, indices, offsets, [[1], [1]]) is None
    # a row outside the module (a bad id; the kernel would refuse it): unknown, every row
    assert t._rows_of(mod, torch.tensor([1, 4, 2, 3, 3, 4, 9]), offsets, None) is None
    assert t._rows_of(mod, torch.tensor([1, 4, 2, 3, 3, 4, -1]), offsets, None) is None


def _tbe(rows: tuple[int, ...] = (100, 50), dim: int = 8) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        feature_table_map=[0, 1, 1],
    )


def test_the_rows_recorded_are_the_rows_the_kernel_writes() -> None:
    import gc
    import pickle

    import torch

    from fastinit.checkpoint.touched import Touched

    t = Touched()
    tbe = _tbe()
    assert t.attach(tbe) == 1
    key = id(tbe)
    t._acc = {1: {key: torch.zeros(150, dtype=torch.bool)}}
    before = torch.cat([w.detach().clone() for w in tbe.split_embedding_weights()])
    indices = torch.tensor([1, 5, 7, 3, 3, 9, 10, 0])
    offsets = torch.tensor([0, 1, 3, 4, 6, 7, 8])  # 3 features x 2 samples
    with torch.no_grad():
        tbe(indices, offsets)  # no backward: nothing written, nothing recorded
    assert not t._acc[1][key].any()
    tbe(indices, offsets).sum().backward()
    after = torch.cat([w.detach() for w in tbe.split_embedding_weights()])
    written = (before != after).any(dim=1)
    assert written.any()
    assert torch.equal(t._acc[1][key], written)  # table 1's rows from 100 on
    # the kernel's update leaves the version counter alone (the hooks are what see it)
    assert tbe.weights_host._version == 0
    # a model that carries the hooks still pickles (the hook is a partial of a module function)
    hooks = pickle.loads(pickle.dumps(list(tbe._forward_hooks.values())))
    assert len(hooks) == 1
    # a dropped module is forgotten, and a new one (perhaps at the same id) is tracked
    del tbe
    gc.collect()
    other = _tbe((20, 30))
    assert t.attach(other) == 1
    t.close()
    assert not other._forward_hooks
    from fastinit.checkpoint.touched import _HOOKS

    assert not any(ref() is t for ref, _ in _HOOKS.values())  # nothing of the closed one left


def test_the_first_copy_is_mirrored_into_the_next_saves_buffer() -> None:
    """After a job's first save, a thread copies its buffer into the buffer the next save
    takes (allocating it when there is none yet); the pool waits for that copy before it hands
    a buffer out (or frees or unmaps one), and the buffer then holds the first save's bytes. A
    buffer that already holds a copy of this process's is not copied into."""
    import os
    import threading

    from fastinit.checkpoint.priority import BACKGROUND_NICE
    from fastinit.checkpoint.staging import HEADER_BYTES, Layout, Pool

    pool = Pool(0, keep_tier=True, shared=True)
    if not pool.shared:
        pytest.skip("no /dev/shm")
    size = HEADER_BYTES + (4 << 20)
    layout = Layout(slots=(), size=size)
    try:
        # headers that name this process, as a save's do: another process's reclaim leaves them
        first = pool.acquire(layout, "a" * 32, {**pool.owner, "job": "test"})  # the only buffer
        payload = os.urandom(size - HEADER_BYTES)
        first.mm[HEADER_BYTES:size] = payload
        release = threading.Event()
        done: list[Any] = []

        def finish(segment: Any) -> None:
            release.wait(30)  # the copy is made; its end waits for the timer below
            segment.touched = "mirrored"
            done.append(
                (segment, threading.current_thread().name, _nice(threading.get_native_id()))
            )

        assert pool.mirror(first, size, finish)
        threading.Timer(0.3, release.set).start()
        # The next save's buffer, asked for while the copy is still going: the copy's buffer,
        # once complete (without the wait, a third buffer, or one half-copied).
        second = pool.acquire(layout, "b" * 32, {**pool.owner, "job": "test"})
        ((spare, thread, nice),) = done
        assert thread == "fastinit-checkpoint-mirror" and spare is not first
        # the copy ran below the caller (fastinit/checkpoint/priority.py), and only the copy
        assert nice == min(19, _nice() + BACKGROUND_NICE), nice
        assert second is spare and len(pool.buffers()) == 2
        assert bytes(second.mm[HEADER_BYTES:size]) == payload
        pool.settle("a" * 32, committed=True)  # the first buffer becomes the tier
        assert pool.shared, pool.warning  # (the tier is kept only in shared memory)
        assert not pool.mirror(second, size, finish), pool.buffers()  # no room: the tier busy
        pool.settle("b" * 32, committed=True)  # the second is the tier, the first free
        first.touched = "a fill"
        assert not pool.mirror(second, size, finish)  # the free one holds a copy
    finally:
        pool.release()


def _prefill_rank(root: str) -> dict[str, Any]:
    import torch

    from fastinit import checkpoint
    from fastinit.testing.faults import inject
    from tests.checkpoint.test_checkpoint import _build, _train

    model, opts = _build(PLAN, seed=1, spec_kwargs=SPEC)
    out: dict[str, Any] = {"saves": [], "alive": []}
    states: dict[str, Any] = {}
    # Each buffer's fill waits 2 s between its copy and its adoption while the loop trains:
    # rows the steps write after prepare() returned, before and after the copy, must reach
    # the checkpoint through the rows recorded since prepare().
    with inject("checkpoint.prefill", "sleep", seconds=2.0):
        thread = checkpoint.prepare(model, opts, background=True)
        for i in range(3):
            _train(model, opts, seed=10 + i, spec=SPEC)
        out["alive"].append(thread is not None and thread.is_alive())
        if thread is not None and thread.is_alive():  # its fill sleeps: still there to look at
            out["nice"] = (_nice(thread.native_id), _nice())
        for name in ("p0", "p1", "p2"):
            _train(model, opts, seed=20 + len(states), spec=SPEC)
            handle, states[name] = _save(f"{root}/{name}", model, opts)
            out["saves"].append((name, handle.copied_bytes, handle.staged_bytes))
    torch.distributed.barrier()
    out["diffs"] = {name: _loads_as(f"{root}/{name}", want, 7) for name, want in states.items()}
    return out


@pytest.mark.timeout(600)
def test_prepare_fills_the_buffers_so_the_first_saves_copy_rows(tmp_path: Any) -> None:
    """``checkpoint.prepare`` copies the state into both staging buffers on its thread, below
    the loop's priority, while the loop trains: the first save and the next (the other buffer)
    copy only the rows trained since, and every checkpoint is the state at its save, bit for
    bit."""
    from fastinit.checkpoint.priority import BACKGROUND_NICE

    for out in run_ranks(_prefill_rank, 2, args=(str(tmp_path),), timeout=540):
        assert out["alive"] == [True]  # the steps ran while the fill was still going
        staging, caller = out["nice"]  # the fill's thread below the loop's, which is untouched
        assert staging == min(19, caller + BACKGROUND_NICE), out["nice"]
        assert all(not d for d in out["diffs"].values()), out["diffs"]
        for name, copied, staged in out["saves"]:
            assert 0 < copied < staged / 4, (name, copied, staged)


# -- copying ahead -----------------------------------------------------------------------------


def _ahead_setup() -> Any:
    """A tracked fused module (two tables of 1 MiB, rows of 64 B) copied whole into a buffer
    that rows are copied ahead into."""
    import torch

    from fastinit.checkpoint.staging import Layout, Segment, copy_in
    from fastinit.checkpoint.touched import Touched

    t = Touched()
    tbe = _tbe(rows=(16384, 16384), dim=16)
    assert t.attach(tbe) == 1
    tensors = [w.detach() for w in tbe.split_embedding_weights()]
    layout = Layout.of([(f"t{i}", (0, 0), w) for i, w in enumerate(tensors)])
    segment = Segment.private(layout.size)
    free = [segment]
    t.copy_ahead(lambda: list(free))
    fill = t.begin(layout, tensors)
    copy_in(segment, layout, tensors)
    t.adopt_fill(fill, segment)
    gen = torch.Generator().manual_seed(0)  # never the global RNG

    def step(backward: bool = True) -> None:
        indices = torch.randint(0, 16384, (96,), generator=gen)
        offsets = torch.arange(0, 97, 4)  # 3 features (tables 0, 1, 1) x 8 samples
        out = tbe(indices, offsets)
        if backward:
            out.sum().backward()

    def held() -> Any:  # what the buffer holds of each table
        return [segment.slot(slot).clone() for slot in layout.slots]

    return t, tbe, tensors, layout, segment, step, held


def _recorded(t: Any, segment: Any) -> int:
    with t._lock:
        return sum(int(m.sum()) for m in t._acc[segment.touched.token].values())


def test_rows_are_copied_ahead_between_saves_and_the_save_copies_the_rest() -> None:
    """Each forward hands the rows recorded since the last one to a thread, which copies them
    into the buffer the next save takes; a save into it copies the rows of the last step only,
    and the buffer then holds the tables bit for bit."""
    import torch

    t, tbe, tensors, layout, segment, step, held = _ahead_setup()
    try:
        for _ in range(6):
            step()
            t._idle.wait(30)  # a forward that finds the thread busy leaves its rows recorded
        assert t.ahead_bytes > 0
        assert t.ahead_segment() is segment
        # what is left for the save: the last step's rows (the last forward came before them)
        left = _recorded(t, segment)
        assert 0 < left <= 96
        pending = t._acc[segment.touched.token][id(tbe)].clone()
        now = torch.cat([w.detach() for w in tensors])
        had = torch.cat(held())
        differ = (now != had).any(dim=1)
        assert differ.any() and not differ[~pending].any()  # every other row is there already
        with t.paused():
            copied = t.copy_in(segment, layout, tensors)
        assert 0 < copied <= left * 64 * 2  # row bytes: weights (and nothing else tracked)
        assert all(torch.equal(a, b) for a, b in zip(held(), tensors, strict=True))
    finally:
        t.close()


def test_rows_are_not_handed_over_while_a_backward_is_between_their_record_and_write() -> None:
    """A forward while a backward through the module has recorded rows it has not written yet
    (another thread's) hands nothing over: those rows could be copied before their write and
    then dropped from the record."""
    import torch

    t, tbe, tensors, layout, segment, step, held = _ahead_setup()
    try:
        step()  # rows recorded (its forward came before them)
        before = _recorded(t, segment)
        indices, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3])
        t._record(id(tbe), indices, offsets, None, counted=True)  # a record, its write to come
        assert t._in_flight == {id(tbe): 1}
        step(backward=False)
        assert _recorded(t, segment) >= before and t.ahead_bytes == 0  # nothing handed over
        t._written(id(tbe))
        step(backward=False)
        t._idle.wait(30)
        assert _recorded(t, segment) == 0 and t.ahead_bytes > 0
        # a real backward leaves nothing in flight: its node's post-hook ran after the write
        step()
        assert t._in_flight == {}
    finally:
        t.close()


def test_a_pause_stops_the_copy_ahead_and_gives_its_rows_back(monkeypatch: Any) -> None:
    """Handing out, freeing or unmapping a buffer pauses the copying thread: it stops at its
    next chunk of rows and the rows it did not copy go back to the record, for the save to copy."""
    import threading

    from fastinit.checkpoint import touched

    t, tbe, tensors, layout, segment, step, held = _ahead_setup()
    gate, entered = threading.Event(), threading.Event()
    copy = touched._copy_indexed

    def slow(src: Any, dst: Any, rows: Any) -> None:
        entered.set()
        gate.wait(30)
        copy(src, dst, rows)

    monkeypatch.setattr(touched, "_copy_indexed", slow)
    try:
        step()
        recorded = _recorded(t, segment)
        step(backward=False)  # hands them over; the thread stops in its first table
        assert entered.wait(30) and _recorded(t, segment) == 0
        threading.Timer(0.2, gate.set).start()
        with t.paused():
            assert t._idle.is_set()
            # table 0's rows were copied (the pause came during it); table 1's are back
            copied = t.ahead_bytes // 64  # rows of 64 bytes
            assert 0 < copied < recorded
            assert _recorded(t, segment) == recorded - copied
            assert t.ahead_segment() is None
            step(backward=False)  # nothing handed over while paused
            assert _recorded(t, segment) == recorded - copied
    finally:
        gate.set()
        t.close()
