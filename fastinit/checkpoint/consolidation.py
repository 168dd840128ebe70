"""``consolidate``: write DCP's global ``.metadata`` for a fastinit checkpoint.

After it, stock ``torch.distributed.checkpoint.load`` (and DCP's tools, e.g.
``dcp_to_torch_save``) read the checkpoint: the global metadata lists every rank's chunks with
their file paths relative to the checkpoint (``rank_<r>/__0_0.distcp``). CPU only, no process
group; it reads every rank's metadata (O(world size), once, offline), and can run as a separate
job while training goes on. fastinit's own :func:`~fastinit.checkpoint.load` keeps using the
index (it never reads the global file).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

from fastinit.checkpoint import _dcp
from fastinit.checkpoint import format as fmt

__all__ = ["consolidate"]


def consolidate(checkpoint_dir: str) -> str:
    """Write ``<checkpoint_dir>/.metadata`` (atomically) from the index and the per-rank
    metadata of a committed checkpoint; returns its path.

    Raises:
        CheckpointError: the checkpoint is not committed or a rank's metadata is missing.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    checkpoint_dir = os.fspath(checkpoint_dir)
    index = fmt.read_index(checkpoint_dir)
    subdirs = [fmt.REPLICATED_DIR] + [
        index.rank_dir_pattern.format(rank=r) for r in range(index.world_size)
    ]
    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner_data: dict[str, Any] = {}
    version = None
    for sub in subdirs:
        path = os.path.join(checkpoint_dir, sub)
        try:
            md = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001
            raise fmt.CheckpointError(f"{path}: metadata unreadable ({e})") from None
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
        for key, info in (md.storage_data or {}).items():
            storage[key] = dataclasses.replace(
                info, relative_path=os.path.join(sub, info.relative_path)
            )
        if isinstance(md.planner_data, dict):
            planner_data.update(md.planner_data)
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner_data or None,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=version,
    )
    out = os.path.join(checkpoint_dir, _dcp.metadata_file())
    tmp = f"{out}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
