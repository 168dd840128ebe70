"""Reading a fastinit checkpoint's items: every byte checked, from memory where it still is.

:class:`VerifiedReader` is a DCP ``StorageReader``: DCP's own ``DefaultLoadPlanner`` decides
which stored chunks overlap which target chunks (so a resharded load is DCP's), and the reader
fetches each stored item once, from the host-memory tier (the save's staging buffer, when it is
on this host) or from its file, verifies its digest and copies the overlaps into the targets.

An item the target takes whole (the same plan: every item) is read straight into the target's
memory, in 16 MiB pieces hashed as they arrive (the hash runs on bytes still in cache); anything
else is read into a buffer, verified, then narrowed and copied, as DCP does. A tensor item's
bytes are its raw data inside DCP's ``torch.save`` record (the manifest says where), so no zip
or pickle is parsed on the way. An item whose digest does not match is never copied from: a
mismatch in memory falls back to storage; a mismatch in storage is a
:class:`~fastinit.checkpoint.format.CheckpointError` naming the file and the rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from collections.abc import Iterator
from typing import Any

from fastinit.checkpoint import format as fmt
from fastinit.checkpoint.digest import Hasher
from fastinit.checkpoint.staging import Segment

__all__ = ["Source", "VerifiedReader", "Counts"]

_PIECE = 16 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """Where one stored item is: its manifest record, its part's directory, its rank."""

    item: fmt.Item
    part_dir: str
    rank: int | None
    """The saving rank (None: the replicated part)."""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass(slots=True)
