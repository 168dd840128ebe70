"""The limits a save is set against, measured in the same process on the same bytes.

* :class:`WarmCopy`: a copy of the tensors into buffers allocated and touched once (on CPU
  ordinary memory; for CUDA tensors page-locked host memory: the device-to-host copy at full
  speed). Nothing a save does on the loop can beat it: it is the copy alone.
* :func:`fresh_copy`: the same copy into fresh memory (``clone``, or on CUDA ``.cpu()``): what a
  stager that allocates per save pays (page faults, zeroing).
* :func:`file_bandwidth`: the tensors' bytes written into one file of the scratch directory with
  ``fsync``, through the page cache and then with ``O_DIRECT`` as fastinit's writer does (the
  write limits, with the CPU seconds each costs this process: what a writer takes from trainers
  on the same host), read back after ``posix_fadvise(DONTNEED)`` (from the device), and read again
  (from the page cache).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["WarmCopy", "fresh_copy", "file_bandwidth", "drop_cache"]

_CHUNK = 16 << 20


def _sync(tensors: Sequence[Any]) -> None:
    import torch

    if any(t.device.type == "cuda" for t in tensors):
        torch.cuda.synchronize()


class WarmCopy:
    """Buffers for ``tensors``, allocated and written once; :meth:`run` times one more copy."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        import torch

        self.tensors = list(tensors)
        self.buffers = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            for t in self.tensors
        ]
        self.run()  # touched: every page is there

    def run(self) -> float:
        """Seconds of one copy of every tensor into its buffer (synchronised)."""
        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            for src, dst in zip(self.tensors, self.buffers, strict=True):
                dst.copy_(src, non_blocking=src.device.type == "cuda")
        _sync(self.tensors)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.buffers = []


def fresh_copy(tensors: Sequence[Any]) -> float:
    """Seconds to copy ``tensors`` into memory allocated for the copy (freed after)."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        out = [t.detach().cpu() if t.device.type == "cuda" else t.detach().clone() for t in tensors]
    _sync(tensors)
    seconds = time.perf_counter() - t0
    del out
    return seconds


def drop_cache(path: str) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (clean pages go)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _direct_write(views: Sequence[memoryview], path: str) -> None:
    """``views`` into ``path`` as fastinit's writer writes a tensor: ``O_DIRECT`` from a
    page-aligned buffer (here one staging-like buffer, copied into off the clock)."""
    from fastinit.checkpoint.direct import AlignedFile

    out = AlignedFile(path)
    try:
        for v in views:
            out.write_data(v, 0)
        out.close()
    except BaseException:
        out.abort()
        raise


def file_bandwidth(tensors: Sequence[Any], directory: str) -> dict[str, float]:
    """Write ``tensors``' bytes into a file under ``directory`` (fsync'd) through the page cache,
    then with ``O_DIRECT``; read them back from the device (page cache dropped), then from the
    page cache; seconds, GB/s and (writes) CPU seconds of each."""
    import mmap

    import torch

    host = [t.detach().cpu().contiguous() for t in tensors]
    views = [memoryview(t.view(torch.uint8).reshape(-1).numpy()) for t in host if t.numel()]
    total = sum(len(v) for v in views)
    path = os.path.join(directory, "bandwidth.bin")
    t0, c0 = time.perf_counter(), _cpu_s()
    with open(path, "wb", buffering=0) as f:
        for v in views:
            for at in range(0, len(v), _CHUNK):
                f.write(v[at : at + _CHUNK])
        os.fsync(f.fileno())
    write_s, write_cpu_s = time.perf_counter() - t0, _cpu_s() - c0
    # the direct write reads from page-aligned memory, as from a staging buffer
    staged = mmap.mmap(-1, max(total, 1))
    at = 0
    for v in views:
        staged[at : at + len(v)] = v
        at += len(v)
    direct_path = os.path.join(directory, "bandwidth-direct.bin")
    t0, c0 = time.perf_counter(), _cpu_s()
    _direct_write([memoryview(staged)[:total]], direct_path)
    direct_s, direct_cpu_s = time.perf_counter() - t0, _cpu_s() - c0
    os.unlink(direct_path)
    staged.close()
    buf = bytearray(_CHUNK)

    def read() -> float:
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return time.perf_counter() - t

    drop_cache(path)
    cold_s = read()
    warm_s = read()
    os.unlink(path)
    gb = total / 1e9
    return {
        "bytes": float(total),
        "write_s": write_s,
        "write_gb_s": gb / write_s,
        "write_cpu_s": write_cpu_s,
        "direct_write_s": direct_s,
        "direct_write_gb_s": gb / direct_s,
        "direct_write_cpu_s": direct_cpu_s,
        "read_device_s": cold_s,
        "read_device_gb_s": gb / cold_s,
        "read_cache_s": warm_s,
        "read_cache_gb_s": gb / warm_s,
    }
