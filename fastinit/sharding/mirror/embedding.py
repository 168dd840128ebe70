"""Mirrors ``torchrec/distributed/embedding.py``: ``ShardedEmbeddingCollection.
_initialize_torch_state`` (:func:`ec_initialize_torch_state`) with each table's ShardedTensor
metadata built from the plan, as TorchRec's EmbeddingBagCollection does.

Touches, as the upstream method does, the sharded module's ``_model_parallel_name_to_local_shards``,
``_model_parallel_name_to_shards_wrapper``, ``_model_parallel_name_to_sharded_tensor``,
``_output_dtensor``, ``_env``, ``_lookups``, ``_sharding_type_to_sharding`` (one instance; no
class is patched). Called by :class:`fastinit.sharding.sharders.FastShardedEmbeddingCollection`.
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

from fastinit.sharding._torchrec_modules import table_config

if TYPE_CHECKING:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

__all__ = ["ec_initialize_torch_state"]

_VIRTUAL_KERNELS = frozenset(
    {"key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table"}
)
_CUSTOMIZED = "customized_kernel"

logger = logging.getLogger(__name__)


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

    ``build(local_shards, metadata, pg)`` builds a ShardedTensor (the caller passes
    ``fastinit.sharding.local.sharded_tensor``).
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
