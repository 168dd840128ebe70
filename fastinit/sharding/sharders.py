"""TorchRec sharders that shard exactly as the stock ones, minus the start-up communication.

They subclass TorchRec's own sharders (its plug-in mechanism) and its sharded modules:

* :class:`FastEmbeddingCollectionSharder` builds each table's ``ShardedTensor`` metadata locally
  from the plan's ``sharding_spec`` (stock: 2 ``all_gather_object`` per table), with the table's
  data type, as TorchRec's ``EmbeddingBagCollection`` path already does.
* Both fast sharders wrap data-parallel tables in DDP without its init sync (stock: a shape
  verification all_gather and a coalesced broadcast per module) and re-initialise data-parallel
  tables from a generator seeded by ``(seed, table FQN)`` instead of broadcasting each one from
  rank 0, so every rank holds the same values with no message.

Everything else (lookups, input/output dists, fused optimizers, state_dict) is TorchRec's.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype

from fastinit.sharding import _torchrec_modules as _trc

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "fast_sharders",
    "seeded_generator_seed",
]


def seeded_generator_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the parameter (or module) ``name``; the same on every rank and process."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _seeded_init(param: torch.Tensor, init_fn: Any, seed: int, name: str) -> None:
    devices = [param.device] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seeded_generator_seed(seed, name))
        init_fn(param)


def _ddp_without_init_sync(lookup: nn.Module, env: Any, device: torch.device | None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        module=lookup,
        device_ids=[device] if device is not None and device.type in {"cuda", "mtia"} else None,
        process_group=env.process_group,
        gradient_as_bucket_view=True,
        broadcast_buffers=True,
        static_graph=True,
        init_sync=False,
    )


class _FastStateMixin:
    """Shared by the fast sharded modules: DP lookups without DDP init sync, seeded DP tables."""

    _fastinit_seed: int
    _fastinit_fqn: str

    def _fastinit_reset_dp_tables(self, configs: list[Any], params: Any) -> None:
        if params is None:  # no torch state (TorchRec skips it on the "fake" backend)
            return
        plan = self.module_sharding_plan  # type: ignore[attr-defined]
        for config in configs:
            if plan[config.name].sharding_type != ShardingType.DATA_PARALLEL.value:
                continue
            param = params[config.name].weight
            if param.device.type == "meta" or config.init_fn is None:
                continue
            name = f"{self._fastinit_fqn}.{config.name}" if self._fastinit_fqn else config.name
            _seeded_init(param, config.init_fn, self._fastinit_seed, name)


class FastShardedEmbeddingBagCollection(_FastStateMixin, ShardedEmbeddingBagCollection):
    """``ShardedEmbeddingBagCollection`` whose data-parallel tables need no start-up sync."""

    def init_data_parallel(self) -> None:
        from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding

        for i, (sharding, lookup) in enumerate(
            zip(self._embedding_shardings, self._lookups, strict=True)
        ):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                self._lookups[i] = _ddp_without_init_sync(lookup, self._env, self._device)

    def reset_parameters(self) -> None:
        if self._device and self._device.type == "meta":
            return
        for config in self._embedding_bag_configs:
            ps = self.module_sharding_plan[config.name]
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                continue
            if ps.compute_kernel in {"key_value", "ssd_virtual_table", "dram_virtual_table"}:
                continue
            param = self.embedding_bags[config.name].weight
            name = f"{self._fastinit_fqn}.{config.name}"
            _seeded_init(param, config.init_fn, self._fastinit_seed, name)
        self._fastinit_reset_dp_tables(self._embedding_bag_configs, self.embedding_bags)


class FastShardedEmbeddingCollection(_FastStateMixin, ShardedEmbeddingCollection):
    """``ShardedEmbeddingCollection`` with locally built ShardedTensor metadata."""

    def init_data_parallel(self) -> None:
        from torchrec.distributed.sharding.dp_sequence_sharding import (
            DpSequenceEmbeddingSharding,
        )

        for index, (sharding, lookup) in enumerate(
            zip(self._sharding_type_to_sharding.values(), self._lookups, strict=True)
        ):
            if isinstance(sharding, DpSequenceEmbeddingSharding):
                self._lookups[index] = _ddp_without_init_sync(lookup, self._env, self._device)

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        def local_init(local_shards: Any, *global_size: Any, **kwargs: Any) -> Any:
            return _local_sharded_tensor(self, local_shards, global_size, **kwargs)

        with _trc.local_sharded_tensor_init(local_init):
            super()._initialize_torch_state(skip_registering)

    def reset_parameters(self) -> None:
        if self._device and self._device.type == "meta":
            return
        for config in self._embedding_configs:
            ps = self.module_sharding_plan[config.name]
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                continue
            if ps.compute_kernel in {
                "key_value",
                "ssd_virtual_table",
                "dram_virtual_table",
                "dram_ssd_virtual_table",
            }:
                continue
            param = self.embeddings[config.name].weight
            name = f"{self._fastinit_fqn}.{config.name}"
            _seeded_init(param, config.init_fn, self._fastinit_seed, name)
        self._fastinit_reset_dp_tables(self._embedding_configs, self.embeddings)


def _local_sharded_tensor(
    module: Any,
    local_shards: Any,
    global_size: tuple[Any, ...],
    process_group: Any = None,
    init_rrefs: bool = False,
) -> Any:
    """Build one table's ShardedTensor from the plan (no collective), or NotImplemented."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor, TensorProperties

    name = _trc.ec_local_shards_by_id(module).get(id(local_shards))
    if name is None or init_rrefs:
        return NotImplemented
    config = _trc.table_config(module, name)
    if getattr(config, "use_virtual_table", False):
        return NotImplemented
    spec = module.module_sharding_plan[name].sharding_spec
    if spec is None:
        return NotImplemented
    if len(global_size) == 1 and isinstance(global_size[0], list | tuple | torch.Size):
        global_size = tuple(global_size[0])
    metadata = spec.build_metadata(
        tensor_sizes=torch.Size(global_size),
        tensor_properties=TensorProperties(dtype=data_type_to_dtype(config.data_type)),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=process_group
    )


