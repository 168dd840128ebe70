"""``load``: each rank reads only what its own shards need, proves every byte, and every rank
gets one verdict.

1. The commit marker names the save, the digest of its index and of every part's manifest;
   every manifest names the digest of each file of its part and of each data item. A load reads
   the marker, the index (proven by the marker) and the model's fingerprint (another model is
   refused, naming its first mismatching tensor).
2. :func:`plan_reads` — for every value of the target state: a replicated value comes from
   ``replicated/``; a sharded one, if this rank's own part holds exactly its chunks (the same
   plan: the common restart), from its own files; otherwise (another plan or world size) the
   stored layout (the index's shard runs, or the ``layouts.json`` of the rank holding shard 0)
   gives, by :mod:`fastinit.checkpoint.reshard`'s interval arithmetic, the stored shards that
   overlap each new chunk, and only those ranks' metadata is read. A value the checkpoint does
   not hold in a form the target can take (a fused optimizer's state for a table that was
   data-parallel, a dense optimizer's state for one that was sharded, a state whose shape
   depends on the plan) is *missing*: it keeps the value the target has (as a fresh start
   would) and is named in :attr:`LoadReport.missing`, or, with ``strict=True``, the load fails.
3. DCP's own ``DefaultLoadPlanner`` turns that into reads, which
   :class:`~fastinit.checkpoint.reader.VerifiedReader` serves from the host-memory tier where
   the save's staging buffer is still on this host, else from the files, checking each item's
   digest.
4. One all_reduce of one int64 gives every rank the verdict: if any rank failed, every rank
   raises :class:`CheckpointError` (the failing rank with its own reason).

A directory with DCP's global ``.metadata`` and no fastinit marker is a stock DCP checkpoint and
loads through ``torch.distributed.checkpoint.load`` (mode ``"dcp"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit import knobs
from fastinit.checkpoint import _dcp, tier
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint._comm import CollectiveFailed, Group
from fastinit.checkpoint.digest import file_digest
from fastinit.checkpoint.format import CheckpointError
from fastinit.checkpoint.reader import Counts, Source, VerifiedReader
from fastinit.checkpoint.reshard import overlap_volume, overlapping
from fastinit.checkpoint.state import build_state, entry_of, flat_state, is_sharded
from fastinit.plan.layout import ShardRun
from fastinit.tables import tables_loaded

if TYPE_CHECKING:
    from torch import nn

    from fastinit.checkpoint.staging import Segment

__all__ = ["load", "LoadReport", "ReadPlan", "plan_reads", "overlaps", "flat_target", "verify"]


@dataclasses.dataclass(slots=True)
class LoadReport:
    """What :func:`load` did on this rank."""

    mode: str
    """``"same-plan"`` (own files only), ``"resharded"`` (overlaps from other ranks' files) or
    ``"dcp"`` (a stock DCP checkpoint, loaded by ``dcp.load``)."""
    bytes_read: int
    """Bytes of tensor data read from storage (the checkpoint directory)."""
    files_read: int
    """Data files (``.distcp``) read."""
    metadata_bytes: int = 0
    """Bytes of marker, index, manifests, metadata and layout files read."""
    metadata_files: int = 0
    source_ranks: list[int] = dataclasses.field(default_factory=list)
    """The saving ranks whose items were read (replicated values not counted)."""
    seconds: float = 0.0
    files: list[str] = dataclasses.field(default_factory=list)
    memory_bytes: int = 0
    """Bytes of tensor data read from the host-memory tier (the save's staging buffers)."""
    memory_ranks: list[int] = dataclasses.field(default_factory=list)
    """The saving ranks whose staging buffers served items (-1: the replicated part)."""
    object_bytes: int = 0
    """Bytes of pickled non-tensor values read (param groups, counters)."""
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    """Values of the target the checkpoint does not hold in a form it can take, and why: they
    keep the target's values (as a fresh start would)."""
    tier_fallbacks: list[str] = dataclasses.field(default_factory=list)
    """Items the host-memory tier held but did not match the commit (read from storage)."""
    save_id: str = ""
    verify_s: float = 0.0
    """Seconds of the load spent checking digests (the cost of the checksums)."""
    initialised: list[str] = dataclasses.field(default_factory=list)
    """Tables ``fastinit.setup(init_tables=False)`` left pending that the checkpoint does not
    hold: initialised after the load as ``setup`` would have (:mod:`fastinit.tables`)."""

    @property
    def tier(self) -> str:
        """``"memory"``, ``"storage"`` or ``"mixed"``: where this rank's tensor data came from."""
        if self.memory_bytes and self.bytes_read:
            return "mixed"
        return "memory" if self.memory_bytes else "storage"


@dataclasses.dataclass(slots=True)
class ReadPlan:
    """What one rank reads for a load (:func:`plan_reads`), before reading any data."""

    mode: str
    metadata: Any
    """The DCP ``Metadata`` with only the chunks this rank reads (``storage_data``: each
    stored item's :class:`~fastinit.checkpoint.reader.Source`)."""
    source_ranks: list[int]
    metadata_files: list[str]
    metadata_bytes: int
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    part_files: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    """Every file a read touches -> (size, digest) its manifest records."""
    segments: dict[int | None, str | None] = dataclasses.field(default_factory=dict)
    """Part read (a saving rank; None: the replicated part) -> the staging buffer its manifest
    names (the host-memory tier), if any."""

    def reads(self) -> list[tuple[str, int, int]]:
        """``(file relative to the checkpoint, byte offset, length)`` of every stored item read."""
        out = []
        for source in self.metadata.storage_data.values():
            rel = os.path.relpath(os.path.join(source.part_dir, source.item.file), self._root)
            out.append((rel, source.item.offset, source.item.nbytes))
        return sorted(out)

    _root: str = ""

    def files(self) -> list[str]:
        """The files this rank opens, relative to the checkpoint, sorted."""
        return sorted({path for path, _, _ in self.reads()})

    def bytes(self) -> int:
        """The bytes this rank reads."""
        return sum(length for _, _, length in self.reads())


class _Sources:
    """Reads (once, proven by the commit) the manifests, metadata and layouts a load needs."""

    def __init__(self, checkpoint_dir: str, commit: fmt.Commit, index: fmt.Index) -> None:
        self.dir = checkpoint_dir
        self.commit = commit
        self.index = index
        self._manifests: dict[int | None, tuple[fmt.Manifest, dict[Any, fmt.Item]]] = {}
        self._md: dict[int | None, tuple[Any, dict[str, list[Any]]]] = {}
        self._layouts: dict[int, dict[str, list[Any]]] = {}
        self.files: list[str] = []
        self.nbytes = 0
        self.part_files: dict[str, tuple[int, str]] = {}
        self.segments: dict[int | None, str | None] = {}

    def part_dir(self, rank: int | None) -> str:
        return self.index.part_dir(self.dir, rank)

    def _check_rank(self, rank: int | None) -> None:
        if rank is not None and not 0 <= rank < self.index.world_size:
            raise CheckpointError(
                f"{self.dir}: the index's layout names rank {rank}, but the checkpoint was "
                f"saved by {self.index.world_size} ranks (the index does not fit the files)"
            )

    def manifest(self, rank: int | None) -> tuple[fmt.Manifest, dict[Any, fmt.Item]]:
        if rank not in self._manifests:
            self._check_rank(rank)
            manifest, size = fmt.read_manifest(self.dir, self.commit, rank)
            self.nbytes += size
            self.files.append(os.path.join(self.part_dir(rank), fmt.MANIFEST_FILE))
            self._manifests[rank] = (manifest, manifest.item_map())
        return self._manifests[rank]

    def _small_file(self, rank: int | None, name: str, what: str) -> bytes:
        manifest, _ = self.manifest(rank)
        recorded = manifest.files.get(name)
        path = os.path.join(self.part_dir(rank), name)
        if recorded is None:
            raise CheckpointError(f"{path}: not among the files its manifest names")
        data = fmt.read_verified(path, recorded[1], what)
        self.nbytes += len(data)
        self.files.append(path)
        return data

    def metadata(self, rank: int | None) -> tuple[Any, dict[str, list[Any]]]:
        """(DCP Metadata, fqn -> [MetadataIndex]) of a part (None: the replicated part)."""
        if rank in self._md:
            return self._md[rank]
        whose = "the replicated part's" if rank is None else f"rank {rank}'s"
        data = self._small_file(rank, fmt.DCP_METADATA, f"{whose} DCP metadata")
        try:
            md = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a pickle of another torch's classes
            import torch

            manifest, _ = self.manifest(rank)
            raise CheckpointError(
                f"{os.path.join(self.part_dir(rank), fmt.DCP_METADATA)}: written by torch "
                f"{manifest.torch_version or '?'}, unreadable by torch {torch.__version__} "
                f"({type(e).__name__}: {e}); load it with the torch that wrote it"
            ) from None
        by_fqn: dict[str, list[Any]] = {}
        for key in md.storage_data or {}:
            by_fqn.setdefault(key.fqn, []).append(key)
        self._md[rank] = (md, by_fqn)
        return md, by_fqn

    def layouts(self, rank: int) -> dict[str, list[Any]]:
        if rank not in self._layouts:
            data = self._small_file(rank, fmt.LAYOUTS_FILE, f"rank {rank}'s layouts")
            try:
                self._layouts[rank] = json.loads(data)
            except ValueError as e:
                raise CheckpointError(f"rank {rank}'s layouts.json is unreadable: {e}") from None
        return self._layouts[rank]

    def recorded(self, fqn: str, model_fqns: set[str], own: int | None = None) -> bool:
        """Whether the checkpoint holds ``fqn``, a sharded value the index does not list (the
        index lists only the sharded optimizer state rank 0 holds, and a table no shard of which
        is on rank 0 has its state on other ranks only): this rank's own part holds it (``own``:
        its rank in a checkpoint of the same world size, whose metadata a same-plan load reads
        anyway), or the rank holding shard 0 of its parameter recorded its layout."""
        if own is not None and fqn in self.metadata(own)[1]:
            return True
        param = _param_of(fqn, model_fqns)
        runs = self.index.runs(param) if param is not None else None
        if not runs or runs[0].rank is None:
            return False
        return fqn in self.layouts(runs[0].rank)

    def source(self, rank: int | None, key: Any, chunk_sizes: Any, dtype: Any) -> Source:
        """The stored item ``key`` (a DCP ``MetadataIndex``) of a part, as its manifest records it."""
        manifest, items = self.manifest(rank)
        offs = None if key.offset is None else tuple(key.offset)
        item = items.get((key.fqn, offs))
        part_dir = self.part_dir(rank)
        if item is None:
            raise CheckpointError(
                f"{part_dir}: the manifest records no item {key.fqn!r} at {offs} (the metadata "
                "does not fit the manifest)"
            )
        size, hexd = manifest.files.get(item.file, (None, ""))
        if size is None:
            raise CheckpointError(f"{part_dir}: {item.file} is not among its manifest's files")
        self.part_files[os.path.join(part_dir, item.file)] = (size, hexd)
        self.segments[rank] = manifest.segment
        return Source(
            item,
            part_dir,
            rank,
            None if dtype is None else str(dtype).removeprefix("torch."),
            None if chunk_sizes is None else tuple(chunk_sizes),
        )


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
    """The stored layout (shard runs) of a sharded value: the index's, or the ``layouts.json``
    of the rank holding shard 0 of its parameter."""
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
    if fqn.startswith("model."):  # a DTensor: its layout is not in the index
        warnings.warn(
            f"fastinit.checkpoint: the index holds no layout of {fqn!r}; searching every rank's "
            f"layouts.json ({index.world_size} files)",
            stacklevel=4,
        )
        for rank in range(index.world_size):
            raw = sources.layouts(rank).get(fqn)
            if raw is not None:
                return tuple(ShardRun.from_json(r) for r in raw)
    raise CheckpointError(
        f"{sources.dir}: the index lists {fqn!r} but no rank recorded its layout (the index "
        "does not fit the files)"
    )


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


def _target_size(value: Any) -> tuple[int, ...]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return tuple(value.metadata().size)
    return tuple(value.shape)


def _not_held(
    sources: _Sources,
    fqn: str,
    value: Any,
    stored: Mapping[str, fmt.TensorEntry],
    replicated: set[str],
    model_fqns: set[str],
    own: int | None = None,
) -> str | None:
    """Why the checkpoint cannot fill the sharded non-model value ``fqn`` (None: it can).
    Decided from committed files alone (the index, this rank's metadata, a layouts.json)."""
    if fqn.startswith("model."):
        return None  # the model's values: the fingerprint check decides
    index = sources.index
    entry = stored.get(fqn)
    if entry is None and sources.recorded(fqn, model_fqns, own):
        return None  # state of a table rank 0 holds no shard of: its layout decides the shape
    if entry is None:
        param = _param_of(fqn, model_fqns)
        if param is not None and param in replicated:
            return (
                f"its parameter {param.removeprefix('model.')!r} was data-parallel (replicated) "
                "when saved: this state did not exist"
            )
        if param is not None and param in index.sharded and not is_sharded(value):
            return (
                f"its parameter {param.removeprefix('model.')!r} was sharded when saved: a "
                "sharded (fused) optimizer held its state, not this one"
            )
        return "the checkpoint holds no such state (saved without this optimizer, or another one)"
    size = _target_size(value)
    if entry.shape is not None and tuple(entry.shape) != size:
        return _shape_problem(fqn, tuple(entry.shape), size)
    return None


def _shape_problem(fqn: str, stored: tuple[int, ...], target: tuple[int, ...]) -> str:
    """Why a stored optimizer state cannot fill a target of another shape."""
    if len(stored) != len(target) or stored[1:] != target[1:]:
        return (
            f"stored with shape {list(stored)}, the target has {list(target)}: the checkpoint "
            "was saved with another optimizer (or other optimizer settings)"
        )
    return (
        f"stored with global shape {list(stored)}, the target has {list(target)}: its shape "
        "depends on the plan (a row-wise state of a column-wise table under another column "
        "split), so it cannot be resharded"
    )


def plan_reads(
    checkpoint_dir: str,
    state: Mapping[str, Any],
    *,
    index: fmt.Index | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    commit: fmt.Commit | None = None,
) -> ReadPlan:
    """What this rank reads to load ``state`` (a flat state, :func:`flat_target`) from a
    committed checkpoint: the items, files and byte ranges, the mode, and the values the
    checkpoint does not hold. Reads only the marker, the index and the manifests, metadata and
    layouts of the ranks it needs (each proven by the commit); no collective, no tensor data.

    Args:
        checkpoint_dir: a committed fastinit checkpoint.
        state: the flat target state (FQN -> value), as :func:`flat_target` builds it.
        index: the checkpoint's index if already read.
        rank: this rank (default: the default process group's).
        world_size: the world size (default: the default process group's).
        commit: the checkpoint's commit marker if already read.
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
        group = Group()
        rank, world_size = group.rank, group.world_size
    commit = commit if commit is not None else fmt.read_commit(checkpoint_dir)
    index = index if index is not None else fmt.read_index(checkpoint_dir, commit)
    sources = _Sources(checkpoint_dir, commit, index)
    replicated = set(index.replicated)
    model_fqns = {e.fqn for e in index.model}
    own: int | None = rank if rank < index.world_size else None
    stored_state = {e.fqn: e for e in index.state}
    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    used: set[int] = set()
    missing: dict[str, str] = {}
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
            stored_size = tuple(getattr(entry, "size", ()) or ())
            if (
                isinstance(value, torch.Tensor)
                and hasattr(entry, "size")
                and stored_size != _target_size(value)
            ):
                if fqn.startswith("model."):
                    raise CheckpointError(
                        f"{fqn!r}: stored with shape {list(stored_size)}, the model has "
                        f"{list(_target_size(value))}"
                    )
                missing[fqn] = _shape_problem(fqn, stored_size, _target_size(value))
                continue
            sd_md[fqn] = entry
            by_offsets = {tuple(c.offsets): c for c in getattr(entry, "chunks", [])}
            dtype = getattr(getattr(entry, "properties", None), "dtype", None)
            for key in by_fqn.get(fqn, []):
                chunk = by_offsets.get(tuple(key.offset)) if key.offset is not None else None
                storage[key] = sources.source(
                    None, key, None if chunk is None else chunk.sizes, dtype
                )
            continue
        if not isinstance(value, torch.Tensor):
            missing[fqn] = "the checkpoint holds no such value"
            continue
        why = _not_held(
            sources, fqn, value, stored_state, replicated, model_fqns, None if resharded else own
        )
        if why is not None:  # decided from the index alone: the same on every rank
            missing[fqn] = why
            continue
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in _dcp.chunks_of(value)]
        if not is_sharded(value):  # a replicated target stored sharded: read the whole tensor
            chunks = [((0,) * value.dim(), tuple(value.shape))]
        size = _target_size(value)
        picked: list[tuple[int, Any]] = []  # (rank, MetadataIndex)
        # The same plan: this rank's own metadata holds exactly its chunks.
        found_own = False
        if own is not None:
            md, by_fqn = sources.metadata(own)
            version = version or md.version
            have = {tuple(k.offset): k for k in by_fqn.get(fqn, [])}
            entry = md.state_dict_metadata.get(fqn)
            stored = {(tuple(c.offsets), tuple(c.sizes)) for c in getattr(entry, "chunks", [])}
            if (
                entry is not None
                and tuple(entry.size) == size
                and all(c in stored and c[0] in have for c in chunks)
            ):
                found_own = True
                picked.extend((own, have[c[0]]) for c in chunks)
        if not found_own and chunks:
            resharded = True
            runs = _layout(sources, fqn, model_fqns)
            extent = _extent(runs)
            if extent is not None and extent != size:
                if fqn.startswith("model."):
                    raise CheckpointError(
                        f"{fqn!r}: stored with global shape {list(extent)}, the model has "
                        f"{list(size)}"
                    )
                missing[fqn] = _shape_problem(fqn, extent, size)
                continue
            for off, sz in chunks:
                covered = 0
                for shard in overlapping(runs, off, sz):
                    if shard.rank is None:
                        raise CheckpointError(f"{fqn!r}: shard {shard.index} names no rank")
                    md, by_fqn = sources.metadata(shard.rank)
                    version = version or md.version
                    entry = md.state_dict_metadata.get(fqn)
                    match = [k for k in by_fqn.get(fqn, []) if tuple(k.offset) == shard.offsets]
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
                    covered += overlap_volume(off, sz, shard.offsets, shard.sizes)
                    picked.append((shard.rank, match[0]))
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
        for r, key in picked:
            md, _ = sources.metadata(r)
            entry = md.state_dict_metadata[fqn]
            props = entry.properties
            off = tuple(key.offset)
            if off in seen:
                continue
            seen.add(off)
            sizes = None
            for c in entry.chunks:
                if tuple(c.offsets) == off:
                    chunk_md.append(ChunkStorageMetadata(c.offsets, c.sizes))
                    sizes = c.sizes
                    break
            storage[key] = sources.source(r, key, sizes, props.dtype)
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
    plan = ReadPlan(
        mode="resharded" if resharded else "same-plan",
        metadata=metadata,
        source_ranks=sorted(used),
        metadata_files=list(sources.files),
        metadata_bytes=sources.nbytes,
        missing=missing,
        part_files=dict(sources.part_files),
        segments=dict(sources.segments),
    )
    plan._root = checkpoint_dir
    return plan


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
    commit = fmt.read_commit(checkpoint_dir)
    index = index if index is not None else fmt.read_index(checkpoint_dir, commit)
    sources = _Sources(checkpoint_dir, commit, index)
    model_fqns = {e.fqn for e in index.model}
    replicated = set(index.replicated)
    stored_state = {e.fqn: e for e in index.state}
    out: dict[str, list[Any]] = {}
    for fqn, value in state.items():
        if fqn in replicated or not is_sharded(value):
            continue
        if _not_held(sources, fqn, value, stored_state, replicated, model_fqns) is not None:
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


def _check_files(plan: ReadPlan) -> None:
    """Every data file a read touches has the size its manifest records (missing or
    truncated: an error before any data is read)."""
    for path, (size, _) in plan.part_files.items():
        try:
            got = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (a damaged checkpoint)") from None
        if got != size:
            raise CheckpointError(
                f"{path} has {got} bytes, its manifest records {size} (a truncated or replaced "
                "file)"
            )


def _segments(plan: ReadPlan, commit: fmt.Commit) -> dict[int | None, Segment]:
    """The staging buffers on this host of the parts the load reads (the host-memory tier):
    part (a saving rank; None: the replicated part, staged in rank 0's buffer) -> buffer."""
    out: dict[int | None, Segment] = {}
    if knobs.get_checkpoint_tier() == 0:
        return out
    opened: dict[int, Segment | None] = {}
    for part, named in plan.segments.items():
        owner = 0 if part is None else part
        if owner not in opened:
            opened[owner], _why = tier.open_segment(commit.save_id, owner, named)
        segment = opened[owner]
        if segment is not None:
            out[part] = segment
    return out


def _apply(state: dict[str, Any], model: nn.Module, optimizers: Mapping[str, Any] | None) -> None:
    model.load_state_dict(state["model"])
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(state[name])


def _load_stock(
    checkpoint_dir: str, model: nn.Module, optimizers: Mapping[str, Any] | None, t0: float
) -> LoadReport:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = build_state(model, optimizers)
    counts: dict[str, Any] = {"bytes": 0, "files": set()}

    class _CountingReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                counts["bytes"] += info.length
                counts["files"].add(info.relative_path)
            return super().read_data(plan, planner)

    try:
        dcp.load(state, storage_reader=_CountingReader(checkpoint_dir), no_dist=True)
        _apply(state, model, optimizers)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(
            f"loading the stock DCP checkpoint {checkpoint_dir} failed: {type(e).__name__}: "
            f"{_short(e)}"
        ) from None
    return LoadReport(
        mode="dcp",
        bytes_read=counts["bytes"],
        files_read=len(counts["files"]),
        metadata_bytes=os.path.getsize(os.path.join(checkpoint_dir, _dcp.metadata_file())),
        metadata_files=1,
        seconds=time.perf_counter() - t0,
        files=sorted(counts["files"]),
    )


def _short(e: BaseException, limit: int = 2000) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + " ..."


def _load_here(
    checkpoint_dir: str,
    model: nn.Module,
    optimizers: Mapping[str, Any] | None,
    strict: bool,
    t0: float,
) -> LoadReport:
    """This rank's load (no collective); raises CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    if not fmt.is_committed(checkpoint_dir):
        if fmt.has_stock_metadata(checkpoint_dir):
            return _load_stock(checkpoint_dir, model, optimizers, t0)
        if not os.path.isdir(checkpoint_dir):
            raise CheckpointError(f"{checkpoint_dir} does not exist")
        fmt.read_commit(checkpoint_dir)  # raises the right message
    commit = fmt.read_commit(checkpoint_dir)
    index = fmt.read_index(checkpoint_dir, commit)
    state = build_state(model, optimizers)
    flat = flat_state(state)
    _check_model(index, flat, checkpoint_dir)
    plan = plan_reads(checkpoint_dir, flat, index=index, commit=commit)
    if plan.missing and strict:
        first = sorted(plan.missing)[:3]
        raise CheckpointError(
            f"{checkpoint_dir} does not hold {len(plan.missing)} value(s) of the target "
            f"(strict=True): "
            + "; ".join(f"{k!r}: {plan.missing[k]}" for k in first)
            + (" ..." if len(plan.missing) > 3 else "")
        )
    _check_files(plan)
    counts = Counts()
    segments = _segments(plan, commit)
    try:
        reader = VerifiedReader(checkpoint_dir, plan.metadata, segments, counts)
        # Missing values are not in the plan's metadata: the planner leaves them as they are.
        planner = DefaultLoadPlanner(allow_partial_load=bool(plan.missing))
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointError:
            raise
        except BaseException as e:  # noqa: BLE001 - DCP wraps errors in a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            cause = _checkpoint_cause(e)
            if cause is not None:
                raise cause from None
            raise CheckpointError(
                f"reading {checkpoint_dir} failed: {type(e).__name__}: {_short(e)}"
            ) from None
        try:
            _apply(state, model, optimizers)
        except Exception as e:  # noqa: BLE001 - the model or an optimizer refused the state
            raise CheckpointError(
                f"{checkpoint_dir}: the loaded state does not fit the model or an optimizer "
                f"({type(e).__name__}: {_short(e)})"
            ) from e
    finally:
        for seg in {id(s): s for s in segments.values()}.values():
            seg.close()
    tier.remember_loaded(commit.save_id)
    memory_ranks = sorted(-1 if r is None else r for r in counts.memory_ranks)
    return LoadReport(
        mode=plan.mode,
        bytes_read=counts.storage_bytes,
        files_read=len(counts.files),
        metadata_bytes=plan.metadata_bytes + _commit_bytes(checkpoint_dir, commit),
        metadata_files=len(plan.metadata_files) + 2,
        source_ranks=plan.source_ranks,
        seconds=time.perf_counter() - t0,
        files=sorted(counts.files),
        memory_bytes=counts.memory_bytes,
        memory_ranks=memory_ranks,
        object_bytes=counts.object_bytes,
        missing=dict(plan.missing),
        tier_fallbacks=list(counts.fallbacks),
        save_id=commit.save_id,
        verify_s=counts.verify_s,
    )


def _commit_bytes(checkpoint_dir: str, commit: fmt.Commit) -> int:
    total = 0
    for path in (
        os.path.join(checkpoint_dir, fmt.COMMIT_FILE),
        os.path.join(checkpoint_dir, commit.data_dir, fmt.INDEX_FILE),
    ):
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total


def _checkpoint_cause(e: BaseException) -> CheckpointError | None:
    """The CheckpointError a reader raised inside DCP's wrapper, if that is what failed."""
    seen: set[int] = set()
    stack: list[Any] = [e]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, CheckpointError):
            return cur
        stack.extend([cur.__cause__, cur.__context__])
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                stack.append(v[0] if isinstance(v, tuple) else v)
    return None


def load(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
    agree: bool = True,
) -> LoadReport:
    """Load a checkpoint in place into the model and optimizers; one verdict on every rank.

    Same plan and world size: each rank reads its own part (and the replicated values), from the
    save's staging buffer when it is still on this host, else from its files. Another plan or
    world size: each rank reads only the stored shards overlapping its new ones, bit-equal to
    DCP's resharded load. Every item read is checked against the digest the commit proves. A
    stock DCP checkpoint (``.metadata``, no fastinit marker) loads through
    ``dcp.load(no_dist=True)``.

    Args:
        checkpoint_dir: the checkpoint directory.
        model: the model whose ``state_dict`` (sharded tensors included) receives the values.
        optimizers: name -> optimizer, as given to :func:`fastinit.checkpoint.save`.
        strict: fail if the checkpoint does not hold some value of the target (default: such
            values keep the target's own values and are named in :attr:`LoadReport.missing`).
        agree: end with the one all_reduce that gives every rank the same verdict (default);
            False for a caller that agrees later on its own (see :func:`agree`).

    Returns:
        A :class:`LoadReport`.

    Raises:
        CheckpointError: on every rank alike: no checkpoint, a torn one, another model's,
            damaged, missing or replaced files, an index that does not fit the files, a value
            missing with ``strict``, a peer that failed or did not take part (bounded by
            ``FASTINIT_COLLECTIVE_TIMEOUT``). A rank that raises may have overwritten some values.
    """
    from fastinit.checkpoint.saving import state_written

    t0 = time.perf_counter()
    state_written(model)  # the reads below write the tensors behind torch's version counters
    group = Group() if agree else None
    path = os.fspath(checkpoint_dir)
    report: LoadReport | None = None
    error: CheckpointError | None = None
    try:
        report = _load_here(path, model, optimizers, strict, t0)
    except CheckpointError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - anything else is this rank's failure too
        error = CheckpointError(f"loading {path} failed: {type(e).__name__}: {_short(e)}")
        error.__cause__ = e
    if group is not None:
        agree_on(group, path, error)
    if error is not None:
        raise error
    assert report is not None
    # tables left for this load: those it wrote are done, those it lacks get setup's values
    report.initialised = tables_loaded(model, report.missing)
    report.seconds = time.perf_counter() - t0
    return report


def agree_on(group: Group, checkpoint_dir: str, error: CheckpointError | None) -> None:
    """The load's verdict on every rank: raise if any rank failed (one all_reduce of an int64).

    Raises:
        CheckpointError: some rank failed (this rank's own error if it failed), or a peer did not
            take part within ``FASTINIT_COLLECTIVE_TIMEOUT``.
    """
    mine = group.rank if error is not None else group.world_size
    try:
        first = group.all_reduce_min(mine, "load's verdict")
    except CollectiveFailed as e:
        if error is not None:
            raise error from e
        raise CheckpointError(f"loading {checkpoint_dir}: {e}") from e
    if error is not None:
        raise error
    if first < group.world_size:
        raise CheckpointError(
            f"loading {checkpoint_dir} failed on rank {first} (its error says why); this rank's "
            "values are not to be trained on"
        )


def verify(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file of a committed checkpoint against its manifest (reads every byte).

    Returns:
        ``{"files": n, "bytes": b, "save_id": ...}``.

    Raises:
        CheckpointError: the first file that is missing, of another size, or whose digest does
            not match (naming it and its rank).
    """
    path = os.fspath(checkpoint_dir)
    commit = fmt.read_commit(path)
    index = fmt.read_index(path, commit)
    files = nbytes = 0
    for rank in [None, *range(commit.world_size)]:
        if rank is not None and commit.manifests[rank] is None:
            continue
        manifest, _ = fmt.read_manifest(path, commit, rank)
        part = index.part_dir(path, rank)
        for name, (size, hexd) in sorted(manifest.files.items()):
            full = os.path.join(part, name)
            try:
                got_size, got = file_digest(full)
            except FileNotFoundError:
                raise CheckpointError(f"{full} is missing") from None
            whose = "the replicated part" if rank is None else f"rank {rank}"
            if got_size != size or got != hexd:
                raise CheckpointError(
                    f"{full} ({whose}): {got_size} bytes with digest {got}, the manifest "
                    f"records {size} bytes with {hexd} (a damaged or replaced file)"
                )
            files += 1
            nbytes += size
    return {"files": files, "bytes": nbytes, "save_id": commit.save_id}
