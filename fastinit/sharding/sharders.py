"""TorchRec sharders that shard exactly as the stock ones, minus the start-up communication.

They subclass TorchRec's own sharders (its plug-in mechanism) and its sharded modules:

* :class:`FastEmbeddingCollectionSharder` builds each table's ``ShardedTensor`` metadata locally
  from the plan's ``sharding_spec`` (stock: 2 ``all_gather_object`` per table), with the table's
  data type, as TorchRec's ``EmbeddingBagCollection`` path already does; no class is patched.
* Both fast sharders wrap data-parallel tables in DDP without its init sync (stock: a shape
  verification all_gather and a coalesced broadcast per module).
* Every local piece of every table — data-parallel, or a shard of any sharding type — is
  initialised by :func:`fastinit.seeding.init_table_shards`: the values of a table are a function
  of ``(seed, table FQN)`` alone, so data-parallel replicas agree with no message, shards of one
  table are distinct, and any plan gathers to the same table. TorchRec's own construction-time
  initialisation (its kernels fill their weights first) runs under
  :func:`fastinit.seeding.scratch_rng`, so building never draws from the global RNG.

* Their lookups, kernels and fused optimizers are TorchRec's, subclassed to build their
  ShardedTensors locally (:mod:`fastinit.sharding.kernels`); nothing is patched.

Everything else (input/output dists, state_dict hooks, the optimizers' arithmetic) is TorchRec's.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.modules.embedding_configs import data_type_to_dtype

from fastinit import compat, ports, seeding
from fastinit.sharding import _torchrec_modules as _trc
from fastinit.sharding import kernels as _kernels
from fastinit.sharding import local as _local
from fastinit.sharding.mirror import embedding as _mirror_ec

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "fast_sharders",
    "tables_deferred",
]


_VIRTUAL_KERNELS = frozenset(
    {"key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table"}
)


#: Set while ``fastinit.setup(init_tables=False)`` constructs (this context only): the fast
#: sharded modules leave their sharded tables as allocated, for a checkpoint load to fill
#: (:mod:`fastinit.tables`).
_DEFER_TABLES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fastinit_defer_tables", default=False
)


@contextlib.contextmanager
def tables_deferred(defer: bool = True) -> Iterator[None]:
    """Within the block (this context), fast sharded modules built with ``defer`` initialise
    only their data-parallel tables (replicated values are verified at construction) and leave
    the others pending (``_fastinit_pending``)."""
    token = _DEFER_TABLES.set(defer)
    try:
        yield
    finally:
        _DEFER_TABLES.reset(token)


_EBC_INIT_DP = "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection.init_data_parallel"


def _ebc_ddp_device_types() -> frozenset[str]:
    """The device types whose device the stock EBC ``init_data_parallel`` hands DDP as
    ``device_ids``: cuda and mtia in 1.8.0, tpu too in 1.9 (stock EC: cuda only, both)."""
    if ports.mirrors_release(_EBC_INIT_DP, "torchrec 1.8.0"):
        return frozenset({"cuda", "mtia"})
    return frozenset({"cuda", "mtia", "tpu"})


def _skips_grad_sync(module: Any) -> bool:
    """TorchRec 1.9's ``mark_data_parallel_skip_grad_sync``: the module's data-parallel lookups
    stay unwrapped (no DDP). 1.8.0 has no such mark."""
    return bool(getattr(module, "_skip_data_parallel_grad_sync", False))


def _ddp_without_init_sync(
    lookup: nn.Module, env: Any, device: torch.device | None, device_types: frozenset[str]
) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel  # looked up per call (tests record it)

    return DistributedDataParallel(
        module=lookup,
        device_ids=[device] if device is not None and device.type in device_types else None,
        process_group=env.process_group,
        gradient_as_bucket_view=True,
        broadcast_buffers=True,
        static_graph=True,
        init_sync=False,
    )


class _FastStateMixin:
    """Shared by the fast sharded modules: sync-free DP lookups, plan-invariant seeded tables."""

    _fastinit_seed: int
    _fastinit_fqn: str
    _fastinit_building: bool

    def _fastinit_configs(self) -> list[Any]:
        raise NotImplementedError

    _fastinit_pending: frozenset[str] = frozenset()
    """Tables left for a checkpoint load (``setup(init_tables=False)``), by name."""

    def _fastinit_tables(self) -> list[tuple[Any, Any]]:
        """``(config, parameter sharding)`` of every table fastinit initialises."""
        plan = self.module_sharding_plan  # type: ignore[attr-defined]
        tables = []
        for config in self._fastinit_configs():
            ps = plan.get(config.name)
            if ps is None or ps.compute_kernel in _VIRTUAL_KERNELS or config.init_fn is None:
                continue
            tables.append((config, ps))
        return tables

    def reset_parameters(self, tables: Collection[str] | None = None) -> None:
        """Initialise every local piece of every table (or of ``tables``, by name) from its
        ``(seed, table FQN)`` blocks; those are no longer pending."""
        device = getattr(self, "_device", None)
        if device is not None and device.type == "meta":
            return
        if getattr(self, "_fastinit_building", False):
            return  # TorchRec calls it inside __init__; the fast sharder calls it once after
        seed = getattr(self, "_fastinit_seed", 0)
        prefix = f"{self._fastinit_fqn}." if getattr(self, "_fastinit_fqn", "") else ""
        for config, _ in self._fastinit_tables():
            if tables is not None and config.name not in tables:
                continue
            seeding.init_table_shards(
                config.init_fn,
                prefix + config.name,
                seed,
                (config.num_embeddings, config.embedding_dim),
                data_type_to_dtype(config.data_type),
                _trc.table_pieces(self, config.name),
            )
        self._fastinit_pending = (
            frozenset() if tables is None else self._fastinit_pending - frozenset(tables)
        )

    def _fastinit_initialise(self) -> None:
        """After construction: every table, or with :func:`tables_deferred` the data-parallel
        ones only, the others left pending."""
        device = getattr(self, "_device", None)
        if not _DEFER_TABLES.get() or (device is not None and device.type == "meta"):
            self.reset_parameters()
            return
        tables = self._fastinit_tables()
        replicated = [c.name for c, ps in tables if ps.sharding_type == "data_parallel"]
        self.reset_parameters(replicated)
        self._fastinit_pending = frozenset(c.name for c, _ in tables) - frozenset(replicated)


class FastShardedEmbeddingBagCollection(_FastStateMixin, ShardedEmbeddingBagCollection):
    """``ShardedEmbeddingBagCollection`` with sync-free data-parallel tables and seeded tables."""

    def _fastinit_configs(self) -> list[Any]:
        return list(self._embedding_bag_configs)

    def _create_lookups(self) -> None:
        for sharding in self._embedding_shardings:
            self._lookups.append(_kernels.create_lookup(sharding))

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # TorchRec's method, its ShardedTensors built locally (no per-shard rank-list scans)
        _kernels.ebc_initialize_torch_state(self, skip_registering)

    def init_data_parallel(self) -> None:
        # TorchRec's method (1.8.0 and 1.9), DDP without its init sync
        from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding

        if _skips_grad_sync(self):
            return
        types = _ebc_ddp_device_types()
        for i, (sharding, lookup) in enumerate(
            zip(self._embedding_shardings, self._lookups, strict=True)
        ):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                self._lookups[i] = _ddp_without_init_sync(lookup, self._env, self._device, types)

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
        # TorchRec's, its shardings grouping tables only for the ranks that hold them
        return _kernels.fast_classes().create_embedding_bag_sharding(
            cls, sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry
        )


class FastShardedEmbeddingCollection(_FastStateMixin, ShardedEmbeddingCollection):
    """``ShardedEmbeddingCollection`` with locally built ShardedTensor metadata, sync-free
    data-parallel tables and seeded tables."""

    def _fastinit_configs(self) -> list[Any]:
        return list(self._embedding_configs)

    def init_data_parallel(self) -> None:
        # TorchRec's method (1.8.0 and 1.9), DDP without its init sync; device_ids on CUDA only
        # (the EC's stock set, narrower than the EBC's)
        from torchrec.distributed.sharding.dp_sequence_sharding import (
            DpSequenceEmbeddingSharding,
        )

        if _skips_grad_sync(self):
            return
        types = frozenset({"cuda"})
        for index, (sharding, lookup) in enumerate(
            zip(self._sharding_type_to_sharding.values(), self._lookups, strict=True)
        ):
            if isinstance(sharding, DpSequenceEmbeddingSharding):
                self._lookups[index] = _ddp_without_init_sync(
                    lookup, self._env, self._device, types
                )

    def _create_lookups(self) -> None:
        # TorchRec's method (1.8.0), with fastinit's lookups
        for sharding in self._sharding_type_to_sharding.values():
            lookup = _kernels.create_lookup(sharding)
            if self.enable_embedding_update and sharding.enable_embedding_update:
                self._updates.append(sharding.create_update(lookup))
            self._lookups.append(lookup)

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        replaced = _kernels.replaced_at_run_time(
            ShardedEmbeddingCollection, "_initialize_torch_state"
        )
        if replaced is not None:  # a mock or monkeypatch in force: what stock would run
            replaced(self, skip_registering=skip_registering)
            return
        building = getattr(self, "_fastinit_building", False)
        self._fastinit_building = True  # TorchRec's method ends in reset_parameters: once, below
        try:
            _mirror_ec.ec_initialize_torch_state(
                self, skip_registering, super()._initialize_torch_state, _local.sharded_tensor
            )
        finally:
            self._fastinit_building = building
        self.reset_parameters()

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
        return _kernels.fast_classes().create_embedding_sharding(
            cls, sharding_type, sharding_infos, env, device, qcomm_codecs_registry
        )


def _construct(cls: Any, seed: int, module_fqn: str | None, **kwargs: Any) -> Any:
    """Build a fast sharded module: TorchRec's ``__init__`` under a scratch generator (what its
    kernels still draw never touches the global RNG) with the kernels' own initialisation of
    seeded tables skipped, then every table from its ``(seed, FQN)`` blocks, once."""
    sharded = cls.__new__(cls)
    sharded._fastinit_seed = seed
    sharded._fastinit_fqn = module_fqn or ""
    sharded._fastinit_building = True
    try:
        with (
            seeding.scratch_rng(seed, f"{module_fqn or ''}\0construct"),
            _kernels.tables_seeded_after(),
        ):
            sharded.__init__(module_fqn=module_fqn, **kwargs)
    finally:
        sharded._fastinit_building = False
    sharded._fastinit_initialise()
    return sharded


class _SeededSharder:
    """``seed`` seeds data-parallel (and sharded) table initialisation per table FQN; ``shard`` is
    the stock sharder's, building the fast sharded module (``sharded_module_type``)."""

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed

    def _module_kwargs(self) -> dict[str, Any]:
        """The sharded module's ``__init__`` arguments that only this kind of sharder passes."""
        return {}

    def shard(
        self,
        module: Any,
        params: dict[str, Any],
        env: Any,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        """The stock sharder's ``shard``, building the fast sharded module."""
        stock: Any = self  # the sharder this mixes into holds the stock settings
        return _construct(
            stock.sharded_module_type,
            self.seed,
            module_fqn,
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=stock.fused_params,
            device=device,
            qcomm_codecs_registry=stock.qcomm_codecs_registry,
            **self._module_kwargs(),
        )


class FastEmbeddingBagCollectionSharder(_SeededSharder, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose data-parallel tables need no start-up sync.

    Args:
        seed: seeds data-parallel (and sharded) table initialisation per table FQN.
        **kwargs: those of ``EmbeddingBagCollectionSharder``.
    """

    def _module_kwargs(self) -> dict[str, Any]:
        return {"sharded_module_order_overwrite": self._sharded_module_order_overwrite}

    @property
    def sharded_module_type(self) -> type[ShardedEmbeddingBagCollection]:
        """The fast sharded module's type."""
        return FastShardedEmbeddingBagCollection


class FastEmbeddingCollectionSharder(_SeededSharder, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` with local ShardedTensor metadata and sync-free DP tables.

    Args:
        seed: seeds data-parallel (and sharded) table initialisation per table FQN.
        **kwargs: those of ``EmbeddingCollectionSharder``.
    """

    def _module_kwargs(self) -> dict[str, Any]:
        return {"use_index_dedup": self._use_index_dedup}

    @property
    def sharded_module_type(self) -> type[ShardedEmbeddingCollection]:
        """The fast sharded module's type."""
        return FastShardedEmbeddingCollection


_FAST = {
    EmbeddingBagCollectionSharder: FastEmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder: FastEmbeddingCollectionSharder,
}
_INNER = ("_ebc_sharder", "_e_sharder", "_ec_sharder")


def _is_fast(sharder: Any) -> bool:
    return type(sharder) in _FAST or isinstance(sharder, _SeededSharder)


def _fast_copy(sharder: Any, seed: int) -> Any:
    if isinstance(sharder, _SeededSharder):  # already fast: a copy with this seed
        fast = copy.copy(sharder)
        fast.seed = seed
        return fast
    fast_type = _FAST.get(type(sharder))
    if fast_type is not None:
        fast = fast_type.__new__(fast_type)
        fast.__dict__.update(sharder.__dict__)  # the same settings: fused params, codecs, ...
        fast.seed = seed
        return fast
    # Composite sharders (feature-processed EBC, managed-collision EBC/EC) shard through an inner
    # EBC/EC sharder: make that one fast.
    inner = next((a for a in _INNER if _is_fast(getattr(sharder, a, None))), None)
    if inner is None:
        return sharder
    fast = copy.copy(sharder)
    setattr(fast, inner, _fast_copy(getattr(sharder, inner), seed))
    return fast


def fast_sharders(sharders: list[Any] | None, seed: int) -> list[Any]:
    """The fast equivalents of ``sharders`` (default: TorchRec's default sharders), seeded.

    A stock EBC/EC sharder becomes its fast subclass with the same settings (fused params, qcomm
    codecs, ...); a fast one is copied with ``seed``; composite sharders get a fast inner sharder
    (copied); any other sharder — the user's own subclass of a stock one included — is used as
    given. The given sharders are never changed.

    Args:
        sharders: the sharders, or None for TorchRec's defaults.
        seed: seeds the fast sharders' table initialisation (``setup`` passes the agreed seed).

    Returns:
        One sharder per given sharder, in order.
    """
    compat.require("sharders")
    if sharders is None:
        sharders = get_default_sharders()
    return [_fast_copy(s, seed) for s in sharders]