def _place(sharded: Any, seed: int, module_fqn: str | None) -> Any:
    sharded._fastinit_seed = seed
    sharded._fastinit_fqn = module_fqn or ""
    return sharded


class FastEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose data-parallel tables need no start-up sync.

    Args:
        seed: seeds data-parallel (and sharded) table initialisation per table FQN.
        **kwargs: those of ``EmbeddingBagCollectionSharder``.
    """

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed

    def shard(
        self,
        module: Any,
        params: dict[str, Any],
        env: Any,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        sharded = FastShardedEmbeddingBagCollection.__new__(FastShardedEmbeddingBagCollection)
        _place(sharded, self.seed, module_fqn)
        sharded.__init__(  # type: ignore[misc]
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )
        sharded._fastinit_reset_dp_tables(
            sharded._embedding_bag_configs, getattr(sharded, "embedding_bags", None)
        )
        return sharded

    @property
    def sharded_module_type(self) -> type[ShardedEmbeddingBagCollection]:
        return FastShardedEmbeddingBagCollection


class FastEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` with local ShardedTensor metadata and sync-free DP tables.

    Args:
        seed: seeds data-parallel (and sharded) table initialisation per table FQN.
        **kwargs: those of ``EmbeddingCollectionSharder``.
    """

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed

    def shard(
        self,
        module: Any,
        params: dict[str, Any],
        env: Any,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingCollection:
        sharded = FastShardedEmbeddingCollection.__new__(FastShardedEmbeddingCollection)
        _place(sharded, self.seed, module_fqn)
        sharded.__init__(  # type: ignore[misc]
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )
        sharded._fastinit_reset_dp_tables(
            sharded._embedding_configs, getattr(sharded, "embeddings", None)
        )
        return sharded

    @property
    def sharded_module_type(self) -> type[ShardedEmbeddingCollection]:
        return FastShardedEmbeddingCollection


_FAST = {
    EmbeddingBagCollectionSharder: FastEmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder: FastEmbeddingCollectionSharder,
}
_INNER = ("_ebc_sharder", "_e_sharder", "_ec_sharder")


def _fast_copy(sharder: Any, seed: int) -> Any:
    fast_type = _FAST.get(type(sharder))
    if fast_type is not None:
        fast = copy.copy(sharder)
        fast.__class__ = fast_type
        fast.seed = seed
        return fast
    # Composite sharders (feature-processed EBC, managed-collision EBC/EC) shard through an inner
    # EBC/EC sharder: make that one fast.
    inner = next((a for a in _INNER if type(getattr(sharder, a, None)) in _FAST), None)
    if inner is None:
        return sharder
    fast = copy.copy(sharder)
    setattr(fast, inner, _fast_copy(getattr(sharder, inner), seed))
    return fast


def fast_sharders(sharders: list[Any] | None, seed: int) -> list[Any]:
    """The fast equivalents of ``sharders`` (default: TorchRec's default sharders).

    A stock EBC/EC sharder becomes its fast subclass with the same settings (fused params, qcomm
    codecs, ...); composite sharders get a fast inner sharder; any other sharder — the user's own
    subclass included — is used as given.
    """
    if sharders is None:
        from torchrec.distributed.sharding_plan import get_default_sharders

        sharders = get_default_sharders()
    return [_fast_copy(s, seed) for s in sharders]
