"""DCP data files written from the staging buffer by the disk itself (``O_DIRECT``).

Through the page cache, writing a save costs the writer a copy of every byte into newly
allocated cache pages, and the kernel's writeback of them: CPU the trainers on the same host
lose while the save is written. On this project's CI host (a virtual machine) that was 0.5 to
9.4 s of system CPU per GB, the upper figure whenever the cache pages were memory the guest had
not touched lately (``docs/checkpoint.md``, "The writer's data path"). With ``O_DIRECT`` the
disk reads the staged bytes where they lie: 0.05 s of system CPU per GB on the same host, no
copy, no cache pages, nothing left for writeback to do.

The files stay DCP's: a ``.distcp`` file is ``torch.save`` records one after another, and
DCP's ``.metadata`` records each one's offset and length. ``O_DIRECT`` needs the file offset,
the length and the memory address of a write to be multiples of the device's block size, so
:func:`write_items` puts zeros *before* a record where needed, enough that the record's tensor
bytes begin at a multiple of :data:`BLOCK` in the file. The staging buffer keeps every tensor at
a multiple of :data:`BLOCK` too (:mod:`fastinit.checkpoint.staging`). A reader that follows the
metadata (DCP's, or fastinit's) never sees the padding. The record's small parts (its zip
headers, the pickle, the trailer) pass through a page-aligned bounce buffer.

Where the file system refuses ``O_DIRECT`` (``EINVAL``: tmpfs on older kernels, some network
file systems), the same code writes through the page cache; the files are the same bytes.
"""

from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os
import struct
import time
import zipfile
from collections.abc import Callable
from typing import Any

from fastinit.checkpoint import _dcp
from fastinit.checkpoint.digest import Hasher

__all__ = [
    "AlignedFile",
    "split_record",
    "record_data_offset",
    "write_items",
    "BLOCK",
    "PIECE",
    "Pace",
    "round_up",
]

#: The alignment of everything written directly: file offsets, lengths and memory addresses.
BLOCK = 4096
_BOUNCE = 4 << 20
#: The largest single write. One synchronous O_DIRECT write queues all of its requests on the
#: device at once, and anything else on that disk (a trainer's log, its data loader's reads)
#: waits behind them: beside two writers writing 1 GB each, a neighbour's small file work took
#: 109-156 ms (90th percentile; worst 213-426 ms) with 64 MiB writes, 3.3-3.4 ms (worst
#: 5.7-10.2 ms) with 1 MiB ones, the writers as fast (``python -m benchmarks.checkpoint_blocking.neighbour``).
PIECE = 1 << 20


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


class Pace:
    """Writes at most ``rate`` bytes per second while ``limited()`` holds (``rate`` None: no
    limit): called with each write's size, it sleeps until the bytes written so far are due.

    ``limited`` is asked at least every 50 ms of sleep, so that lifting the limit (the trainer
    waits for the save, or is gone) takes effect at once; from then on this file is written at
    full speed.
    """

    def __init__(self, rate: float | None, limited: Callable[[], bool] = lambda: True) -> None:
        self.rate = rate
        self.limited = limited
        self._start = time.monotonic()
        self._sent = 0
        self.slept = 0.0

    def __call__(self, nbytes: int) -> None:
        if not self.rate:
            return
        self._sent += nbytes
        due = self._start + self._sent / self.rate
        while self.limited():
            left = due - time.monotonic()
            if left <= 0:
                return
            t = min(left, 0.05)
            time.sleep(t)
            self.slept += t
        self.rate = None


class AlignedFile:
    """A new file written in :data:`BLOCK`-aligned pieces, with ``O_DIRECT`` where the file
    system takes it; hashes every byte it is given, in order (``digest()``)."""

    def __init__(
        self, path: str, *, direct: bool = True, piece: int = PIECE, pace: Pace | None = None
    ) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.direct = False
        fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if fd < 0:
            fd = os.open(path, flags, 0o666)
        self.fd = fd
        self.piece = piece
        self.pace = pace
        self.size = 0
        """Bytes given so far (the file's length once closed)."""
        self._bounce = mmap.mmap(-1, _BOUNCE)  # page-aligned, as O_DIRECT needs
        self._fill = 0
        """Bytes in the bounce buffer: the file's ``[size - fill, size)``; ``size - fill`` is
        always a multiple of BLOCK."""
        self._hasher = Hasher()

    def _write_fd(self, view: memoryview) -> None:
        while len(view):
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                # A file system that opened with O_DIRECT but refuses this write: go on through
                # the page cache (what was written stays; the offsets are the same).
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
                self.direct = False
                continue
            view = view[n:]
            if self.pace is not None:
                self.pace(n)

    def _spill(self, *, final: bool = False) -> None:
        """Write the bounce buffer's whole blocks (all of it, zero-padded, when ``final``)."""
        n = round_up(self._fill, BLOCK) if final else self._fill - self._fill % BLOCK
        if n == 0:
            return
        if n > self._fill:
            self._bounce[self._fill : n] = bytes(n - self._fill)
        self._write_fd(memoryview(self._bounce)[:n])
        rest = max(0, self._fill - n)
        if rest:
            self._bounce.move(0, n, rest)
        self._fill = rest

    def write(self, data: Any) -> int:
        """Append ``data`` (any bytes-like object), copied through the bounce buffer."""
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        total = len(view)
        while len(view):
            k = min(len(view), _BOUNCE - self._fill)
            self._bounce[self._fill : self._fill + k] = view[:k]
            self._fill += k
            self.size += k
            view = view[k:]
            if self._fill == _BOUNCE:
                self._spill()
        return total

    def pad_to(self, offset: int) -> None:
        """Append zeros up to ``offset``."""
        if offset > self.size:
            self.write(bytes(offset - self.size))

    def write_data(self, data: memoryview, address: int) -> None:
        """Append ``data``, whose first byte lies ``address`` bytes into a page-aligned mapping:
        written straight from there where the file offset and the address are aligned."""
        view = data.cast("B")
        bulk = len(view) - len(view) % BLOCK
        if not (self.direct and self.size % BLOCK == 0 and address % BLOCK == 0 and bulk):
            self.write(view)
            return
        self._hasher.update(view)
        self._spill()  # the bounce holds whole blocks only, as size is aligned
        for start in range(0, bulk, self.piece):
            self._write_fd(view[start : min(bulk, start + self.piece)])
        self.size += bulk
        tail = view[bulk:]
        if len(tail):
            self._bounce[: len(tail)] = tail
            self._fill = len(tail)
            self.size += len(tail)

    def digest(self) -> str:
        return self._hasher.hexdigest()

    def close(self, *, sync: bool = True) -> None:
        """Write what is left, cut the last block's padding off, ``fsync`` when ``sync``."""
        if self.fd < 0:
            return
        try:
            self._spill(final=True)
            os.ftruncate(self.fd, self.size)
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
            self._bounce.close()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self._bounce.close()


