"""The one module of ``fastinit.checkpoint`` that touches private names of torch's DCP.

``torch.distributed.checkpoint`` (torch 2.13/2.14) has no public route to: flatten a state dict
the way its planners do (the FQNs its ``.metadata`` is keyed by), list the chunks a tensor holds
on this rank, name the global metadata file, or record where an item lies in a data file (what
a writer other than its own ``FileSystemWriter`` returns). Everything else is public DCP API.
"""

from __future__ import annotations

from typing import Any

__all__ = ["flatten", "chunks_of", "METADATA_FILE", "DATA_SUFFIX", "storage_info"]

#: The file name of DCP's metadata (``.metadata``) in a checkpoint directory.
METADATA_FILE = ".metadata"


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened exactly as DCP's default planners flatten it (same FQNs)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _mapping = flatten_state_dict(state)
    return flat


def chunks_of(value: Any) -> list[Any]:
    """This rank's chunks (``ChunkStorageMetadata``) of a ShardedTensor, DTensor or tensor."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    return _create_chunk_list(value)


def metadata_file() -> str:
    from torch.distributed.checkpoint import filesystem

    return str(getattr(filesystem, "_metadata_fn", METADATA_FILE))


#: The suffix of DCP's data files (``__<rank>_<n>.distcp``).
DATA_SUFFIX = ".distcp"


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where an item lies: ``length`` bytes at ``offset`` of a data file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)
