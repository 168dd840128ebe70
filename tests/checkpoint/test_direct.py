"""The writer's data files (``fastinit.checkpoint.direct``): DCP's format, tensor data on 4 KiB
boundaries, the same bytes with and without ``O_DIRECT``, read back by DCP's own loader."""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from fastinit.checkpoint import direct
from fastinit.checkpoint.digest import file_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(mm: mmap.mmap) -> tuple[dict[str, Any], dict[str, int]]:
    """Tensors viewing ``mm`` at aligned and unaligned places, a small one, an empty one and a
    non-tensor value; and where each tensor's bytes begin in ``mm``."""
    g = torch.Generator().manual_seed(3)
    places = {
        "aligned": (4096, (300, 16)),
        "unaligned": (4096 * 8 + 64, (200, 8)),
        "odd": (
            4096 * 12,
            (1001, 3),  # 12,012 bytes: a tail past the last whole block
        ),
    }
    state: dict[str, Any] = {}
    for name, (at, shape) in places.items():
        t = torch.frombuffer(mm, dtype=torch.float32, count=shape[0] * shape[1], offset=at)
        t.copy_(torch.randn(shape, generator=g).flatten())
        state[name] = t.view(shape)
    state["small"] = torch.arange(5, dtype=torch.int64)
    state["empty"] = torch.zeros(0, 4)
    state["step"] = {"epoch": 3, "note": "x"}
    return state, {name: at for name, (at, _) in places.items()}


def _write(path: str, state: dict[str, Any], at: dict[str, int], **kw: Any) -> tuple[Any, ...]:
    writer = dcp.FileSystemWriter(path, thread_count=1, overwrite=False)
    writer.set_up_storage_writer(True)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])

    def resolve(item: Any) -> tuple[Any, memoryview | None, int]:
        if item.type == WriteItemType.BYTE_IO:
            return planner.resolve_data(item).getvalue(), None, 0
        t = state[item.index.fqn]
        view = memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")
        return t, view, at.get(item.index.fqn, 1)  # 1: not page-aligned memory

    results, files, where = direct.write_items(path, plan, resolve, **kw)
    writer.finish(metadata, [results])
    return results, files, where


def _load(path: str, state: dict[str, Any]) -> dict[str, Any]:
    fresh = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()
    }
    fresh["step"] = {"epoch": 0, "note": ""}
    dcp.load(fresh, storage_reader=dcp.FileSystemReader(path))
    return fresh


def test_files_are_dcps_with_tensor_data_on_block_boundaries(tmp_path: Any) -> None:
    mm = mmap.mmap(-1, 4096 * 16)
    state, at = _state(mm)
    results, files, where = _write(str(tmp_path / "a"), state, at)
    (name,) = files
    path = tmp_path / "a" / name
    size, hexd = files[name]
    assert (size, hexd) == file_digest(str(path))  # the digest is of the bytes on disk
    raw = path.read_bytes()
    for wr in results:
        fqn = wr.index.fqn
        value = state.get(fqn)
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        nbytes = value.numel() * value.element_size()
        start = where[wr.index]
        assert raw[start : start + nbytes] == value.numpy().tobytes(), fqn
        info = wr.storage_data
        assert info.offset <= start < info.offset + info.length
        if nbytes >= direct.BLOCK:
            assert start % direct.BLOCK == 0, (fqn, start)
    loaded = _load(str(tmp_path / "a"), state)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), k
    assert loaded["step"] == state["step"]


def _opens_direct(path: str) -> bool:
    """Whether this file system takes ``O_DIRECT`` (tmpfs on older kernels does not)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    return hasattr(os, "O_DIRECT")


def test_the_same_bytes_through_the_page_cache_and_when_o_direct_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm = mmap.mmap(-1, 4096 * 16)
    state, at = _state(mm)
    _, ours, _ = _write(str(tmp_path / "direct"), state, at)
    _, cached, _ = _write(str(tmp_path / "cached"), state, at, direct=False)
    assert list(ours.values()) == list(cached.values())

    o_direct = getattr(os, "O_DIRECT", 0)
    real_write = os.write
    refused: list[int] = []

    def write(fd: int, data: Any) -> int:
        import fcntl

        if o_direct and fcntl.fcntl(fd, fcntl.F_GETFL) & o_direct:
            refused.append(fd)  # a file system that opens O_DIRECT but refuses its writes
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    _, refusing, _ = _write(str(tmp_path / "refused"), state, at)
    assert list(refusing.values()) == list(ours.values())
    if _opens_direct(str(tmp_path / "probe")):
        assert refused, "the test must reach a refused O_DIRECT write"
    monkeypatch.setattr(os, "write", real_write)

    real_open = os.open

    def open_(path: Any, flags: int, *args: Any) -> int:
        if o_direct and flags & o_direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    _, no_direct, _ = _write(str(tmp_path / "no-direct"), state, at)
    assert list(no_direct.values()) == list(ours.values())
    assert _load(str(tmp_path / "no-direct"), state)["odd"].equal(state["odd"])


def test_a_record_splits_around_its_data_without_copying_it() -> None:
    t = torch.arange(4096, dtype=torch.float32)
    split = direct.split_record(t)
    assert split is not None
    head, tail = split
    import io

    whole = io.BytesIO()
    torch.save(t, whole)
    assert whole.getvalue() == head + t.numpy().tobytes() + tail
    assert direct.record_data_offset(whole.getvalue(), t.numel() * 4) == len(head)


def test_a_paced_write_keeps_to_its_rate_until_the_limit_is_lifted(tmp_path: Any) -> None:
    """At a rate, a file takes at least its size / the rate; once ``limited()`` says no (the
    trainer waits for the save, or is gone), the rest goes at full speed; the bytes are the
    same either way."""
    import time

    mm = mmap.mmap(-1, 4096 * 16)
    state, at = _state(mm)
    _, files, _ = _write(str(tmp_path / "full"), state, at)
    ((size, want),) = files.values()
    rate = size / 0.5  # half a second's worth
    pace = direct.Pace(rate)
    t0 = time.monotonic()
    _, files, _ = _write(str(tmp_path / "paced"), state, at, pace=pace)
    assert time.monotonic() - t0 >= 0.45 and pace.slept > 0
    assert list(files.values()) == [(size, want)]
    asked = []
    lifted = direct.Pace(1.0, lambda: bool(asked.append(1)))  # 1 byte/s, lifted at once
    _, files, _ = _write(str(tmp_path / "lifted"), state, at, pace=lifted)
    assert (lifted.rate, lifted.slept, len(asked)) == (None, 0.0, 1)
    assert list(files.values()) == [(size, want)]
