"""Private TorchRec and torch names touched by fastinit's own code (not its copies of TorchRec's:
those are in :mod:`fastinit.sharding.mirror`, each touching what its upstream original touches).

Written against torchrec 1.8.0 and torch 2.13.0; :func:`fastinit.compat.require` checks for them
before any of these names is used, so an upgrade fails loudly instead of silently changing what
these code paths do. No class is patched: everything here reads attributes of one sharded module
instance, or calls torch's private helpers.

Touches:
    ShardedEmbeddingCollection / ShardedEmbeddingBagCollection:
        ._model_parallel_name_to_local_shards, ._model_parallel_name_to_shards_wrapper,
        ._table_name_to_config (read),
    torchrec.distributed.collective_utils._resolve_enablement_on_leader (what rank 0's
        collective-validation setting is; set without a broadcast by
        :mod:`fastinit.sharding.mirror.collective_utils`),
    ShardedTensor's private constructor steps (below, for :mod:`fastinit.sharding.local`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastinit.plan.layout import LazyShards, SharedShards


def _params_of(module: Any) -> nn.ModuleDict | None:
    """The per-table ``nn.Module`` dict of a sharded EC (``embeddings``) or EBC
    (``embedding_bags``); None before ``_initialize_torch_state`` ran."""
    out = getattr(module, "embedding_bags", None)
    if out is None:
        out = getattr(module, "embeddings", None)
    return out if isinstance(out, nn.ModuleDict) else None


def table_pieces(module: Any, name: str) -> list[tuple[torch.Tensor, int, int]]:
    """This rank's pieces of table ``name``: ``(tensor, first global row, first global column)``.

    A data-parallel table is one piece, the whole table. A sharded table's pieces are its local
    shards (views of the kernel's weights), read from the module's shard lists.
    """
    sharding = module.module_sharding_plan[name]
    if sharding.sharding_type == "data_parallel":
        params = _params_of(module)
        if params is None or name not in params:
            return []
        weight = getattr(params[name], "weight", None)
        return [] if weight is None else [(weight.data, 0, 0)]
    shards = getattr(module, "_model_parallel_name_to_local_shards", {}).get(name)
    if shards:
        return [
            (s.tensor, int(s.metadata.shard_offsets[0]), int(s.metadata.shard_offsets[1]))
            for s in shards
        ]
    wrapper = getattr(module, "_model_parallel_name_to_shards_wrapper", {}).get(name) or {}
    return [
        (t, int(off[0]), int(off[1]))
        for t, off in zip(
            wrapper.get("local_tensors", []), wrapper.get("local_offsets", []), strict=True
        )
    ]


def table_config(module: Any, name: str) -> Any:
    return module._table_name_to_config[name]


def collective_validation_on_leader() -> bool:
    """What rank 0's ``init_collective_validation`` would broadcast, resolved on this rank."""
    from torchrec.distributed import collective_utils

    return bool(collective_utils._resolve_enablement_on_leader())


# ---- ShardedTensor from local shards and global metadata (fastinit.sharding.local) -----------
# Touches: ShardedTensor._normalize_pg,
# ._prepare_init, ._post_init, ._local_shards, c10d._rank_not_in_group, and torch's layout checks
# (_infer_sharding_spec_from_shards_metadata, validate_non_overlapping_shards_metadata,
# check_tensor). Written against torch 2.13.0.


def rank_not_in_group(pg: Any) -> bool:
    from torch.distributed import distributed_c10d as c10d

    return bool(c10d._rank_not_in_group(pg))


def normalize_pg(pg: Any) -> Any:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor._normalize_pg(pg)


def validate_layout(shards: Any, size: list[int], checks: bool = True) -> Any:
    """torch's layout checks of ``_init_from_local_shards_and_global_metadata`` (strided layout
    aside): the inferred sharding spec, after the overlap and bounds checks (``checks=False``:
    done already, on the layout's rule)."""
    from torch.distributed._shard.sharding_spec import api as spec_api
    from torch.distributed._shard.sharding_spec._internals import (
        check_tensor,
        validate_non_overlapping_shards_metadata,
    )

    spec = spec_api._infer_sharding_spec_from_shards_metadata(shards)
    if checks:
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, size)
    return spec


def sharded_tensor_from_checked_layout(
    local_shards: list[Any],
    metadata: Any,
    spec: Any,
    process_group: Any,
    built: dict[Any, Any] | None = None,
    held: Any = None,
) -> Any:
    """The rest of torch 2.13.0's ``_init_from_local_shards_and_global_metadata`` once the
    layout has been checked: the local shards' checks, then the tensor. ``built`` remembers
    ``spec.build_metadata`` per size and tensor properties (O(shards) for torch's specs), so
    tensors of one layout get a copy of it instead of a rebuild. ``held``: metadata known to
    have the shards ``spec.build_metadata`` would give (a :class:`LazyShards` layout), held
    as it is, unbuilt."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ShardingSpec

    props = metadata.tensor_properties
    if props.layout != torch.strided:
        raise ValueError("Only torch.strided layout is currently supported")
    size = metadata.size
    key = (tuple(size), props.dtype, props.layout, props.requires_grad, props.pin_memory)
    template = built.get(key) if built is not None else held
    if template is None:
        dims = torch.Size(size)
        template = spec.build_metadata(
            dims, TensorProperties(props.dtype, props.layout, props.requires_grad, props.pin_memory)
        )
        if built is not None:
            built[key] = template

    shards, global_size = template.shards_metadata, template.size

    def copied() -> Any:
        if isinstance(shards, LazyShards) and not shards.expanded:
            return LazyShards(shards.runs, shards._exp)
        checked = shards.checked if isinstance(shards, SharedShards) else None
        return SharedShards(shards, checked)

    class _Built(ShardingSpec):
        def build_metadata(self, tensor_sizes: Any, tensor_properties: Any) -> Any:
            return ShardedTensorMetadata(copied(), global_size, tensor_properties)

        def shard(self, tensor: Any, src_rank: int = 0, process_group: Any = None) -> Any:
            raise NotImplementedError

    st = ShardedTensor.__new__(
        ShardedTensor,
        _Built(),
        size,
        dtype=props.dtype,
        layout=props.layout,
        pin_memory=props.pin_memory,
        requires_grad=props.requires_grad,
    )
    st._sharding_spec = spec

    def mismatch(expected: Any, actual: Any, prop: str, rank: Any, is_property: bool) -> None:
        what = "tensor property" if is_property else "local ShardMetadata"
        if expected != actual:
            raise ValueError(
                f"Local shards' tensor {prop} property is incompatible with {what} on rank "
                f"{rank}: {what} {prop}={expected}, local shard tensor {prop}={actual}."
            )

    for shard in local_shards:
        meta = shard.metadata
        tensor = shard.tensor
        placement = meta.placement
        if placement is None:
            raise AssertionError("Must specify placement for `Shard`!")
        rank = placement.rank()
        mismatch(props.layout, tensor.layout, "layout", rank, True)
        if not tensor.is_contiguous():
            raise ValueError("Only torch.contiguous_format memory_format is currently supported")
        mismatch(meta.shard_sizes, list(tensor.size()), "size", rank, False)
        mismatch(props.pin_memory, tensor.is_pinned(), "pin_memory", rank, True)
        mismatch(placement.device(), tensor.device, "device", rank, False)
        mismatch(props.dtype, tensor.dtype, "dtype", rank, True)
        mismatch(props.requires_grad, tensor.requires_grad, "requires_grad", rank, True)
    st._local_shards = local_shards
    st._prepare_init(process_group=process_group, init_rrefs=False)
    st._post_init()
    return st
