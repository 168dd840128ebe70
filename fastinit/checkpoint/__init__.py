"""Checkpoints indexed by the sharding plan, and how often to save them.

``import fastinit.checkpoint`` loads neither torch nor torchrec; names are imported on first use.

* :func:`save` — every rank writes its own shards (DCP's ``FileSystemWriter``, ``.distcp``
  files) and metadata; rank 0 the replicated values and a small index (compact plan, layouts,
  fingerprint, step/user metadata); :meth:`SaveHandle.wait` commits with one ``all_reduce``.
  ``blocking=False`` (default) stages into CPU memory and writes in the background.
* :func:`load` — same plan: each rank reads its own files, 0 collectives; another plan or world
  size: each rank reads only the stored shards overlapping its new ones (bit-equal to DCP's
  resharded load); a stock DCP checkpoint loads through ``dcp.load``. Returns a
  :class:`LoadReport` (mode, bytes and files read).
* :func:`consolidate` — writes DCP's global ``.metadata`` so stock ``dcp.load`` reads the
  checkpoint (``fastinit checkpoint consolidate DIR``).
* :func:`choose_interval` — the checkpoint interval minimising unsaved work plus blocking.
* :func:`publish` — the unsharded model from a checkpoint of any world size, on a CPU host,
  written (safetensors / ``torch.save``, ``torch.export``) and verified against the batch the
  trainer recorded with :func:`record_verification`.

Helpers for tools and benchmarks: :func:`read_index` (the parsed :class:`Index`),
:func:`rank_dir` (a rank's directory), :func:`flat_target` (the flat state a load fills) and
:func:`plan_reads` (which files and byte ranges a rank reads, and the mode, without reading
data), :func:`overlaps` (per value, the stored shards a rank's chunks overlap, from the index and
layouts alone: which ranks' files a resharded load opens), :func:`overlapping` (stored shards of
a layout overlapping a chunk). The format is described in
docs/checkpoint.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

if TYPE_CHECKING:
    from fastinit.checkpoint.consolidation import consolidate
    from fastinit.checkpoint.format import Index, rank_dir, read_index
    from fastinit.checkpoint.interval import IntervalChoice, choose_interval, format_choice
    from fastinit.checkpoint.loading import (
        LoadReport,
        ReadPlan,
        flat_target,
        load,
        overlaps,
        plan_reads,
        verify,
    )
    from fastinit.checkpoint.manager import CheckpointManager
    from fastinit.checkpoint.publishing import (
        PublishReport,
        load_unsharded,
        publish,
        record_verification,
    )
    from fastinit.checkpoint.reshard import StoredShard, overlapping
    from fastinit.checkpoint.saving import SaveHandle, close, prepare, save
    from fastinit.errors import CheckpointError, PublishError

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "verify",
    "Index",
    "IntervalChoice",
    "LoadReport",
    "ReadPlan",
    "SaveHandle",
    "StoredShard",
    "choose_interval",
    "consolidate",
    "flat_target",
    "format_choice",
    "load",
    "overlapping",
    "overlaps",
    "plan_reads",
    "rank_dir",
    "read_index",
    "save",
    "prepare",
    "close",
    "PublishError",
    "PublishReport",
    "load_unsharded",
    "publish",
    "record_verification",
]

_EXPORTS = {
    "consolidate": ".consolidation",
    "CheckpointError": "fastinit.errors",
    "Index": ".format",
    "rank_dir": ".format",
    "read_index": ".format",
    "IntervalChoice": ".interval",
    "choose_interval": ".interval",
    "format_choice": ".interval",
    "LoadReport": ".loading",
    "ReadPlan": ".loading",
    "flat_target": ".loading",
    "load": ".loading",
    "overlaps": ".loading",
    "plan_reads": ".loading",
    "verify": ".loading",
    "CheckpointManager": ".manager",
    "PublishError": "fastinit.errors",
    "PublishReport": ".publishing",
    "load_unsharded": ".publishing",
    "publish": ".publishing",
    "record_verification": ".publishing",
    "StoredShard": ".reshard",
    "overlapping": ".reshard",
    "SaveHandle": ".saving",
    "close": ".saving",
    "prepare": ".saving",
    "save": ".saving",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
