"""Private TorchRec and torch names touched by fastinit's sharders and ``setup``, in one place.

Written against torchrec 1.8.0 and torch 2.13.0; :func:`fastinit.compat.require` checks for them
before any of these names is used, so an upgrade fails loudly instead of silently changing what
these code paths do. No class is patched: everything here reads or sets attributes of one
sharded module instance.

Touches:
    ShardedEmbeddingCollection / ShardedEmbeddingBagCollection:
        ._model_parallel_name_to_local_shards, ._model_parallel_name_to_shards_wrapper,
        ._model_parallel_name_to_sharded_tensor, ._model_parallel_name_to_dtensor,
        ._table_name_to_config, ._output_dtensor, ._env, ._lookups,
        ._sharding_type_to_sharding (EC), ._embedding_shardings (EBC),
    ShardedTensor._init_from_local_shards_and_global_metadata (the local route that TorchRec's
        own EmbeddingBagCollection uses),
    torchrec.distributed.collective_utils._INITIALIZED / _USE_COLLECTIVE_VALIDATION /
        _resolve_enablement_on_leader (collective validation configured without a broadcast),
    EmbeddingShardingPlanner._topology / ._constraints (read, for the plan fingerprint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

_VIRTUAL_KERNELS = frozenset(
    {"key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table"}
)
_CUSTOMIZED = "customized_kernel"

logger = logging.getLogger(__name__)


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


def _ec_can_build_locally(module: Any) -> bool:
    if getattr(module, "_output_dtensor", False):
        return False
    for name, ps in module.module_sharding_plan.items():
        if ps.sharding_type == "data_parallel":
            continue
        if ps.compute_kernel in _VIRTUAL_KERNELS or ps.compute_kernel == _CUSTOMIZED:
            return False
        if ps.sharding_spec is None or getattr(
            table_config(module, name), "use_virtual_table", False
        ):
            return False
    return True


@contextlib.contextmanager
def _without_state_dict_handling(module: Any) -> Iterator[list[str]]:
    """Within the block, the module's own plan marks its sharded tables "customized_kernel",
    the value for which TorchRec's ``_initialize_torch_state`` registers the tables' parameters
    and state_dict hooks but builds no ShardedTensor (no collective). Only this instance's
    ``module_sharding_plan`` dict is swapped (its ParameterSharding objects, shared with the
    DMP plan, are copied, not changed) and restored after. Yields the tables so marked."""
    original = module.module_sharding_plan
    marked = [n for n, ps in original.items() if ps.sharding_type != "data_parallel"]
    swapped = dict(original)
    for name in marked:
        swapped[name] = dataclasses.replace(original[name], compute_kernel=_CUSTOMIZED)
    module.module_sharding_plan = type(original)(swapped) if isinstance(original, dict) else swapped
    try:
        yield marked
    finally:
        module.module_sharding_plan = original


def ec_initialize_torch_state(
    module: ShardedEmbeddingCollection,
    skip_registering: bool,
    stock: Callable[[bool], None],
    build: Callable[[list[Any], Any, Any], Any],
) -> None:
    """``ShardedEmbeddingCollection._initialize_torch_state`` with each table's ShardedTensor
    metadata built from the plan's ``sharding_spec`` (stock: 2 ``all_gather_object`` per table),
    with the table's data type, as TorchRec's EmbeddingBagCollection does.

    ``build(local_shards, metadata, pg)`` builds a ShardedTensor (``fastinit.sharding.local.
    sharded_tensor``, passed in: this module imports nothing of ``local``, which imports it).
    ``stock(skip_registering)`` is TorchRec's method; it runs unchanged (parameters, hooks) with
    the sharded tables' state_dict handling left to this function. Modules this does not cover
    (DTensor output, virtual tables, customised kernels) run TorchRec's method as it is.
    """
    if not _ec_can_build_locally(module):
        logger.info(
            "fastinit: EmbeddingCollection %s (DTensor output, virtual tables or customised "
            "kernels): TorchRec builds its ShardedTensors (2 all_gather_object per table)",
            getattr(module, "_module_fqn", None) or "",
        )
        stock(skip_registering)
        return
    with _without_state_dict_handling(module) as marked:
        stock(skip_registering)
    from torch.distributed._shard.sharded_tensor import ShardedTensor, TensorProperties
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.types import ShardingEnv2D
    from torchrec.modules.embedding_configs import data_type_to_dtype

    m: Any = module
    plan = m.module_sharding_plan
    local: OrderedDict[str, list[Any]] = OrderedDict((n, []) for n in marked)
    m._model_parallel_name_to_local_shards = local
    m._model_parallel_name_to_shards_wrapper = OrderedDict(
        (n, OrderedDict([("local_tensors", []), ("local_offsets", [])])) for n in marked
    )
    for sharding_type, lookup in zip(m._sharding_type_to_sharding.keys(), m._lookups, strict=True):
        if sharding_type == "data_parallel":
            continue
        for key, value in lookup.state_dict().items():
            name = key[: -len(".weight")]
            if isinstance(value, ShardedTensor) and name in local:
                local[name].extend(value.local_shards())
    pg = m._env.sharding_pg if isinstance(m._env, ShardingEnv2D) else m._env.process_group
    for name, shards in local.items():
        holder = m.embeddings[name]
        if not hasattr(holder, "weight"):  # no shard of this table on this rank
            holder.register_parameter("weight", nn.Parameter(torch.empty(0)))
            if plan[name].compute_kernel != EmbeddingComputeKernel.DENSE.value:
                from torchrec.optim.fused import EmptyFusedOptimizer

                holder.weight._in_backward_optimizers = [EmptyFusedOptimizer()]
        config = table_config(module, name)
        metadata = plan[name].sharding_spec.build_metadata(
            tensor_sizes=torch.Size((config.num_embeddings, config.embedding_dim)),
            tensor_properties=TensorProperties(dtype=data_type_to_dtype(config.data_type)),
        )
        m._model_parallel_name_to_sharded_tensor[name] = build(shards, metadata, pg)


def table_config(module: Any, name: str) -> Any:
    return module._table_name_to_config[name]


def collective_validation_on_leader() -> bool:
    """What rank 0's ``init_collective_validation`` would broadcast, resolved on this rank."""
    from torchrec.distributed import collective_utils

    return bool(collective_utils._resolve_enablement_on_leader())


def set_collective_validation(enabled: bool) -> None:
    """Configure TorchRec's collective validation as ``init_collective_validation`` would, with
    rank 0's value already known, so DMP's own call returns at once (no broadcasts)."""
    from torchrec.distributed import collective_utils

    if collective_utils._INITIALIZED:
        return
    collective_utils._USE_COLLECTIVE_VALIDATION = enabled
    collective_utils._INITIALIZED = True


def planner_inputs(planner: Any) -> tuple[Any, Any]:
    """``(topology, constraints)`` of a TorchRec planner (no public accessor in 1.8.0)."""
    return planner._topology, getattr(planner, "_constraints", None)


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

    from fastinit.sharding.layout import LazyShards, SharedShards

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
