"""Sharded-module construction in O(this rank's shards + tables), not O(tables × ranks).

Stock TorchRec builds, for every row-wise and data-parallel table, one ``ShardedEmbeddingTable``
per rank of the job and groups every rank's tables, although a rank's lookups use only its own;
it then validates every shard of every ``ShardedTensor`` against the group's rank list (a list of
N ranks built per shard: O(N²) per row-wise table), and the fused optimizer deep-copies every
table's global shard metadata.

Here:

* :class:`FastRwPooledEmbeddingSharding`, :class:`FastRwSequenceEmbeddingSharding`,
  :class:`FastDpPooledEmbeddingSharding`, :class:`FastDpSequenceEmbeddingSharding` are TorchRec's
  row-wise / data-parallel shardings that build this rank's tables and groups only; another
  rank's are built on demand (``_grouped_embedding_configs_per_rank[r]``), as stock would have
  them, if anything asks.
* A table's global shard metadata is one shared list per table whose deep copy shares its
  (immutable) ``ShardMetadata`` and which remembers what was already checked about it.
* :func:`fast_sharded_tensor` is ``ShardedTensor._init_from_local_shards_and_global_metadata``
  with the same checks and result: for a layout given by its runs (:class:`LazyShards`) in
  O(runs + local shards), the shard list left unbuilt; for a list, in O(shards) rather than
  O(shards × ranks), once per distinct layout. :mod:`fastinit.sharding.kernels` has TorchRec's
  kernels and fused optimizer call it (no class or global is patched).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torchrec.distributed.embedding_sharding import (
    EmbeddingSharding,
    EmbeddingShardingInfo,
    group_tables,
)
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType

from fastinit.sharding import _torchrec_modules as _trc
from fastinit.sharding import rules
from fastinit.sharding.layout import LazyShards, SharedShards, validate_runs

__all__ = [
    "FastRwPooledEmbeddingSharding",
    "FastRwSequenceEmbeddingSharding",
    "FastDpPooledEmbeddingSharding",
    "FastDpSequenceEmbeddingSharding",
    "embedding_bag_sharding",
    "embedding_sharding",
    "fast_sharded_tensor",
]


class _PerRank(Sequence[list[GroupedEmbeddingConfig]]):
    """Every rank's grouped tables: this rank's built, another's built when first asked for."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        own: list[GroupedEmbeddingConfig],
        build: Callable[[int], list[GroupedEmbeddingConfig]],
    ) -> None:
        self._built: dict[int, list[GroupedEmbeddingConfig]] = {rank: own}
        self._n = world_size
        self._build = build

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(index)
        got = self._built.get(i)
        if got is None:
            got = self._built[i] = self._build(i)
        return got


def _size(info: EmbeddingShardingInfo) -> torch.Size:
    config = info.embedding_config
    rows = (
        config.num_embeddings_post_pruning
        if config.num_embeddings_post_pruning is not None
        else config.num_embeddings
    )
    return torch.Size([rows, config.embedding_dim])


def _global_metadata(info: EmbeddingShardingInfo, cache: dict[int, Any]) -> ShardedTensorMetadata:
    got = cache.get(id(info))
    if got is None:
        spec = info.param_sharding.sharding_spec
        lazy = getattr(spec, "lazy_shards", None)
        shards = lazy() if lazy is not None else spec.shards
        if not isinstance(shards, LazyShards):
            checked = shards.checked if isinstance(shards, SharedShards) else None
            shards = SharedShards(shards, checked)
        got = cache[id(info)] = ShardedTensorMetadata(shards_metadata=shards, size=_size(info))
    return got


