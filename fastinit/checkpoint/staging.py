"""Staging buffers: the one copy a save costs the training loop, into memory allocated once.

A save copies this rank's tensors (its shards; on rank 0 also the replicated values) into a
staging buffer and hands it to the writer. A buffer is a file in ``/dev/shm`` (owner-only,
``0o600``), allocated once with ``posix_fallocate`` (a full ``/dev/shm`` fails there, never later
with a ``SIGBUS``) and mapped with ``MAP_POPULATE``, so every later save copies into memory that
is already there: no page faults, no allocation, no zeroing (a fresh allocation costs 10-100x
the copy). Being a file, the writer process maps the same pages, and after a failure a worker
restarted on the same host maps them again (the host-memory tier). On CUDA the buffer is also
page-locked (``cudaHostRegister``) so the device-to-host copy runs at full speed.

Buffers are named by the save they hold: ``fastinit-ckpt.<uid>.<save id>.r<rank>``. A
:class:`Pool` per process keeps at most two: the latest committed save's (the tier) and the one
being written; a new save takes a buffer that holds neither and renames it. The first 4 KiB of
a buffer is a JSON header (who made it: job, rank, save, pids), the tensors follow at 4 KiB
aligned offsets (:class:`Layout`), so the writer's disk can read them where they lie
(:mod:`fastinit.checkpoint.direct`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastinit import _faults
from fastinit.checkpoint.direct import BLOCK, round_up
from fastinit.checkpoint.priority import lower_priority
from fastinit.restart import launcher_pid

__all__ = ["Segment", "Layout", "Slot", "Pool", "segment_name", "shm_dir", "HEADER_BYTES"]

PREFIX = "fastinit-ckpt"
HEADER_BYTES = 4096
_ROUND = 1 << 20


def shm_dir() -> str | None:
    """``/dev/shm`` when it is a writable directory, else None (no shared staging)."""
    path = "/dev/shm"
    return path if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK) else None


def segment_name(save_id: str, rank: int) -> str:
    """The file name of rank ``rank``'s staging buffer of save ``save_id``."""
    return f"{PREFIX}.{os.getuid()}.{save_id}.r{rank}"


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lies in a buffer."""

    fqn: str
    chunk_offsets: tuple[int, ...]
    dtype: str
    """``str(torch.dtype)`` without ``torch.``."""
    shape: tuple[int, ...]
    nbytes: int
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """The slots of a buffer: every tensor a save stages, in order, 4 KiB aligned."""

    slots: tuple[Slot, ...]
    size: int
    """Bytes needed, header included."""

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, tuple[int, ...], Any]]) -> Layout:
        """The layout of ``(fqn, chunk offsets, tensor)`` triples."""
        slots = []
        offset = HEADER_BYTES
        for fqn, offs, t in tensors:
            nbytes = t.numel() * t.element_size()
            slots.append(
                Slot(
                    fqn,
                    tuple(offs),
                    str(t.dtype).removeprefix("torch."),
                    tuple(t.shape),
                    nbytes,
                    offset,
                )
            )
            offset += round_up(max(nbytes, 1), BLOCK)
        return cls(tuple(slots), offset)

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _encode_header(header: dict[str, Any]) -> bytes:
    data = json.dumps(header, sort_keys=True).encode()
    if len(data) > HEADER_BYTES - 1:
        raise ValueError("staging header too large")
    return data.ljust(HEADER_BYTES, b" ")


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class Segment:
    """A staging buffer: a shared-memory file mapped into this process (or private memory)."""

    def __init__(self, path: str | None, mm: mmap.mmap, size: int, fd: int | None) -> None:
        self.path = path
        self.mm = mm
        self.size = size
        self._fd = fd
        self._pinned = False
        self._base: Any = None
        self.touched: Any = None
        """What :class:`fastinit.checkpoint.touched.Touched` last copied in whole (its fill)."""

    # -- making and opening -----------------------------------------------------------------

    @classmethod
    def create(
        cls, directory: str, name: str, size: int, header: dict[str, Any] | None = None
    ) -> Segment:
        """A new owner-only buffer of ``size`` bytes, allocated and mapped (pages present).

        ``header`` (who made it) is written before the allocation, so that a process killed
        while allocating leaves a buffer that :func:`~fastinit.checkpoint.tier.reclaim` can
        tell is dead.

        Raises:
            OSError: the file exists, or the memory is not there (``ENOSPC``: a full
                ``/dev/shm``).
        """
        path = os.path.join(directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            if header is not None:
                os.pwrite(fd, _encode_header(header), 0)
            _faults.point("checkpoint.shm_alloc")
            os.posix_fallocate(fd, 0, size)
            populate = getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return cls(path, mm, size, fd)

    @classmethod
    def private(cls, size: int) -> Segment:
        """A buffer in this process's own memory (when no shared memory is available)."""
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        return cls(None, mm, size, None)

    @classmethod
    def open(cls, path: str, *, writable: bool = False) -> Segment:
        """Map an existing buffer; only a regular file owned by this user that no one else can
        write or read (a buffer of another user, or one made readable, is never opened).

        With ``writable=False`` the mapping is copy-on-write: reading shares the pages. With
        ``writable=True`` (a buffer adopted for saves) its pages are mapped here (``MAP_POPULATE``),
        so the first save into it does not fault them in on the loop.

        Raises:
            OSError: missing, not a regular file, a symlink, or not owner-only.
        """
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(
                    f"{path} is owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}: "
                    "not an owner-only buffer of this user"
                )
            if st.st_size < HEADER_BYTES:
                raise OSError(f"{path} is too short to be a staging buffer")
            if writable:  # a buffer taken over for saves: its pages mapped now, not at a save
                populate = getattr(mmap, "MAP_POPULATE", 0)
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | populate, prot=prot)
            else:
                mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, mm, st.st_size, fd)

    @classmethod
    def from_fd(cls, fd: int) -> Segment:
        """Map a buffer passed as an open file descriptor (the writer's side; read-only,
        pages populated). Takes ownership of ``fd``."""
        try:
            size = os.fstat(fd).st_size
            populate = getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(None, mm, size, fd)

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked for CUDA copies."""
        return self._pinned

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("a private buffer has no file")
        return self._fd

    # -- the header ---------------------------------------------------------------------------

    def write_header(self, header: dict[str, Any]) -> None:
        self.mm[:HEADER_BYTES] = _encode_header(header)

    def read_header(self) -> dict[str, Any]:
        raw = bytes(self.mm[:HEADER_BYTES]).strip()
        try:
            obj = json.loads(raw)
        except ValueError:
            return {}
        return obj if isinstance(obj, dict) else {}

    # -- views ----------------------------------------------------------------------------------

    def bytes_at(self, offset: int, nbytes: int) -> memoryview:
        if offset < HEADER_BYTES or offset + nbytes > self.size:
            raise ValueError(f"a range [{offset}, {offset + nbytes}) outside the buffer")
        return memoryview(self.mm)[offset : offset + nbytes]

    def tensor(self, offset: int, nbytes: int, dtype: str, shape: Sequence[int]) -> Any:
        """A tensor viewing ``nbytes`` at ``offset`` (its storage is exactly those bytes)."""
        import torch

        if offset < HEADER_BYTES or offset + nbytes > self.size:
            raise ValueError(f"a range [{offset}, {offset + nbytes}) outside the buffer")
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=_dtype(dtype))
        t = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return t.view(_dtype(dtype)).view(tuple(shape))

    def slot(self, slot: Slot) -> Any:
        return self.tensor(slot.offset, slot.nbytes, slot.dtype, slot.shape)

    def pin(self) -> None:
        """Page-lock the buffer for CUDA copies (once; a no-op without CUDA)."""
        import torch

        if self._pinned or not torch.cuda.is_available():
            return
        base = torch.frombuffer(self.mm, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), self.size, 0)
        if int(getattr(err, "value", err)) == 0:
            self._pinned = True
            self._base = base

    # -- life ---------------------------------------------------------------------------------

    def rename(self, directory: str, name: str) -> None:
        if self.path is None:
            return
        new = os.path.join(directory, name)
        os.rename(self.path, new)
        self.path = new

    def close(self) -> None:
        if self._pinned:
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        self._base = None
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def copy_in(segment: Segment, layout: Layout, tensors: Sequence[Any]) -> None:
    """Copy ``tensors`` (in ``layout``'s order) into their slots of ``segment``."""
    import torch

    cuda = False
    with torch.no_grad():
        for slot, t in zip(layout.slots, tensors, strict=True):
            if slot.nbytes == 0:
                continue
            src = t.detach()
            on_cuda = src.device.type == "cuda"
            if on_cuda and not cuda:
                segment.pin()
                cuda = True
            segment.slot(slot).copy_(src, non_blocking=on_cuda)
    if cuda:
        torch.cuda.synchronize()


# -- the pool of one process's buffers ---------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Entry:
    segment: Segment
    state: str
    """``free``, ``writing`` (a save in flight), ``tier`` (the latest committed save) or
    ``filling`` (free, being filled by :meth:`Pool.prefill`)."""
    save_id: str | None = None


class Pool:
    """This process's staging buffers: allocated once, reused by every save.

    Args:
        rank: this process's rank (names the buffers).
        keep_tier: keep the latest committed save's buffer (the host-memory tier) and stage the
            next save into another one; False: one buffer, released of its save once committed.
        tier_limit: the largest buffer kept as the tier, in bytes (None: no limit).
        shared: buffers in /dev/shm (another process can map them); False: this process's
            own memory.
        reuse: keep buffers for the next save; False: free each once its save is settled.
        spare: one buffer more, so that one is free between saves even while the last save
            is in flight and the one before it is the tier (rows are copied ahead into it).
    """

    def __init__(
        self,
        rank: int,
        *,
        keep_tier: bool,
        tier_limit: int | None = None,
        shared: bool = True,
        reuse: bool = True,
        spare: bool = False,
    ) -> None:
        self.rank = rank
        self.keep_tier = keep_tier
        self.spare = spare and reuse
        self.quiet: Callable[[], Any] = contextlib.nullcontext
        """A context inside which nothing else writes a free buffer (rows copied ahead):
        entered wherever a buffer is handed out, freed or unmapped."""
        self.tier_limit = tier_limit
        self.reuse = reuse
        self.directory = shm_dir() if shared else None
        self.shared = self.directory is not None
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._mirror: threading.Thread | None = None
        self._filler: threading.Thread | None = None
        self.allocated_s = 0.0
        self.allocated_bytes = 0
        self.warning: str | None = None
        self.owner: dict[str, Any] = {"pid": os.getpid(), "ppid": launcher_pid()}
        """Who holds this pool's buffers (``job``, ``pid``, ``ppid``, ``writer``): the header of
        a buffer from its creation until a save names it."""

    @property
    def max_buffers(self) -> int:
        return (2 if self.keep_tier else 1) + (1 if self.spare else 0)

    def _new(self, size: int, name: str) -> Segment:
        t0 = time.perf_counter()
        size = round_up(size, _ROUND)
        seg: Segment | None = None
        if self.shared:
            assert self.directory is not None
            try:
                seg = Segment.create(self.directory, name, size, {**self.owner, "rank": self.rank})
            except OSError as e:
                self.shared = False
                self.warning = (
                    f"no shared memory for checkpoint staging ({e}): staging in this process's "
                    "memory, written by a thread of the trainer, with no host-memory tier"
                )
        if seg is None:
            seg = Segment.private(size)
        self.allocated_s += time.perf_counter() - t0
        self.allocated_bytes += size
        return seg

    def _free_name(self) -> str:
        """The name of a buffer no save has named yet (this process's pid in it)."""
        return f"{PREFIX}.{os.getuid()}.free-{os.getpid()}-{os.urandom(4).hex()}.r{self.rank}"

    def reserve(self, size: int, count: int | None = None, *, pin: bool = False) -> None:
        """Allocate free buffers of at least ``size`` bytes up to ``count`` (default: what a
        save and the tier need), ahead of the first save; ``pin``: page-lock them for CUDA
        copies too (``cudaHostRegister`` of a large buffer takes time: not at the first save)."""
        want = self.max_buffers if count is None else count
        while True:
            with self._lock:
                fitting = [e for e in self._entries if e.state == "free" and e.segment.size >= size]
                if len(self._entries) >= self.max_buffers or len(fitting) >= want:
                    segments = [e.segment for e in fitting]
                    break
            seg = self._new(size, self._free_name())
            with self._lock:
                self._entries.append(_Entry(seg, "free"))
        if pin:
            for segment in segments:
                segment.pin()

    def acquire(
        self, layout: Layout, save_id: str, header: dict[str, Any], prefer: Segment | None = None
    ) -> Segment:
        """A buffer for save ``save_id`` (renamed to its name, header written): ``prefer`` if
        it is free and fits (the one rows were copied ahead into), else the smallest that fits.

        Raises:
            RuntimeError: every buffer is in use (a save in flight and the tier): wait for the
                save in flight first.
        """
        with self.quiet():
            return self._acquire(layout, save_id, header, prefer)

    def _acquire(
        self, layout: Layout, save_id: str, header: dict[str, Any], prefer: Segment | None
    ) -> Segment:
        entry: _Entry | None = None
        while True:
            self._join_mirror()
            self._join_filler()
            with self._lock:
                if any(e.state == "filling" for e in self._entries):
                    continue  # a prefill began meanwhile: take its buffer once it is full
                free = [e for e in self._entries if e.state == "free"]
                fitting = [e for e in free if e.segment.size >= layout.size]
                entry = min(
                    fitting, key=lambda e: (e.segment is not prefer, e.segment.size), default=None
                )
                if entry is None and len(self._entries) >= self.max_buffers:
                    if not free:
                        raise RuntimeError("every staging buffer is in use")
                    # the layout grew (optimizer state created since): replace a free buffer
                    victim = free[0]
                    self._entries.remove(victim)
                    victim.segment.close()
                    victim.segment.unlink()
                if entry is not None:
                    entry.state, entry.save_id = "writing", save_id
                break
        if entry is None:
            seg = self._new(layout.size, segment_name(save_id, self.rank))
            entry = _Entry(seg, "writing", save_id)
            with self._lock:
                self._entries.append(entry)
        elif self.shared and entry.segment.path is not None:
            assert self.directory is not None
            entry.segment.rename(self.directory, segment_name(save_id, self.rank))
        entry.segment.write_header({**header, "save_id": save_id, "rank": self.rank})
        return entry.segment

    def settle(self, save_id: str, committed: bool) -> None:
        """The verdict of save ``save_id``: its buffer becomes the tier or free again."""
        self._join_mirror()
        with self._lock:
            mine = [e for e in self._entries if e.save_id == save_id]
            if not mine:
                return
            entry = mine[0]
            keep = (
                committed
                and self.keep_tier
                and self.shared
                and (self.tier_limit is None or entry.segment.size <= self.tier_limit)
            )
            if keep:
                for e in self._entries:
                    if e.state == "tier":
                        e.state = "free"
                entry.state = "tier"
            else:
                entry.state = "free"
            drop = [] if self.reuse else [e for e in self._entries if e.state == "free"]
            for e in drop:
                self._entries.remove(e)
        for e in drop:
            e.segment.close()
            e.segment.unlink()

    def adopt(
        self, segment: Segment, save_id: str, *, tier: bool, owner: dict[str, Any] | None = None
    ) -> None:
        """Take over a buffer an earlier process of this rank left (a restart on this host);
        ``owner`` (``pid``, ``ppid``, ``writer``) goes into its header: a buffer whose header
        still named the dead predecessor would be removed by any :func:`~fastinit.checkpoint.
        tier.reclaim` (another job's, a test session's) while this process holds it."""
        tier = tier and self.keep_tier  # with no tier kept, nothing would ever free it
        self._join_mirror()
        with self.quiet(), self._lock:
            if len(self._entries) >= self.max_buffers:
                segment.close()
                segment.unlink()  # a predecessor's buffer this process has no room for
                return
            if owner:
                segment.write_header({**segment.read_header(), **owner})
            if tier:
                for e in self._entries:
                    if e.state == "tier":
                        e.state = "free"
            self._entries.append(_Entry(segment, "tier" if tier else "free", save_id))

    def mirror(self, source: Segment, end: int, done: Any) -> bool:
        """Copy ``source``'s tensors (its bytes from the header to ``end``) on a thread, off the
        training loop, into the buffer the next save will take: a free one that holds nothing
        this process copied in (a new or an adopted one), allocated here if the pool has room
        for one more. ``done(buffer)`` once the copy is complete; returns whether one started.
        Every method that hands out, frees or unmaps a buffer waits for it first."""
        import torch

        self._join_mirror()
        with self._lock:
            free = [
                e.segment
                for e in self._entries
                if e.state == "free" and e.segment is not source and e.segment.size >= end
            ]
            empty = [seg for seg in free if seg.touched is None]
            target = empty[0] if empty else None
            if target is None and free:
                return False  # the free ones hold copies already
            if target is None and (len(self._entries) >= self.max_buffers or not self.reuse):
                return False

        def run() -> None:
            lower_priority()  # the mirror's own thread
            seg = target
            n = end - HEADER_BYTES
            try:
                if seg is None:  # a job's first save, with no buffer made ahead of it
                    seg = self._new(end, self._free_name())
                    with self._lock:
                        room = len(self._entries) < self.max_buffers
                        if room:
                            self._entries.append(_Entry(seg, "free"))
                    if not room:  # another thread made one meanwhile
                        seg.close()
                        seg.unlink()
                        return
                with torch.no_grad():
                    dst = torch.frombuffer(seg.mm, dtype=torch.uint8, count=n, offset=HEADER_BYTES)
                    src = torch.frombuffer(
                        source.mm, dtype=torch.uint8, count=n, offset=HEADER_BYTES
                    )
                    dst.copy_(src)
                    del dst, src
            except Exception:  # noqa: BLE001 - no fill: the next copy into it is whole
                return
            done(seg)

        t = threading.Thread(target=run, name="fastinit-checkpoint-mirror", daemon=True)
        self._mirror = t
        t.start()
        return True

    def prefill(
        self,
        layout: Layout,
        tensors: Sequence[Any],
        fills: Sequence[Any],
        adopt: Callable[[Any, Segment], None],
        forget: Callable[[Any], None],
        *,
        adopted: bool = False,
    ) -> int:
        """Copy ``tensors`` (whole, in ``layout``) into every free buffer that holds nothing
        this process copied in, one per fill, on the calling thread: off the training loop,
        ahead of the first save. ``adopt(fill, buffer)`` once a buffer is full (before any
        save can take it: a save that wants a buffer being filled waits for it), ``forget(fill)``
        for each fill no buffer got; returns the buffers filled. ``adopted``: buffers taken
        over from a predecessor may be filled too (False: they may still hold the save this
        process is about to load from memory, so only buffers it allocated are)."""
        with self._lock:
            targets = []
            if self.reuse:
                self._filler = threading.current_thread()
                targets = [
                    e
                    for e in self._entries
                    if e.state == "free"
                    and e.segment.touched is None
                    and e.segment.size >= layout.size
                    and (adopted or e.save_id is None)
                ][: len(fills)]
            for e in targets:
                e.state = "filling"
        filled = 0
        try:
            for i, fill in enumerate(fills):
                if i >= len(targets):
                    forget(fill)
                    continue
                try:
                    copy_in(targets[i].segment, layout, tensors)
                    _faults.point("checkpoint.prefill", rank=self.rank)
                except Exception:  # noqa: BLE001 - no fill: the next copy into it is whole
                    forget(fill)
                    continue
                adopt(fill, targets[i].segment)
                filled += 1
        finally:
            with self._lock:
                for e in targets:
                    e.state = "free"
                self._filler = None
        return filled

    def _join_filler(self) -> None:
        t = self._filler
        if t is not None and t is not threading.current_thread():
            t.join()

    def _join_mirror(self) -> None:
        t = self._mirror
        if t is not None:
            t.join()
            self._mirror = None

    def busy(self) -> bool:
        with self._lock:
            return any(e.state == "writing" for e in self._entries)

    def buffers(self) -> list[tuple[str, str | None, int, str | None]]:
        """``(state, save id, size, path)`` of every buffer."""
        with self._lock:
            return [(e.state, e.save_id, e.segment.size, e.segment.path) for e in self._entries]

    def pinned_bytes(self) -> int:
        """Bytes of the buffers that are page-locked."""
        with self._lock:
            return sum(e.segment.size for e in self._entries if e.segment.pinned)

    def ahead_buffers(self) -> list[Segment]:
        """The free buffers that hold a copy this process made (a fill): rows are copied ahead
        into one of them, for the next save."""
        with self._lock:
            return [
                e.segment
                for e in self._entries
                if e.state == "free" and e.segment.touched is not None
            ]

    def release(self) -> None:
        """Unmap and remove every buffer (the job ended cleanly)."""
        self._join_mirror()
        self._join_filler()
        with self.quiet(), self._lock:
            entries, self._entries = self._entries, []
        for e in entries:
            e.segment.close()
            e.segment.unlink()
