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

from fastinit.seeding import seeded_generator_seed, seeded_init
from fastinit.sharding import _torchrec_modules as _trc
from fastinit.sharding import local as _local

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "fast_sharders",
]


_VIRTUAL_KERNELS = frozenset(
    {"key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table"}
)


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

    def _fastinit_reset(self, configs: list[Any], params: Any, *, dp_only: bool) -> None:
        """Initialise tables from generators seeded by ``(seed, table FQN)``: the same values on
        every rank, so data-parallel tables need no broadcast."""
        if params is None:  # no torch state (TorchRec skips it on the "fake" backend)
            return
        plan = self.module_sharding_plan  # type: ignore[attr-defined]
        items = []
        for config in configs:
            ps = plan[config.name]
            if dp_only and ps.sharding_type != ShardingType.DATA_PARALLEL.value:
                continue
            if ps.compute_kernel in _VIRTUAL_KERNELS or config.init_fn is None:
                continue
            param = params[config.name].weight
            if param.device.type == "meta" or not param.numel():
                continue
            name = f"{self._fastinit_fqn}.{config.name}" if self._fastinit_fqn else config.name
            items.append((param, config.init_fn, seeded_generator_seed(self._fastinit_seed, name)))
        seeded_init(items)


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
        self._fastinit_reset(self._embedding_bag_configs, self.embedding_bags, dp_only=False)

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: list[Any],
        env: Any,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> Any:
        # scale: row-wise and data-parallel shardings built for this rank only
        fast = _local.embedding_bag_sharding(sharding_infos, env, device, qcomm_codecs_registry)
        if fast is not None:
            return fast
        return super().create_embedding_bag_sharding(
            sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry
        )


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
        by_id: dict[int, str] = {}

        def local_init(local_shards: Any, *global_size: Any, **kwargs: Any) -> Any:
            # Every table's local-shard list exists before the first ShardedTensor is built.
            if not by_id:
                by_id.update(_trc.ec_local_shards_by_id(self))
            return _local_sharded_tensor(self, by_id, local_shards, global_size, **kwargs)

        with _trc.local_sharded_tensor_init(local_init):
            super()._initialize_torch_state(skip_registering)

    def reset_parameters(self) -> None:
        if self._device and self._device.type == "meta":
            return
        self._fastinit_reset(self._embedding_configs, self.embeddings, dp_only=False)

    @classmethod
    def create_embedding_sharding(
        cls,
        sharding_type: str,
        sharding_infos: list[Any],
        env: Any,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> Any:
        # scale: row-wise and data-parallel shardings built for this rank only
        fast = _local.embedding_sharding(
            sharding_type, sharding_infos, env, device, qcomm_codecs_registry
        )
        if fast is not None:
            return fast
        return super().create_embedding_sharding(
            sharding_type, sharding_infos, env, device, qcomm_codecs_registry
        )


def _local_sharded_tensor(
    module: Any,
    by_id: dict[int, str],
    local_shards: Any,
    global_size: tuple[Any, ...],
    process_group: Any = None,
    init_rrefs: bool = False,
) -> Any:
    """Build one table's ShardedTensor from the plan (no collective), or NotImplemented."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor, TensorProperties

    name = by_id.get(id(local_shards))
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


def _construct(
    cls: Any, seed: int, module_fqn: str | None, tables: tuple[str, str], **kwargs: Any
) -> Any:
    """Build a fast sharded module: seed and FQN are set before TorchRec's ``__init__`` runs
    (EmbeddingCollection resets its parameters inside it), then the DP tables are seeded."""
    sharded = cls.__new__(cls)
    sharded._fastinit_seed = seed
    sharded._fastinit_fqn = module_fqn or ""
    with _local.construction():  # scale: ShardedTensors without O(ranks) work per shard
        sharded.__init__(module_fqn=module_fqn, **kwargs)
    configs, params = tables
    sharded._fastinit_reset(getattr(sharded, configs), getattr(sharded, params, None), dp_only=True)
    return sharded


class _SeededSharder:
    """``seed`` seeds data-parallel (and sharded) table initialisation per table FQN."""

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed


class FastEmbeddingBagCollectionSharder(_SeededSharder, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose data-parallel tables need no start-up sync.

    Args:
        seed: seeds data-parallel (and sharded) table initialisation per table FQN.
        **kwargs: those of ``EmbeddingBagCollectionSharder``.
    """

    def shard(
        self,
        module: Any,
        params: dict[str, Any],
        env: Any,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        return _construct(
            FastShardedEmbeddingBagCollection,
            self.seed,
            module_fqn,
            ("_embedding_bag_configs", "embedding_bags"),
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )

    @property
    def sharded_module_type(self) -> type[ShardedEmbeddingBagCollection]:
        return FastShardedEmbeddingBagCollection


class FastEmbeddingCollectionSharder(_SeededSharder, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` with local ShardedTensor metadata and sync-free DP tables.

    Args:
        seed: seeds data-parallel (and sharded) table initialisation per table FQN.
        **kwargs: those of ``EmbeddingCollectionSharder``.
    """

    def shard(
        self,
        module: Any,
        params: dict[str, Any],
        env: Any,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingCollection:
        return _construct(
            FastShardedEmbeddingCollection,
            self.seed,
            module_fqn,
            ("_embedding_configs", "embeddings"),
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
        )

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
        fast = fast_type.__new__(fast_type)
        fast.__dict__.update(sharder.__dict__)  # the same settings: fused params, codecs, ...
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
