"""``load``: each rank reads only what its own shards need, with no collective.

1. Read the index and check the commit marker (a torn save is refused) and the model's
   fingerprint (another model is refused, naming its first mismatching tensor).
2. :func:`plan_reads` — for every value of the target state: a replicated value comes from
   ``replicated/``; a sharded one, if this rank's own ``rank_<r>/.metadata`` holds exactly its
   chunks (the same plan: the common restart), from its own files; otherwise (another plan or
   world size) the stored layout (the index's shard runs, or the ``layouts.json`` of the rank
   holding shard 0) gives, by :mod:`fastinit.checkpoint.reshard`'s interval arithmetic, the
   stored shards that overlap each new chunk, and only those ranks' metadata is read. Every new
   chunk must be covered exactly, else :class:`CheckpointError`.
3. The result is a DCP ``Metadata`` holding only those chunks, handed to DCP's own
   ``DefaultLoadPlanner`` and ``FileSystemReader`` (``no_dist=True``): DCP reads the byte ranges
   and copies the overlaps, so a resharded load is DCP's resharded load, read from fewer files.

A directory with DCP's global ``.metadata`` and no fastinit index is a stock DCP checkpoint and
loads through ``torch.distributed.checkpoint.load`` (mode ``"dcp"``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit.checkpoint import _dcp
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint.format import CheckpointError
from fastinit.checkpoint.reshard import overlap_volume, overlapping
from fastinit.checkpoint.state import build_state, entry_of, flat_state, is_sharded

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load", "LoadReport", "ReadPlan", "plan_reads", "overlaps", "flat_target"]


@dataclasses.dataclass(slots=True)
class LoadReport:
    """What :func:`load` did on this rank."""

    mode: str
    """``"same-plan"`` (own files only), ``"resharded"`` (overlaps from other ranks' files) or
    ``"dcp"`` (a stock DCP checkpoint, loaded by ``dcp.load``)."""
    bytes_read: int
    """Bytes of stored tensor/object data read (not counting metadata files)."""
    files_read: int
    """Data files (``.distcp``) read."""
    metadata_bytes: int = 0
    """Bytes of index, metadata and layout files read."""
    metadata_files: int = 0
    source_ranks: list[int] = dataclasses.field(default_factory=list)
    """The saving ranks whose files were read (replicated values not counted)."""
    seconds: float = 0.0
    files: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class ReadPlan:
    """What one rank reads for a load (:func:`plan_reads`), before reading any data."""

    mode: str
    metadata: Any
    """The DCP ``Metadata`` with only the chunks this rank reads (paths relative to the root)."""
    source_ranks: list[int]
    metadata_files: list[str]
    metadata_bytes: int

    def reads(self) -> list[tuple[str, int, int]]:
        """``(file relative to the checkpoint, byte offset, length)`` of every stored item read."""
        return sorted(
            (info.relative_path, info.offset, info.length)
            for info in self.metadata.storage_data.values()
        )

    def files(self) -> list[str]:
        return sorted({path for path, _, _ in self.reads()})

    def bytes(self) -> int:
        return sum(length for _, _, length in self.reads())


class _Sources:
    """Reads (once) and indexes the metadata of the directories a load needs."""

    def __init__(self, checkpoint_dir: str, index: fmt.Index) -> None:
        self.dir = checkpoint_dir
        self.index = index
        self._md: dict[str, tuple[Any, dict[str, list[tuple[Any, Any]]]]] = {}
        self._layouts: dict[int, dict[str, list[Any]]] = {}
        self.files: list[str] = []
        self.nbytes = 0

    def subdir(self, rank: int | None) -> str:
        if rank is None:
            return fmt.REPLICATED_DIR
        return self.index.rank_dir_pattern.format(rank=rank)

    def metadata(self, rank: int | None) -> tuple[Any, dict[str, list[tuple[Any, Any]]]]:
        """(Metadata, fqn -> [(MetadataIndex, storage info)]) of a rank (None: replicated)."""
        from torch.distributed.checkpoint import FileSystemReader

        sub = self.subdir(rank)
        if sub in self._md:
            return self._md[sub]
        if rank is not None and not (0 <= rank < self.index.world_size):
            raise CheckpointError(
                f"{self.dir}: the index's layout names rank {rank}, but the checkpoint was "
                f"saved by {self.index.world_size} ranks (the index does not fit the files)"
            )
        path = os.path.join(self.dir, sub)
        md_path = os.path.join(path, _dcp.metadata_file())
        try:
            md = FileSystemReader(path).read_metadata()
            self.nbytes += os.path.getsize(md_path)
        except FileNotFoundError:
            raise CheckpointError(f"{md_path} is missing (a damaged checkpoint)") from None
        except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle
            raise CheckpointError(f"{md_path} is unreadable: {type(e).__name__}: {e}") from None
        self.files.append(md_path)
        by_fqn: dict[str, list[tuple[Any, Any]]] = {}
        for key, info in (md.storage_data or {}).items():
            by_fqn.setdefault(key.fqn, []).append((key, info))
        self._md[sub] = (md, by_fqn)
        return md, by_fqn

    def layouts(self, rank: int) -> dict[str, list[Any]]:
        if rank not in self._layouts:
            path = os.path.join(self.dir, self.subdir(rank), fmt.LAYOUTS_FILE)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                self._layouts[rank] = json.loads(data)
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing (a damaged checkpoint)") from None
            except ValueError as e:
                raise CheckpointError(f"{path} is unreadable: {e}") from None
            self.nbytes += len(data)
            self.files.append(path)
        return self._layouts[rank]


def _param_of(fqn: str, model_fqns: set[str]) -> str | None:
    """The model tensor an optimizer-state value belongs to (``optim.state.<param>.<...>``)."""
    parts = fqn.split(".")
    if len(parts) < 3 or parts[1] != "state":
        return None
    rest = parts[2:]
    for n in range(len(rest) - 1, 0, -1):
        cand = "model." + ".".join(rest[:n])
        if cand in model_fqns:
            return cand
    return None


def _layout(sources: _Sources, fqn: str, model_fqns: set[str]) -> tuple[Any, ...]:
    from fastinit.plan.layout import ShardRun

    index = sources.index
    runs = index.runs(fqn)
    if runs is not None:
        return runs
    param = _param_of(fqn, model_fqns)
    prunes = index.runs(param) if param is not None else None
    if prunes and prunes[0].rank is not None:
        raw = sources.layouts(prunes[0].rank).get(fqn)
        if raw is not None:
            return tuple(ShardRun.from_json(r) for r in raw)
    warnings.warn(
        f"fastinit.checkpoint: the stored layout of {fqn!r} is not where the index says; "
        f"searching every rank's layouts.json ({index.world_size} files)",
        stacklevel=4,
    )
    for rank in range(index.world_size):
        raw = sources.layouts(rank).get(fqn)
        if raw is not None:
            return tuple(ShardRun.from_json(r) for r in raw)
    raise CheckpointError(f"{sources.dir}: no rank recorded the layout of {fqn!r}")


def _extent(runs: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The global shape a layout covers (max end per dim), None for an empty layout."""
    ends: list[int] | None = None
    for run in runs:
        if run.count <= 0:
            continue
        last = run.offsets_at(run.count - 1)
        first = run.offsets
        end = [max(a, b) + z for a, b, z in zip(first, last, run.sizes, strict=True)]
        ends = end if ends is None else [max(x, y) for x, y in zip(ends, end, strict=True)]
    return None if ends is None else tuple(ends)


def _relocated(info: Any, sub: str) -> Any:
    return dataclasses.replace(info, relative_path=os.path.join(sub, info.relative_path))


def _target_size(value: Any) -> tuple[int, ...]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return tuple(value.metadata().size)
    return tuple(value.shape)


def plan_reads(
    checkpoint_dir: str,
    state: Mapping[str, Any],
    *,
    index: fmt.Index | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> ReadPlan:
    """What this rank reads to load ``state`` (a flat state, :func:`flat_target`) from a
    committed checkpoint: the chunks, files and byte ranges, and the mode. Reads only the
    index and the metadata of the ranks it needs; no collective, no tensor data.

    Args:
        checkpoint_dir: a committed fastinit checkpoint.
        state: the flat target state (FQN -> value), as :func:`flat_target` builds it.
        index: the checkpoint's index if already read.
        rank, world_size: this rank and world size (default: the default process group's).
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if rank is None or world_size is None:
        from fastinit.checkpoint.saving import _rank_world

        rank, world_size = _rank_world()
    index = index if index is not None else fmt.read_index(checkpoint_dir)
    sources = _Sources(checkpoint_dir, index)
    replicated = set(index.replicated)
    model_fqns = {e.fqn for e in index.model}
    own: int | None = rank if rank < index.world_size else None
    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    used: set[int] = set()
    resharded = own is None or world_size != index.world_size
    version = None

    for fqn, value in state.items():
        if fqn in replicated:
            md, by_fqn = sources.metadata(None)
            version = version or md.version
            entry = md.state_dict_metadata.get(fqn)
            if entry is None:
                raise CheckpointError(
                    f"{checkpoint_dir}: the index lists {fqn!r} as replicated but "
                    f"{fmt.REPLICATED_DIR}/ does not hold it (the index does not fit the files)"
                )
            sd_md[fqn] = entry
            for key, info in by_fqn.get(fqn, []):
                storage[key] = _relocated(info, fmt.REPLICATED_DIR)
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{checkpoint_dir}: {fqn!r} is not in the checkpoint")
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in _dcp.chunks_of(value)]
        if not is_sharded(value):  # a replicated target stored sharded: read the whole tensor
            chunks = [((0,) * value.dim(), tuple(value.shape))]
        size = _target_size(value)
        picked: list[tuple[int, Any, Any]] = []  # (rank, MetadataIndex, info)
        # The same plan: this rank's own metadata holds exactly its chunks.
        found_own = False
        if own is not None:
            md, by_fqn = sources.metadata(own)
            version = version or md.version
            have = {tuple(k.offset): (k, i) for k, i in by_fqn.get(fqn, [])}
            entry = md.state_dict_metadata.get(fqn)
            stored = {(tuple(c.offsets), tuple(c.sizes)) for c in getattr(entry, "chunks", [])}
            if all(c in stored and c[0] in have for c in chunks) and (
                entry is not None or not chunks
            ):
                found_own = True
                if entry is not None and tuple(entry.size) != size:
                    raise CheckpointError(
                        f"{fqn!r}: stored with global shape {list(entry.size)}, the target "
                        f"has {list(size)}"
                    )
                for c in chunks:
                    key, info = have[c[0]]
                    picked.append((own, key, info))
        if not found_own and chunks:
            resharded = True
            runs = _layout(sources, fqn, model_fqns)
            extent = _extent(runs)
            if extent is not None and extent != size:
                raise CheckpointError(
                    f"{fqn!r}: stored with global shape {list(extent)}, the target has "
                    f"{list(size)} (a plan-dependent shape, such as the row-wise momentum of a "
                    "column-wise table under another column split, cannot be resharded)"
                )
            for off, sz in chunks:
                covered = 0
                for shard in overlapping(runs, off, sz):
                    if shard.rank is None:
                        raise CheckpointError(f"{fqn!r}: shard {shard.index} names no rank")
                    md, by_fqn = sources.metadata(shard.rank)
                    version = version or md.version
                    entry = md.state_dict_metadata.get(fqn)
                    match = [
                        (k, i) for k, i in by_fqn.get(fqn, []) if tuple(k.offset) == shard.offsets
                    ]
                    schunk = [
                        c
                        for c in getattr(entry, "chunks", [])
                        if tuple(c.offsets) == shard.offsets and tuple(c.sizes) == shard.sizes
                    ]
                    if not match or not schunk:
                        raise CheckpointError(
                            f"{checkpoint_dir}: the index places shard {shard.index} of {fqn!r} "
                            f"(offsets {list(shard.offsets)}, sizes {list(shard.sizes)}) on rank "
                            f"{shard.rank}, but that rank's files do not hold it (the index's "
                            "plan does not fit the files)"
                        )
                    if tuple(entry.size) != size:
                        raise CheckpointError(
                            f"{fqn!r}: stored with global shape {list(entry.size)}, the target "
                            f"has {list(size)} (a plan-dependent shape cannot be resharded)"
                        )
                    covered += overlap_volume(off, sz, shard.offsets, shard.sizes)
                    picked.append((shard.rank, match[0][0], match[0][1]))
                need = 1
                for n in sz:
                    need *= n
                if covered != need:
                    raise CheckpointError(
                        f"{checkpoint_dir}: the stored shards of {fqn!r} cover {covered} of the "
                        f"{need} elements of this rank's chunk at {list(off)}"
                    )
        # One entry per value: the chosen stored chunks (or none, where this rank holds none).
        props = None
        chunk_md = []
        seen: set[tuple[int, ...]] = set()
        for r, key, info in picked:
            md, _ = sources.metadata(r)
            entry = md.state_dict_metadata[fqn]
            props = entry.properties
            off = tuple(key.offset)
            if off in seen:
                continue
            seen.add(off)
            for c in entry.chunks:
                if tuple(c.offsets) == off:
                    chunk_md.append(ChunkStorageMetadata(c.offsets, c.sizes))
                    break
            storage[key] = _relocated(info, sources.subdir(r))
            used.add(r)
        if props is None:
            props = TensorProperties(dtype=value.dtype)
        sd_md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunk_md)

    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=None,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=version,
    )
    return ReadPlan(
        mode="resharded" if resharded else "same-plan",
        metadata=metadata,
        source_ranks=sorted(used),
        metadata_files=list(sources.files),
        metadata_bytes=sources.nbytes,
    )


def overlaps(
    checkpoint_dir: str,
    state: Mapping[str, Any],
    *,
    index: fmt.Index | None = None,
) -> dict[str, list[Any]]:
    """FQN -> the stored shards (:class:`~fastinit.checkpoint.reshard.StoredShard`) overlapping
    this rank's chunks of each sharded value of ``state`` (a flat target state), from the index
    and the stored layouts alone (no ``.metadata`` read): which ranks' files a resharded load
    of ``state`` opens. A benchmark can synthesise just those ranks' files.
    """
    index = index if index is not None else fmt.read_index(checkpoint_dir)
    sources = _Sources(checkpoint_dir, index)
    model_fqns = {e.fqn for e in index.model}
    replicated = set(index.replicated)
    out: dict[str, list[Any]] = {}
    for fqn, value in state.items():
        if fqn in replicated or not is_sharded(value):
            continue
        runs = _layout(sources, fqn, model_fqns)
        found: list[Any] = []
        for c in _dcp.chunks_of(value):
            found.extend(overlapping(runs, tuple(c.offsets), tuple(c.sizes)))
        out[fqn] = found
    return out


def flat_target(model: nn.Module, optimizers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The flat state (FQN -> value) :func:`load` fills for ``model`` and ``optimizers``."""
    return flat_state(build_state(model, optimizers))


def _check_model(index: fmt.Index, flat: Mapping[str, Any], checkpoint_dir: str) -> None:
    entries = [entry_of(k, v) for k, v in flat.items() if k.startswith("model.")]
    if fmt.fingerprint(entries) == index.fingerprint:
        return
    why = fmt.first_mismatch(index.model, entries)
    if why is None:  # the same tensors in another order (an unsharded model's state_dict)
        return
    raise CheckpointError(f"{checkpoint_dir} is a checkpoint of another model: {why}")


def _check_files(checkpoint_dir: str, plan: ReadPlan) -> None:
    """Every data file exists and is long enough for every range read from it."""
    need: dict[str, int] = {}
    for path, offset, length in plan.reads():
        need[path] = max(need.get(path, 0), offset + length)
    for path, end in need.items():
        full = os.path.join(checkpoint_dir, path)
        try:
            size = os.path.getsize(full)
        except FileNotFoundError:
            raise CheckpointError(f"{full} is missing (a damaged checkpoint)") from None
        if size < end:
            raise CheckpointError(
                f"{full} is truncated: {size} bytes, its metadata needs {end} (a damaged "
                "checkpoint)"
            )


def _reader(path: str, metadata: Any | None, counts: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class _CountingReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if metadata is not None:
                return metadata
            md = super().read_metadata(*args, **kwargs)
            counts["metadata_bytes"] += os.path.getsize(os.path.join(path, _dcp.metadata_file()))
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            items = {item.storage_index for item in plan.items}
            for key in items:
                info = self.storage_data[key]
                counts["bytes"] += info.length
                counts["files"].add(info.relative_path)
            return super().read_data(plan, planner)

    return _CountingReader(path)


def _apply(state: dict[str, Any], model: nn.Module, optimizers: Mapping[str, Any] | None) -> None:
    model.load_state_dict(state["model"])
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(state[name])


def load(
    checkpoint_dir: str, model: nn.Module, optimizers: Mapping[str, Any] | None = None
) -> LoadReport:
    """Load a checkpoint in place into the model and optimizers, with no collective.

    Same plan and world size: each rank reads its own ``rank_<r>/`` files (and the replicated
    values). Another plan or world size: each rank reads only the stored shards overlapping its
    new ones, bit-equal to DCP's resharded load. A stock DCP checkpoint (``.metadata``, no
    fastinit index) loads through ``dcp.load(no_dist=True)``.

    Args:
        checkpoint_dir: the checkpoint directory.
        model: the model whose ``state_dict`` (sharded tensors included) receives the values.
        optimizers: name -> optimizer, as given to :func:`fastinit.checkpoint.save`.

    Returns:
        A :class:`LoadReport`.

    Raises:
        CheckpointError: no checkpoint, a torn one, another model's, damaged or missing files,
            an index that does not fit the files. Nothing is half-loaded silently: a rank either
            loads every value or raises (it may have overwritten some values before raising).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    t0 = time.perf_counter()
    checkpoint_dir = os.fspath(checkpoint_dir)
    state = build_state(model, optimizers)
    counts: dict[str, Any] = {"bytes": 0, "files": set(), "metadata_bytes": 0}
    if not fmt.is_fastinit_checkpoint(checkpoint_dir):
        if not os.path.exists(os.path.join(checkpoint_dir, _dcp.metadata_file())):
            raise CheckpointError(f"{checkpoint_dir} holds no checkpoint (no fastinit index)")
        try:
            dcp.load(state, storage_reader=_reader(checkpoint_dir, None, counts), no_dist=True)
        except Exception as e:
            raise CheckpointError(f"loading the DCP checkpoint {checkpoint_dir} failed: {e}") from e
        _apply(state, model, optimizers)
        return LoadReport(
            mode="dcp",
            bytes_read=counts["bytes"],
            files_read=len(counts["files"]),
            metadata_bytes=counts["metadata_bytes"],
            metadata_files=1,
            seconds=time.perf_counter() - t0,
            files=sorted(counts["files"]),
        )
    index = fmt.read_index(checkpoint_dir)
    flat = flat_state(state)
    _check_model(index, flat, checkpoint_dir)
    plan = plan_reads(checkpoint_dir, flat, index=index)
    _check_files(checkpoint_dir, plan)
    try:
        dcp.load(
            state,
            storage_reader=_reader(checkpoint_dir, plan.metadata, counts),
            planner=DefaultLoadPlanner(),
            no_dist=True,
        )
    except Exception as e:
        raise CheckpointError(f"reading {checkpoint_dir} failed: {type(e).__name__}: {e}") from e
    _apply(state, model, optimizers)
    index_bytes = os.path.getsize(os.path.join(checkpoint_dir, fmt.INDEX_FILE))
    return LoadReport(
        mode=plan.mode,
        bytes_read=counts["bytes"],
        files_read=len(counts["files"]),
        metadata_bytes=plan.metadata_bytes + index_bytes,
        metadata_files=len(plan.metadata_files) + 2,
        source_ranks=plan.source_ranks,
        seconds=time.perf_counter() - t0,
        files=sorted(counts["files"]),
    )