def _rw_tables(
    sharding: Any, infos: list[EmbeddingShardingInfo], rank: int, cache: dict[int, Any]
) -> list[ShardedEmbeddingTable]:
    """``BaseRwEmbeddingSharding._shard(infos)[rank]``, for one rank."""
    from torch.distributed._tensor.placement_types import Replicate, Shard
    from torchrec.distributed.embedding_types import DTensorMetadata

    tables = []
    for info in infos:
        config = info.embedding_config
        global_metadata = _global_metadata(info, cache)
        dtensor_metadata = None
        if sharding._env.output_dtensor:
            placements = (Replicate(), Shard(0)) if sharding._is_2D_parallel else (Shard(0),)
            dtensor_metadata = DTensorMetadata(
                mesh=sharding._env.device_mesh,
                placements=placements,
                size=tuple(_size(info)),
                stride=info.param.stride(),
            )
        local = global_metadata.shards_metadata[rank]
        tables.append(
            _table(
                info,
                local_rows=local.shard_sizes[0],
                local_cols=config.embedding_dim,
                local_metadata=local,
                global_metadata=global_metadata,
                dtensor_metadata=dtensor_metadata,
                num_embeddings_post_pruning=config.num_embeddings_post_pruning,
                total_num_buckets=config.total_num_buckets,
                use_virtual_table=config.use_virtual_table,
                virtual_table_eviction_policy=config.virtual_table_eviction_policy,
                enable_embedding_update=config.enable_embedding_update,
            )
        )
    return tables


def _dp_tables(infos: list[EmbeddingShardingInfo]) -> list[ShardedEmbeddingTable]:
    """``BaseDpEmbeddingSharding._shard(infos)[rank]`` (the same for every rank)."""
    return [
        _table(
            info,
            local_rows=info.param.size(0),
            local_cols=info.param.size(1),
            local_metadata=None,
            global_metadata=None,
        )
        for info in infos
    ]


def _table(info: EmbeddingShardingInfo, **fields: Any) -> ShardedEmbeddingTable:
    """The ``ShardedEmbeddingTable`` fields TorchRec's row-wise and data-parallel ``_shard``
    both set from the table config, plus ``fields`` (those that differ between them)."""
    config = info.embedding_config
    return ShardedEmbeddingTable(
        num_embeddings=config.num_embeddings,
        embedding_dim=config.embedding_dim,
        name=config.name,
        embedding_names=config.embedding_names,
        data_type=config.data_type,
        feature_names=config.feature_names,
        pooling=config.pooling,
        is_weighted=config.is_weighted,
        has_feature_processor=config.has_feature_processor,
        compute_kernel=EmbeddingComputeKernel(info.param_sharding.compute_kernel),
        weight_init_max=config.weight_init_max,
        weight_init_min=config.weight_init_min,
        fused_params=info.fused_params,
        stash_weights=config.stash_weights,
        **fields,
    )


class _OwnRankRw:
    """``BaseRwEmbeddingSharding.__init__`` (torchrec 1.8.0), building this rank's tables only."""

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        need_pos: bool = False,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        device_type_from_sharding_infos: str | tuple[str, ...] | None = None,
    ) -> None:
        from torchrec.distributed.types import ShardingEnv2D

        EmbeddingSharding.__init__(self, qcomm_codecs_registry=qcomm_codecs_registry)
        self._env = env
        self._is_2D_parallel = isinstance(env, ShardingEnv2D)
        self._pg = env.sharding_pg if self._is_2D_parallel else env.process_group
        self._world_size = env.world_size
        self._rank = env.rank
        self._device = device if device is not None else torch.device("cpu")
        self._device_type_from_sharding_infos = device_type_from_sharding_infos
        self._need_pos = need_pos
        cache: dict[int, Any] = {}
        own = group_tables([_rw_tables(self, sharding_infos, self._rank, cache)])[0]
        self._grouped_embedding_configs_per_rank = _PerRank(
            self._world_size,
            self._rank,
            own,
            lambda r: group_tables([_rw_tables(self, sharding_infos, r, cache)])[0],
        )
        self._grouped_embedding_configs = own
        self.enable_embedding_update = any(g.enable_embedding_update for g in own)
        self._has_feature_processor = any(g.has_feature_processor for g in own)


class _OwnRankDp:
    """``BaseDpEmbeddingSharding.__init__`` (torchrec 1.8.0), building this rank's tables only."""

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> None:
        EmbeddingSharding.__init__(self)
        self._env = env
        self._device = device
        self._rank = env.rank
        self._world_size = env.world_size
        own = group_tables([_dp_tables(sharding_infos)])[0]
        self._grouped_embedding_configs_per_rank = _PerRank(
            self._world_size,
            self._rank,
            own,
            lambda r: group_tables([_dp_tables(sharding_infos)])[0],
        )
        self._grouped_embedding_configs = own