class _Split(io.RawIOBase):
    """The stream ``torch.save`` writes a tensor's record to: keeps the small pieces, and only
    the length of the one write that is the tensor's bytes."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.head = bytearray()
        self.tail = bytearray()
        self.seen = 0
        """Writes of exactly ``nbytes`` (the data; more than one means the split is unsure)."""
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.pos

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n == self.nbytes:
            self.seen += 1
        elif self.seen:
            self.tail += view
        else:
            self.head += view
        self.pos += n
        return n


def split_record(tensor: Any) -> tuple[bytes, bytes] | None:
    """``torch.save(tensor)``'s record as ``(head, tail)``, the bytes around the tensor's data,
    without copying the data; None when the data did not pass as a single write of its own."""
    import torch

    nbytes = tensor.numel() * tensor.element_size()
    split = _Split(nbytes)
    torch.save(tensor, split)  # type: ignore[arg-type]  # a raw binary stream
    if split.seen != 1:
        return None
    return bytes(split.head), bytes(split.tail)


def record_data_offset(record: bytes, nbytes: int) -> int:
    """Where a tensor's ``nbytes`` of data begin in its ``torch.save`` record (DCP's format: a
    stored, uncompressed zip)."""
    with zipfile.ZipFile(io.BytesIO(record)) as z:
        infos = [i for i in z.infolist() if i.filename.endswith("/data/0")]
        if len(infos) != 1:
            raise ValueError("not a single-storage torch.save record")
        info = infos[0]
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise ValueError(
                f"the record's data is {info.file_size} bytes (compression {info.compress_type}), "
                f"expected {nbytes} stored"
            )
        header = record[info.header_offset : info.header_offset + 30]
        if header[:4] != b"PK\x03\x04":
            raise ValueError("no local zip header where the directory points")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len


def write_items(
    part_dir: str,
    plan: Any,
    resolve: Callable[[Any], tuple[Any, memoryview | None, int]],
    *,
    direct: bool = True,
    pace: Pace | None = None,
) -> tuple[list[Any], dict[str, tuple[int, str]], dict[Any, int]]:
    """Write a DCP save plan's items as one ``.distcp`` file, as DCP's ``FileSystemWriter``
    with one thread names and orders it (byte items first, then tensors in plan order).

    ``resolve(item)`` gives ``(value, view, address)``: a byte item's bytes (``view`` None), or a
    tensor item's tensor, the bytes of its data and where they begin in their page-aligned
    mapping. Returns DCP's ``WriteResult`` per item, ``{file name: (size,
    digest)}``, and ``{item index: file offset of the tensor's data}`` (tensors of one byte or
    more). ``pace``: the rate the file is written at (:class:`Pace`).
    """
    import torch
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    name = f"{plan.storage_data.prefix}0{_dcp.DATA_SUFFIX}"
    out = AlignedFile(os.path.join(part_dir, name), direct=direct, pace=pace)
    results: list[Any] = []
    where: dict[Any, int] = {}
    try:
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        for item in items:
            value, view, address = resolve(item)
            split = split_record(value) if view is not None and len(view) >= BLOCK else None
            if view is None:
                offset = out.size
                out.write(value)
            elif split is None:  # small, or not splittable: the whole record, copied
                offset = out.size
                buf = io.BytesIO()
                torch.save(value, buf)
                if len(view):
                    where[item.index] = offset + record_data_offset(buf.getvalue(), len(view))
                out.write(buf.getbuffer())
            else:
                head, tail = split
                # zeros before the record, so that its data begins on a block
                offset = round_up(out.size + len(head), BLOCK) - len(head)
                out.pad_to(offset)
                out.write(head)
                where[item.index] = out.size
                out.write_data(view, address)
                out.write(tail)
            length = out.size - offset
            results.append(WriteResult(item.index, length, _dcp.storage_info(name, offset, length)))
        out.close()
    except BaseException:
        out.abort()
        raise
    return results, {name: (out.size, out.digest())}, where