class Counts:
    """What a load read, by tier."""

    storage_bytes: int = 0
    memory_bytes: int = 0
    object_bytes: int = 0
    files: set[str] = dataclasses.field(default_factory=set)
    memory_ranks: set[int | None] = dataclasses.field(default_factory=set)
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    """Why items the tier held were read from storage after all."""
    verify_s: float = 0.0
    """Seconds spent computing the digests of what was read (the checksums' cost)."""


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _bytes_view(t: Any) -> Any:
    """A writable uint8 view of a contiguous CPU tensor's memory."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


class VerifiedReader:
    """A DCP ``StorageReader`` over a fastinit checkpoint's items, checking every digest.

    Args:
        checkpoint_dir: the checkpoint (for messages).
        metadata: the DCP ``Metadata`` of what this rank reads (its ``storage_data`` maps each
            ``MetadataIndex`` to a :class:`Source`).
        segments: saving rank -> its staging buffer on this host (the host-memory tier).
        counts: where the bytes read are counted.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        metadata: Any,
        segments: dict[int | None, Segment],
        counts: Counts,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.metadata = metadata
        self.segments = segments
        self.counts = counts
        self._files: dict[str, Any] = {}

    # -- DCP's StorageReader protocol -----------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_data(self, plan: Any, planner: Any) -> Any:
        import torch
        from torch.distributed.checkpoint.planner import LoadItemType

        groups: dict[Any, list[Any]] = {}
        for req in plan.items:
            groups.setdefault(req.storage_index, []).append(req)
        try:
            for key, reqs in groups.items():
                source: Source = self.metadata.storage_data[key]
                if reqs[0].type == LoadItemType.BYTE_IO:
                    data = self._object(source)
                    for req in reqs:
                        planner.load_bytes(req, io.BytesIO(data))
                else:
                    self._tensor(source, reqs, planner)
        finally:
            for f in self._files.values():
                f.close()
            self._files.clear()
        fut: Any = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -- items ----------------------------------------------------------------------------------

    def _file(self, source: Source) -> Any:
        path = os.path.join(source.part_dir, source.item.file)
        f = self._files.get(path)
        if f is None:
            try:
                f = self._files[path] = open(path, "rb", buffering=0)  # noqa: SIM115
            except FileNotFoundError:
                raise fmt.CheckpointError(f"{path} is missing ({self._whose(source)})") from None
            self.counts.files.add(path)
        return f

    def _whose(self, source: Source) -> str:
        return "the replicated part" if source.rank is None else f"rank {source.rank}'s file"

    def _mismatch(self, source: Source, what: str) -> fmt.CheckpointError:
        item = source.item
        offs = "" if item.chunk_offsets is None else f" at {list(item.chunk_offsets)}"
        return fmt.CheckpointError(
            f"{os.path.join(source.part_dir, item.file)} ({self._whose(source)}): the bytes of "
            f"{item.fqn!r}{offs} {what} (a damaged, truncated or replaced file); not loaded"
        )

    def _read_into(self, source: Source, out: Any) -> None:
        """Read the item's bytes from storage into ``out`` (a writable uint8 buffer), verified."""
        item = source.item
        f = self._file(source)
        h = Hasher()
        view = memoryview(out).cast("B")
        done = 0
        while done < item.nbytes:
            piece = view[done : done + min(_PIECE, item.nbytes - done)]
            n = os.preadv(f.fileno(), [piece], item.offset + done)
            if n <= 0:
                raise self._mismatch(source, f"end after {done} of {item.nbytes} bytes")
            t = time.perf_counter()
            h.update(piece[:n])
            self.counts.verify_s += time.perf_counter() - t
            done += n
        self.counts.storage_bytes += item.nbytes
        if h.hexdigest() != item.digest:
            raise self._mismatch(source, "do not match their digest")

    def _copy_from_memory(self, source: Source, out: Any) -> bool:
        """Copy the item from its staging buffer into ``out`` if the digest holds; else False."""
        import numpy as np

        segment = self.segments.get(source.rank)
        item = source.item
        if segment is None or item.segment_offset is None:
            return False
        try:
            src = segment.bytes_at(item.segment_offset, item.nbytes)
        except ValueError as e:
            self.counts.fallbacks.append(f"{item.fqn}: {e}")
            return False
        h = Hasher()
        dst = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
        srcn = np.frombuffer(src, dtype=np.uint8)
        for lo in range(0, item.nbytes, _PIECE):
            hi = min(item.nbytes, lo + _PIECE)
            t = time.perf_counter()
            h.update(src[lo:hi])
            self.counts.verify_s += time.perf_counter() - t
            dst[lo:hi] = srcn[lo:hi]
        if h.hexdigest() != item.digest:
            self.counts.fallbacks.append(f"{item.fqn}: the staging buffer differs from the commit")
            return False
        self.counts.memory_bytes += item.nbytes
        self.counts.memory_ranks.add(source.rank)
        return True

    def _fetch_into(self, source: Source, out: Any) -> None:
        if not self._copy_from_memory(source, out):
            self._read_into(source, out)

    def _object(self, source: Source) -> bytes:
        buf = bytearray(source.item.nbytes)
        self._read_into(source, buf)
        self.counts.storage_bytes -= source.item.nbytes
        self.counts.object_bytes += source.item.nbytes
        return bytes(buf)

    def _tensor(self, source: Source, reqs: list[Any], planner: Any) -> None:
        import torch

        assert source.dtype is not None and source.shape is not None
        dtype = _dtype(source.dtype)
        if len(reqs) == 1:
            req = reqs[0]
            target = planner.resolve_tensor(req).detach()
            whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(
                source.shape
            )
            if (
                whole
                and target.device.type == "cpu"
                and target.dtype == dtype
                and target.is_contiguous()
                and tuple(target.shape) == tuple(source.shape)
            ):
                if source.item.nbytes:
                    self._fetch_into(source, _bytes_view(target))
                planner.commit_tensor(req, target)
                return
        stored = torch.empty(source.shape, dtype=dtype)
        if source.item.nbytes:
            self._fetch_into(source, _bytes_view(stored))
        for req in reqs:
            src = stored
            for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(src.shape):
                raise fmt.CheckpointError(
                    f"{source.item.fqn!r}: a stored piece of shape {list(src.shape)} for a target "
                    f"of shape {list(target.shape)}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)


def iter_sources(metadata: Any) -> Iterator[Source]:
    yield from metadata.storage_data.values()
