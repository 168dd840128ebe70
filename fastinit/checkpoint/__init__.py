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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.checkpoint.consolidation import consolidate
    from fastinit.checkpoint.format import CheckpointError, Index, rank_dir, read_index
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
        PublishError,
        PublishReport,
        load_unsharded,
        publish,
        record_verification,
    )
    from fastinit.checkpoint.reshard import StoredShard, overlapping
    from fastinit.checkpoint.saving import SaveHandle, close, prepare, save

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("IntervalChoice", "choose_interval", "format_choice"), "interval"),
    "CheckpointManager": "manager",
    "verify": "loading",
    "save": "saving",
    "prepare": "saving",
    "close": "saving",
    "SaveHandle": "saving",
    "load": "loading",
    "LoadReport": "loading",
    "ReadPlan": "loading",
    "plan_reads": "loading",
    "flat_target": "loading",
    "overlaps": "loading",
    "consolidate": "consolidation",
    "CheckpointError": "format",
    "Index": "format",
    "read_index": "format",
    "rank_dir": "format",
    "overlapping": "reshard",
    "StoredShard": "reshard",
    **dict.fromkeys(
        ("PublishError", "PublishReport", "load_unsharded", "publish", "record_verification"),
        "publishing",
    ),
}

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
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fastinit.checkpoint.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
