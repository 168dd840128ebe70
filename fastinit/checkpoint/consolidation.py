"""``consolidate``: write DCP's global ``.metadata`` for a fastinit checkpoint.

After it, stock ``torch.distributed.checkpoint.load`` (and DCP's tools, e.g.
``dcp_to_torch_save``) read the checkpoint: the global metadata lists every rank's chunks with
their file paths relative to the checkpoint (``data-<save id>/rank_<r>/__0_0.distcp``). CPU only,
no process group; it reads every rank's manifest and metadata (O(world size), once, offline,
each proven by the commit), and can run as a separate job while training goes on. fastinit's own
:func:`~fastinit.checkpoint.load` keeps using the index (it never reads the global file).

It writes one file, ``.metadata``, and never over a file it did not write: a ``.metadata``
already there must be its own output for this very save (then it is written again, the same),
else :class:`~fastinit.checkpoint.format.CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

from fastinit.checkpoint import format as fmt

__all__ = ["consolidate"]

_WRITER = "fastinit.checkpoint.consolidate"


def _ours(path: str, save_id: str) -> bool:
    """Is the ``.metadata`` at ``path`` consolidate's own output for save ``save_id``?"""
    try:
        with open(path, "rb") as f:
            md = pickle.load(f)
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False
    meta = getattr(md, "storage_meta", None)
    return (
        getattr(meta, "save_id", None) == save_id
        and str(getattr(meta, "checkpoint_id", "")) == _WRITER
    )


def consolidate(checkpoint_dir: str | os.PathLike[str]) -> str:
    """Write ``<checkpoint_dir>/.metadata`` (atomically) from the index and the per-rank
    metadata of a committed checkpoint; returns its path.

    Raises:
        CheckpointError: the checkpoint is not committed, a rank's manifest or metadata is
            missing or does not match the commit, or a ``.metadata`` that consolidate did not
            write for this save is already there (it is left as it is).
    """
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    checkpoint_dir = os.fspath(checkpoint_dir)
    commit = fmt.read_commit(checkpoint_dir)
    index = fmt.read_index(checkpoint_dir, commit)
    out = os.path.join(checkpoint_dir, fmt.DCP_METADATA)
    if os.path.lexists(out) and not _ours(out, commit.save_id):
        raise fmt.CheckpointError(
            f"{out} exists and is not consolidate's output for this checkpoint's save "
            f"({commit.save_id}); it is left as it is and nothing is written"
        )
    parts: list[int | None] = [None, *range(index.world_size)]
    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner_data: dict[str, Any] = {}
    version = None
    for rank in parts:
        manifest, _ = fmt.read_manifest(checkpoint_dir, commit, rank)
        part = index.part_dir(checkpoint_dir, rank)
        recorded = manifest.files.get(fmt.DCP_METADATA)
        if recorded is None:
            raise fmt.CheckpointError(f"{part}: its manifest names no {fmt.DCP_METADATA}")
        data = fmt.read_verified(
            os.path.join(part, fmt.DCP_METADATA), recorded[1], "the part's DCP metadata"
        )
        try:
            md = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a pickle of another torch's classes
            raise fmt.CheckpointError(f"{part}: metadata unreadable ({e})") from None
        version = version or md.version
        for fqn, entry in md.state_dict_metadata.items():
            have = sd_md.get(fqn)
            if isinstance(entry, TensorStorageMetadata):
                if have is None:
                    sd_md[fqn] = TensorStorageMetadata(entry.properties, entry.size, [])
                    have = sd_md[fqn]
                have.chunks.extend(entry.chunks)
            elif have is None:
                sd_md[fqn] = entry
        rel = os.path.relpath(part, checkpoint_dir)
        for key, info in (md.storage_data or {}).items():
            storage[key] = dataclasses.replace(
                info, relative_path=os.path.join(rel, info.relative_path)
            )
        if isinstance(md.planner_data, dict):
            planner_data.update(md.planner_data)
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner_data or None,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=_WRITER, save_id=commit.save_id),
        version=version,
    )
    fmt.write_bytes_atomic(out, pickle.dumps(metadata))
    return out