class FastRwPooledEmbeddingSharding(_OwnRankRw, RwPooledEmbeddingSharding):
    """``RwPooledEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


class FastRwSequenceEmbeddingSharding(_OwnRankRw, RwSequenceEmbeddingSharding):
    """``RwSequenceEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


class FastDpPooledEmbeddingSharding(_OwnRankDp, DpPooledEmbeddingSharding):
    """``DpPooledEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


class FastDpSequenceEmbeddingSharding(_OwnRankDp, DpSequenceEmbeddingSharding):
    """``DpSequenceEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


def _plain_env(env: ShardingEnv) -> bool:
    from torchrec.distributed.types import ShardingEnv2D

    return not isinstance(env, ShardingEnv2D)


def embedding_bag_sharding(
    sharding_infos: list[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: torch.device | None,
    qcomm_codecs_registry: dict[str, Any] | None,
) -> Any:
    """The fast sharding for an EmbeddingBagCollection's ``sharding_infos``, or None where
    TorchRec's own is used (other sharding types, a meta device, a 2D environment)."""
    kind = sharding_infos[0].param_sharding.sharding_type
    if (device is not None and device.type == "meta") or not _plain_env(env):
        return None
    if kind == ShardingType.ROW_WISE.value:
        return FastRwPooledEmbeddingSharding(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
        )
    if kind == ShardingType.DATA_PARALLEL.value:
        return FastDpPooledEmbeddingSharding(sharding_infos, env, device)
    return None


def embedding_sharding(
    sharding_type: str,
    sharding_infos: list[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: torch.device | None,
    qcomm_codecs_registry: dict[str, Any] | None,
) -> Any:
    """The fast sharding for an EmbeddingCollection's ``sharding_infos``, or None."""
    if (device is not None and device.type == "meta") or not _plain_env(env):
        return None
    if sharding_type == ShardingType.ROW_WISE.value:
        return FastRwSequenceEmbeddingSharding(
            sharding_infos=sharding_infos,
            env=env,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
    if sharding_type == ShardingType.DATA_PARALLEL.value:
        return FastDpSequenceEmbeddingSharding(
            sharding_infos=sharding_infos, env=env, device=device
        )
    return None


# ---- ShardedTensor from local shards and global metadata, without O(ranks) per shard ----------


class _Checked:
    """What was established about one shard list (one layout): per (group, rank), the number
    of this rank's shards; per size, the inferred spec, after the overlap and bounds checks."""

    __slots__ = ("local", "specs")

    def __init__(self) -> None:
        self.local: dict[tuple[int, int], int] = {}
        self.specs: dict[Any, Any] = {}


_GROUP_RANKS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _group_ranks(pg: Any) -> frozenset[int] | None:
    """The group's global ranks as a set, once per group (a group's ranks never change)."""
    if _trc.rank_not_in_group(pg):
        return None
    try:
        got = _GROUP_RANKS.get(pg)
    except TypeError:  # not weakly referenceable
        return frozenset(dist.get_process_group_ranks(pg))
    if got is None:
        got = _GROUP_RANKS[pg] = frozenset(dist.get_process_group_ranks(pg))
    return got


def _count_local(shards: Sequence[Any], pg: Any, current: int) -> int | None:
    """This rank's shards among ``shards``, each placement checked against the group's ranks
    (a set built once, not a list per shard); None where a placement names an RPC worker."""
    ranks = _group_ranks(pg)
    n = 0
    for md in shards:
        p = md.placement
        if p is None:
            raise ValueError("remote device is None")
        if p.worker_name() is not None:
            return None
        r = p.rank()
        if ranks is not None and r is not None and r not in ranks:
            raise ValueError(
                f"Global rank {r} does not exist in input process group: {sorted(ranks)}"
            )
        if r == current:
            n += 1
    return n


def fast_sharded_tensor(
    local_shards: list[Any],
    sharded_tensor_metadata: ShardedTensorMetadata,
    process_group: Any = None,
    init_rrefs: bool = False,
    sharding_spec: Any = None,
) -> Any:
    """``ShardedTensor._init_from_local_shards_and_global_metadata`` with the same checks and
    result; the per-shard placement check uses a set of the group's ranks, and the layout checks
    (overlap, bounds, spec inference) run once per distinct shard list. ``NotImplemented`` where
    torch's own must run (RPC references, worker-named placements)."""
    if init_rrefs:
        return NotImplemented
    shards = sharded_tensor_metadata.shards_metadata
    if not shards:
        raise ValueError("shards_metadata must not be empty!")
    pg = _trc.normalize_pg(process_group)
    current = dist.get_rank()
    if isinstance(shards, LazyShards) and not shards.expanded:
        out = _on_rule(local_shards, sharded_tensor_metadata, shards, pg, current, sharding_spec)
        if out is not None:
            return out
    # What was established about a layout shared by tables is kept with it (a plan's layouts:
    # SharedShards, or a LazyShards whose list was built); a plain list is checked per call.
    checked: _Checked | None = None
    if isinstance(shards, SharedShards | LazyShards):
        checked = shards.checked.get("fastinit")
        if checked is None:
            checked = shards.checked["fastinit"] = _Checked()
    key_pg = (id(pg), current)
    n_local = checked.local.get(key_pg) if checked is not None else None
    if n_local is None:
        n_local = _count_local(shards, pg, current)
        if n_local is None:
            return NotImplemented
        if checked is not None:
            checked.local[key_pg] = n_local
    if len(local_shards) != n_local:
        raise RuntimeError(
            f"Number of local shards ({len(local_shards)}) does not match number of local "
            f"shards metadata in sharded_tensor_metadata ({n_local}) on rank ({current}) "
        )
    size_key = tuple(sharded_tensor_metadata.size)
    spec = sharding_spec
    cached_spec = checked.specs.get(size_key) if checked is not None else None
    if cached_spec is None:
        # A compact spec's layout was checked on its runs (overlap and bounds) for this size.
        on_rule = (
            isinstance(shards, SharedShards | LazyShards) and ("bounds", size_key) in shards.checked
        )
        inferred = _trc.validate_layout(shards, list(size_key), checks=not on_rule)
        if checked is not None:
            checked.specs[size_key] = inferred
        cached_spec = inferred
    if spec is None:
        spec = cached_spec
    built = None
    if checked is not None and sharding_spec is None:  # the spec is the one cached here
        built = checked.specs.setdefault(("built", size_key), {})
    return _trc.sharded_tensor_from_checked_layout(
        local_shards, sharded_tensor_metadata, spec, process_group, built
    )


def _group_facts(pg: Any) -> tuple[frozenset[int], int, int] | None:
    """The group's ranks, smallest and largest (None if this rank is not in it)."""
    ranks = _group_ranks(pg)
    return (ranks, min(ranks), max(ranks)) if ranks else None


def _on_rule(
    local_shards: list[Any],
    metadata: ShardedTensorMetadata,
    shards: LazyShards,
    pg: Any,
    current: int,
    sharding_spec: Any,
) -> Any:
    """:func:`fast_sharded_tensor` for a layout given by its runs, in O(runs + local shards):
    torch's checks, spec and metadata computed from the runs (:mod:`fastinit.sharding.rules`)
    and the shard list left unbuilt. None where the runs do not decide it (the caller checks the
    built list); ``NotImplemented`` where torch's own must run."""
    runs = shards.runs
    facts = shards.checked
    key = ("group", id(pg))
    if key not in facts:
        facts[key] = _group_facts(pg)
    group = facts[key]
    if group is not None:
        bad = rules.ranks_in(runs, *group)
        if bad is not None:
            raise ValueError(
                f"Global rank {bad} does not exist in input process group: {sorted(group[0])}"
            )
    n_local = rules.local_count(runs, current)
    if n_local is None:
        return NotImplemented
    if len(local_shards) != n_local:
        raise RuntimeError(
            f"Number of local shards ({len(local_shards)}) does not match number of local "
            f"shards metadata in sharded_tensor_metadata ({n_local}) on rank ({current}) "
        )
    size = tuple(metadata.size)
    if ("bounds", size) not in facts:
        try:
            validate_runs(runs, list(size), "shards")
        except ValueError:
            return None  # torch's own checks give torch's error
        facts[("bounds", size)] = True
    spec = sharding_spec
    if spec is None:
        spec = facts.get(("spec", size))
        if spec is None:
            spec = rules.infer_spec(shards)
            if spec is None:
                return None
            facts[("spec", size)] = spec
        held = metadata  # the inferred spec's own metadata has these shards (same values)
    else:
        held = None
    return _trc.sharded_tensor_from_checked_layout(local_shards, metadata, spec, pg, held=held)


# ---- the fused optimizer's state metadata, once per layout -------------------------------------


def _new_shard_metadata(offsets: list[int], sizes: list[int], placement: Any) -> Any:
    """A ``ShardMetadata`` of values taken from checked metadata (no re-validation)."""
    from torch.distributed._shard.metadata import ShardMetadata

    md = object.__new__(ShardMetadata)
    md.shard_offsets = offsets
    md.shard_sizes = sizes
    md.placement = placement
    return md


class _StateLayout:
    """One optimizer state's shard metadata for one table layout, and the table shard → state
    shard correspondence (by identity, then by value as TorchRec's dict would)."""

    __slots__ = ("ordered", "index", "shards", "size")

    def __init__(self, ordered: list[Any], shards: list[Any], size: torch.Size) -> None:
        self.ordered = ordered
        self.index = {id(md): i for i, md in enumerate(ordered)}
        self.shards = SharedShards(shards)
        self.size = size

    def of(self, md: Any) -> Any:
        i = self.index.get(id(md))
        if i is None or self.ordered[i] is not md:
            matches = [k for k, x in enumerate(self.ordered) if x == md]
            if not matches:
                raise KeyError(md)
            i = matches[-1]  # a dict keyed by value keeps the last of equal keys
        return self.shards[i]


class _RuledStateLayout:
    """One optimizer state's layout given by runs (:func:`rules.state_shards`): the table shard
    → state shard correspondence by index, the state's shards built when read."""

    __slots__ = ("table", "runs", "exp", "size")

    def __init__(self, table: LazyShards, runs: Any, size: torch.Size) -> None:
        from fastinit.sharding.layout import Expansions

        self.table = table
        self.runs = runs
        self.exp = Expansions()  # the states' ShardMetadata are their own, as TorchRec's are
        self.size = size

    def of(self, md: Any) -> Any:
        i = rules.index_of(self.table, md)
        if i is None:
            raise KeyError(md)
        return self.exp.shard_at(self.runs, i)


def _optimizer_state_metadata(
    kind: str,
    table_global_metadata: ShardedTensorMetadata,
    optimizer_state: torch.Tensor,
    sharding_dim: int,
    is_grid_sharded: bool,
) -> tuple[Any, ShardedTensorMetadata]:
    """``EmbeddingFusedOptimizer``'s ``get_optimizer_{single_value,rowwise,pointwise}_shard_
    metadata_and_global_metadata`` (torchrec 1.8.0), computed once per table layout (tables and
    optimizers whose global shard lists share a :class:`SharedShards` layout share the result)
    and without hashing every ``ShardMetadata``."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torchrec.distributed.comm import get_node_group_size

    shards = table_global_metadata.shards_metadata
    grid_nodes = 1
    if kind == "rowwise" and is_grid_sharded:
        grid_nodes = len(shards) // get_node_group_size()
    key = (
        "optimizer",
        kind,
        sharding_dim,
        is_grid_sharded,
        grid_nodes,
        tuple(table_global_metadata.size),
    )
    properties = TensorProperties(
        dtype=optimizer_state.dtype, layout=optimizer_state.layout, requires_grad=False
    )
    if isinstance(shards, LazyShards) and not shards.expanded:
        ruled = shards.checked.get(key)
        if ruled is None:
            got_runs = rules.state_shards(shards, kind, sharding_dim, is_grid_sharded, grid_nodes)
            if got_runs is not None:
                runs, first = got_runs
                size = table_global_metadata.size
                if kind == "single":
                    size = torch.Size([first])
                elif kind == "rowwise":
                    size = torch.Size([size[0] * first])
                ruled = shards.checked[key] = _RuledStateLayout(shards, runs, size)
        if ruled is not None:
            return ruled, ShardedTensorMetadata(
                shards_metadata=LazyShards(ruled.runs, ruled.exp),  # type: ignore[arg-type]
                size=ruled.size,
                tensor_properties=properties,
            )
    checked = shards.checked if isinstance(shards, (SharedShards, LazyShards)) else None
    got: _StateLayout | None = checked.get(key) if checked is not None else None
    if got is None:
        ordered = list(shards)
        if kind == "single":
            states = [_new_shard_metadata([i], [1], md.placement) for i, md in enumerate(ordered)]
            size = torch.Size([len(ordered)])
        elif kind == "rowwise":
            if sharding_dim == 1:
                ordered.sort(key=lambda s: s.shard_offsets[1])
            states = []
            rolling = 0
            for idx, md in enumerate(ordered):
                offset = md.shard_offsets[0]
                if is_grid_sharded:
                    offset = rolling
                    rolling += md.shard_sizes[0]
                elif sharding_dim == 1:
                    offset = idx * md.shard_sizes[0]
                states.append(_new_shard_metadata([offset], [md.shard_sizes[0]], md.placement))
            rw = len(ordered) if sharding_dim == 1 and not is_grid_sharded else 1
            size = torch.Size([table_global_metadata.size[0] * rw * grid_nodes])
        else:
            states = [
                _new_shard_metadata(md.shard_offsets, md.shard_sizes, md.placement)
                for md in ordered
            ]
            size = table_global_metadata.size
        got = _StateLayout(ordered, states, size)
        if checked is not None:
            checked[key] = got
    metadata = ShardedTensorMetadata(
        shards_metadata=SharedShards(got.shards, got.shards.checked),
        size=got.size,
        tensor_properties=properties,
    )
    return got, metadata


# torch's own constructor, as this module found it: fast_sharded_tensor stands for it only.
_TORCH_INIT = ShardedTensor.__dict__.get("_init_from_local_shards_and_global_metadata")


def sharded_tensor(*args: Any, **kwargs: Any) -> Any:
    """``ShardedTensor._init_from_local_shards_and_global_metadata(*args, **kwargs)``:
    :func:`fast_sharded_tensor`, or torch's own where that declines (RPC references,
    worker-named placements) or where torch's has been replaced since (a wrapper or a fault
    injection, as in TorchRec's own tests: whatever it does or raises is what happens, and
    TorchRec 1.9's ``_initialize_torch_state`` names the table in the error as it does stock)."""
    if ShardedTensor.__dict__.get("_init_from_local_shards_and_global_metadata") is not _TORCH_INIT:
        return ShardedTensor._init_from_local_shards_and_global_metadata(*args, **kwargs)
    out = fast_sharded_tensor(*args, **kwargs)
    if out is NotImplemented:
        out = ShardedTensor._init_from_local_shards_and_global_metadata(*args, **kwargs)
    return out


def _own_properties(metadata: Any, copy: Any) -> Any:
    """What TorchRec's ``copy.deepcopy`` of a table's global metadata is for (tensor properties
    of its own, which this optimizer sets), without building a rule-given layout's shards: the
    copy shares them, as a deep copy of a :class:`SharedShards` list does."""
    shards = metadata.shards_metadata
    if isinstance(shards, LazyShards) and not shards.expanded:
        return ShardedTensorMetadata(
            shards_metadata=LazyShards(shards.runs, shards._exp),  # type: ignore[arg-type]
            size=metadata.size,
            tensor_properties=copy.deepcopy(metadata.tensor_properties),
        )
    return copy.deepcopy(metadata)


def fused_optimizer_init(
    self: Any,
    config: GroupedEmbeddingConfig,
    emb_module: Any,
    pg: Any,
    create_for_table: str | None,
    param_weight_for_table: Any,
    embedding_weights_by_table: list[torch.Tensor] | None,
    all_optimizer_states: list[dict[str, torch.Tensor]] | None,
) -> None:
    """The body of ``EmbeddingFusedOptimizer.__init__`` (torchrec 1.8.0) without DTensor state,
    its ShardedTensors built by :func:`fast_sharded_tensor` and its state metadata by
    :func:`_optimizer_state_metadata`."""
    import copy
    import itertools

    from torch.distributed._shard.sharded_tensor import Shard
    from torchrec.optim.fused import FusedOptimizer

    self._emb_module = emb_module
    self._pg = pg
    state: dict[Any, Any] = {}
    param_group: dict[str, Any] = {"params": [], "lr": emb_module.get_learning_rate()}
    params: dict[str, Any] = {}
    shard_params: dict[str, dict[str, list[Any]]] = {}
    embedding_weights_by_table = embedding_weights_by_table or emb_module.split_embedding_weights()
    all_optimizer_states = all_optimizer_states or emb_module.get_optimizer_state()
    state_keys: dict[str, list[str]] = {}
    for table_config, optimizer_states, weight in itertools.zip_longest(
        config.embedding_tables, all_optimizer_states, embedding_weights_by_table
    ):
        if create_for_table is not None and create_for_table != table_config.name:
            continue
        sp = shard_params.setdefault(
            table_config.name, {"optimizer_states": [], "local_metadata": [], "weights": []}
        )
        values = None
        if optimizer_states:
            values = tuple(optimizer_states.values())
            for value in values:
                assert table_config.local_rows == value.size(0) or value.nelement() == 1
            state_keys[table_config.name] = list(optimizer_states.keys())
        sp["optimizer_states"].append(values)
        sp["local_metadata"].append(table_config.local_metadata)
        sp["weights"].append(weight)

    seen: set[str] = set()
    for table_config in config.embedding_tables:
        if create_for_table is not None and create_for_table != table_config.name:
            continue
        if table_config.name in seen:
            continue
        seen.add(table_config.name)
        global_metadata = _own_properties(table_config.global_metadata, copy)
        sp = shard_params[table_config.name]
        assert global_metadata is not None
        if create_for_table is None:
            local_weight_shards = []
            for local_weight, local_metadata in zip(
                sp["weights"], sp["local_metadata"], strict=False
            ):
                local_weight_shards.append(Shard(local_weight, local_metadata))
                global_metadata.tensor_properties.dtype = local_weight.dtype
                global_metadata.tensor_properties.requires_grad = local_weight.requires_grad
            weight = sharded_tensor(local_weight_shards, global_metadata, self._pg)
            param_key = table_config.name + ".weight"
        else:
            assert param_weight_for_table is not None, (
                "param_weight_for_table cannot be None when using create_for_table"
            )
            weight = param_weight_for_table
            param_key = ""
        state[weight] = {}
        param_group["params"].append(weight)
        params[param_key] = weight

        sharding_dim = 1 if table_config.local_cols != table_config.embedding_dim else 0
        is_grid = (
            table_config.local_cols != table_config.embedding_dim
            and table_config.local_rows != table_config.num_embeddings
        )
        if not all(s is not None for s in sp["optimizer_states"]):
            continue

        def sharded_state(
            momentum_idx: int,
            state_key: str,
            table_config: Any = table_config,
            sharding_dim: int = sharding_dim,
            is_grid: bool = is_grid,
        ) -> Any:
            sp = shard_params[table_config.name]
            states, local_mds = sp["optimizer_states"], sp["local_metadata"]
            optim_state = states[0][momentum_idx - 1]
            if optim_state.nelement() == 1 and state_key != "momentum1":
                kind = "single"
            elif optim_state.dim() == 1:
                kind = "rowwise"
            else:
                kind = "pointwise"
            layout, metadata = _optimizer_state_metadata(
                kind, table_config.global_metadata, optim_state, sharding_dim, is_grid
            )
            local_shards = [
                Shard(s[momentum_idx - 1], layout.of(md))
                for s, md in zip(states, local_mds, strict=False)
            ]
            return sharded_tensor(local_shards, metadata, self._pg)

        num_states = min(len(s) for s in sp["optimizer_states"])
        keys = state_keys[table_config.name] if num_states > 0 else []
        for idx in range(num_states):
            key = "momentum1" if idx == 0 else keys[idx]
            state[weight][f"{table_config.name}.{key}"] = sharded_state(idx + 1, key)

    FusedOptimizer.__init__(self, params, state, [param_group])
