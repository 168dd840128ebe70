"""Every touch of a private TorchRec name made by ``fastinit.sharding``, in one place.

Each section names the TorchRec version it was written against. When TorchRec is upgraded, read the
upstream source of the names a section touches before bumping its pin.
"""

from __future__ import annotations

# =================================================================================================
# Section: planner (fastinit.sharding.planner.FastPlanner) -- written against torchrec 1.8.0.
#
# Touches:
#   torchrec.distributed.planner.enumerators: EmbeddingEnumerator.enumerate (ported, see
#       FastEnumerator), _extract_constraints_for_param, _get_tower_index, and the attributes
#       _sharder_map, _sharder_data_map, _last_stored_{module,sharders,search_space}, _constraints,
#       _compute_device, _world_size, _local_world_size, _device_memory_sizes, _batch_size,
#       _use_exact_enumerate_order; EmbeddingEnumerator._get_num_buckets (ported for
#       EmbeddingBagCollection / EmbeddingCollection: embedding_bag_configs() / embedding_configs(),
#       use_virtual_table, total_num_buckets; other modules call it), populate_estimates.
#   torchrec.distributed.planner.estimator.estimator: EmbeddingPerfEstimator.estimate (ported, see
#       MemoPerfEstimator), get_embedding_perf_sharding_evaluator, the factory's _registry, the
#       estimator's _topology/_constraints/_config/_is_inference/_use_* attributes; the default
#       config is instantiated from a subclass with a cached __dir__ (see _with_cached_dir), which
#       relies on annotations._get_annotated_method/_get_coefficient_method scanning dir(config).
#   torchrec.distributed.planner.estimator.types: ShardPerfContext.build_shard_perf_contexts;
#       HardwarePerfConfig.post_process_perfs (the described path needs the base, identity one).
#   torchrec.distributed.planner.shard_estimators: EmbeddingStorageEstimator.estimate (ported, see
#       MemoStorageEstimator), calculate_shard_storages, get_num_poolings.
#   torchrec.distributed.planner.proposers: GreedyProposer._threshold,
#       ._best_perf_rating, ._num_inferior_perf, ._use_depth; UniformProposer._use_depth;
#       GridSearchProposer._max_proposals.
#   torchrec.distributed.planner.partitioners: GreedyPerfPartitioner._sort_by, ._balance_modules.
#   torchrec.distributed.planner.storage_reservations: HeuristicalStorageReservation._percentage,
#       ._dense_storage, ._kjt_storage; FixedAbsoluteStorageReservation._hbm_reserved_bytes
#       (only to build the same "no plan" message as the stock planner).
#   torchrec.distributed.planner.perf_models: NoopPerfModel._topology.
#   Dataclasses Shard, Storage, Perf, ShardingOption are built via object.__new__ + __dict__ (their
#       1.8.0 fields, in declaration order); a ShardingOption may hold shards=[] until
#       CompactOption.materialise builds them.
# =================================================================================================
import copy
import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR
from torchrec.distributed.planner.enumerators import (
    EmbeddingEnumerator,
    _extract_constraints_for_param,
    _get_tower_index,
    get_partition_by_type,
)
from torchrec.distributed.planner.estimator.estimator import (
    EmbeddingPerfEstimator,
    EmbeddingPerfEstimatorFactory,
    get_embedding_perf_sharding_evaluator,
)
from torchrec.distributed.planner.estimator.types import HardwarePerfConfig, ShardPerfContext
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingStorageEstimator,
    calculate_shard_storages,
    get_num_poolings,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    Shard,
    SharderDataMap,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.types import KeyValueParams, ModuleSharder, ShardingType
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_tower import (
    EmbeddingTower,
    EmbeddingTowerCollection,
)

PLANNER_TORCHREC_VERSION = "1.8.0"  # the torchrec version this section was written against

logger: logging.Logger = logging.getLogger(__name__)


def greedy_proposer_state(proposer: Any) -> tuple[bool, int | None, float, int]:
    """The settings and carried-over state of a stock ``GreedyProposer``.

    Args:
        proposer: a ``torchrec.distributed.planner.proposers.GreedyProposer``.

    Returns:
        ``(use_depth, threshold, best_perf_rating, num_inferior_perf)``.
    """
    return (
        proposer._use_depth,
        proposer._threshold,
        proposer._best_perf_rating,
        proposer._num_inferior_perf,
    )


def set_greedy_proposer_state(proposer: Any, best_perf_rating: float, num_inferior: int) -> None:
    """Write back the state a stock ``GreedyProposer`` carries from one ``plan()`` to the next.

    Args:
        proposer: a ``GreedyProposer``.
        best_perf_rating: its ``_best_perf_rating`` after the search.
        num_inferior: its ``_num_inferior_perf`` after the search.
    """
    proposer._best_perf_rating = best_perf_rating
    proposer._num_inferior_perf = num_inferior


def uniform_proposer_use_depth(proposer: Any) -> bool:
    """``UniformProposer._use_depth``."""
    return bool(proposer._use_depth)


def grid_max_proposals(proposer: Any) -> int:
    """``GridSearchProposer._max_proposals``."""
    return int(proposer._max_proposals)


def partitioner_settings(partitioner: Any) -> tuple[str, bool]:
    """``(sort_by.value, balance_modules)`` of a stock ``GreedyPerfPartitioner``."""
    return partitioner._sort_by.value, bool(partitioner._balance_modules)


def perf_model_world_size(perf_model: Any) -> int:
    """``NoopPerfModel._topology.world_size`` (the length of its per-rank perf list)."""
    return int(perf_model._topology.world_size)


def reservation_percentage(reservation: Any) -> Any:
    """``reservation._percentage``; raises ``AttributeError`` where absent, as the stock message does."""
    return reservation._percentage


def storage_reservation_details(reservation: Any) -> dict[str, Any]:
    """The private fields of a storage reservation that the stock "no plan" message prints.

    Args:
        reservation: the planner's storage reservation.

    Returns:
        ``percentage``, ``dense_storage``, ``kjt_storage``, ``hbm_reserved_bytes`` (None if absent).
    """
    return {
        "percentage": getattr(reservation, "_percentage", None),
        "dense_storage": getattr(reservation, "_dense_storage", None),
        "kjt_storage": getattr(reservation, "_kjt_storage", None),
        "hbm_reserved_bytes": getattr(reservation, "_hbm_reserved_bytes", None),
    }


#: Device types a TorchRec planner might know; which it does is asked of the installed Topology.
_DEVICE_CANDIDATES = ("cpu", "cuda", "mtia", "tpu", "xpu", "hpu", "mps", "meta")


@functools.cache
def topology_compute_devices() -> frozenset[str]:
    """The ``compute_device`` values the installed TorchRec's ``Topology`` accepts (cpu, cuda,
    mtia in 1.8.0; tpu too in 1.9), found by building a one-rank topology for each."""
    quiet = logging.getLogger("torchrec.distributed.planner.types")
    hush = _DropAll()
    quiet.addFilter(hush)  # 1.9 warns about every Topology built directly
    out = set()
    try:
        for device in _DEVICE_CANDIDATES:
            try:
                Topology(world_size=1, local_world_size=1, compute_device=device)
            except (AssertionError, ValueError):
                continue
            out.add(device)
    finally:
        quiet.removeFilter(hush)
    return frozenset(out)


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def sku_aware_reservation_class() -> type | None:
    """torchrec 1.9's ``SKUAwareStorageReservation`` (None where the installed one has none)."""
    from torchrec.distributed.planner import storage_reservations

    return getattr(storage_reservations, "SKUAwareStorageReservation", None)


def sku_aware_reservation_details(reservation: Any) -> dict[str, Any]:
    """The private fields of a ``SKUAwareStorageReservation`` the 1.9 "no plan" message prints."""
    return {
        "model_base_bytes": reservation._model_base_bytes,
        "margin_bytes": getattr(reservation, "_margin_bytes", None),
        "runtime_overhead_bytes": reservation._runtime_overhead_bytes,
    }


# ---- deep copies of sharding options, without copy.deepcopy's per-object overhead --------------


def _copy_storage(s: Any, memo: dict[int, Any]) -> Any:
    if s is None:
        return None
    hit = memo.get(id(s))
    if hit is not None:
        return hit
    if type(s) is Storage and len(s.__dict__) == 3:
        new = Storage(hbm=s.hbm, ddr=s.ddr, ssd=s.ssd)
        memo[id(s)] = new
        return new
    return copy.deepcopy(s, memo)


def _copy_perf(p: Any, memo: dict[int, Any]) -> Any:
    if p is None:
        return None
    hit = memo.get(id(p))
    if hit is not None:
        return hit
    if type(p) is Perf and len(p.__dict__) == 6:
        new = Perf(
            fwd_compute=p.fwd_compute,
            fwd_comms=p.fwd_comms,
            bwd_compute=p.bwd_compute,
            bwd_comms=p.bwd_comms,
            input_dist_comms=p.input_dist_comms,
            prefetch_compute=p.prefetch_compute,
        )
        memo[id(p)] = new
        return new
    return copy.deepcopy(p, memo)


def _is_int_list(x: Any) -> bool:
    return type(x) is list and all(type(v) is int for v in x)


def _copy_shards(shards: Any, memo: dict[int, Any]) -> Any:
    if type(shards) is not list:
        return copy.deepcopy(shards, memo)
    out = []
    for s in shards:
        if (
            type(s) is Shard
            and len(s.__dict__) == 5
            and _is_int_list(s.size)
            and _is_int_list(s.offset)
            and (s.rank is None or type(s.rank) is int)
            and id(s) not in memo
        ):
            new = Shard(
                size=list(s.size),
                offset=list(s.offset),
                storage=_copy_storage(s.storage, memo),
                perf=_copy_perf(s.perf, memo),
                rank=s.rank,
            )
            memo[id(s)] = new
            out.append(new)
        else:
            out.append(copy.deepcopy(s, memo))
    return out


def copy_sharding_options(options: Sequence[ShardingOption]) -> list[ShardingOption]:
    """What ``copy.deepcopy(list(options))`` returns, built several times faster.

    ``ShardingOption.__deepcopy__`` (1.8.0) shares ``_tensor`` and ``_module`` and deep-copies every
    other attribute. This does the same, with one memo for the whole list (as ``deepcopy`` of a list
    does); shards, ``Storage`` and ``Perf`` of the stock types are rebuilt directly, anything else
    goes through ``copy.deepcopy``.

    Args:
        options: sharding options.

    Returns:
        Independent copies, in the same order.
    """
    memo: dict[int, Any] = {}
    out: list[ShardingOption] = []
    for so in options:
        if type(so) is not ShardingOption or id(so) in memo:
            out.append(copy.deepcopy(so, memo))
            continue
        new = object.__new__(ShardingOption)
        for k, v in so.__dict__.items():
            if k in ("_tensor", "_module"):
                setattr(new, k, v)
            elif k == "shards":
                setattr(new, k, _copy_shards(v, memo))
            else:
                setattr(new, k, copy.deepcopy(v, memo))
        memo[id(so)] = new
        out.append(new)
    return out


# ---- estimators that compute each distinct shard once -------------------------------------------


def _freeze(v: Any) -> Hashable:
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    hash(v)  # raises TypeError for unhashable values: the caller then skips the memo
    return v


def _perf_fields(p: Perf) -> tuple[float, ...]:
    return (
        p.fwd_compute,
        p.fwd_comms,
        p.bwd_compute,
        p.bwd_comms,
        p.input_dist_comms,
        p.prefetch_compute,
    )


_new = object.__new__


def _perf_from_fields(f: tuple[float, ...]) -> Perf:
    """``Perf(*fields)``, built without the dataclass ``__init__`` (same attributes, same order)."""
    p = _new(Perf)
    p.__dict__ = {
        "fwd_compute": f[0],
        "fwd_comms": f[1],
        "bwd_compute": f[2],
        "bwd_comms": f[3],
        "input_dist_comms": f[4],
        "prefetch_compute": f[5],
    }
    return p


def _new_storage(hbm: Any, ddr: Any, ssd: Any) -> Storage:
    """``Storage(hbm, ddr, ssd)``, built without the dataclass ``__init__``."""
    st = _new(Storage)
    st.__dict__ = {"hbm": hbm, "ddr": ddr, "ssd": ssd}
    return st


def _new_shard(size: list[int], offset: list[int]) -> Shard:
    """``Shard(size=size, offset=offset)``, built without the dataclass ``__init__``."""
    sh = _new(Shard)
    sh.__dict__ = {"size": size, "offset": offset, "storage": None, "perf": None, "rank": None}
    return sh


class CompactUnsupported(Exception):
    """An estimator result the compact search space cannot hold (the full one is built instead)."""


class CompactOption:
    """A ``ShardingOption`` whose shards are described by their distinct values, built on demand.

    A data-parallel option has one shard per rank, all alike: at thousands of ranks and tables,
    building a ``Shard``, a ``Storage`` and a ``Perf`` object per shard costs tens of millions of
    objects that the search never needs (it reads the distinct values and how often they occur).
    Here the option's ``shards`` list stays empty until ``materialise`` builds it, exactly as the
    stock enumerator and estimators would have (one ``Shard``/``Storage``/``Perf`` per shard).

    Attributes:
        so: the sharding option (``shards`` empty until materialised).
        n: the number of shards.
        sizes: the shard sizes, per shard; one entry when every shard has the same size and
            offset (``replicated``).
        offsets: the shard offsets, likewise.
        replicated: every shard has the same size and offset (data parallel).
        st: the distinct ``(hbm, ddr, ssd)`` storages.
        st_pos: per shard, its index in ``st``; None when every shard has ``st[0]``.
        pf: the distinct ``Perf`` fields (``_perf_fields`` order).
        pf_pos: per shard, its index in ``pf``; None when every shard has ``pf[0]``.
    """

    __slots__ = ("so", "n", "sizes", "offsets", "replicated", "st", "st_pos", "pf", "pf_pos")

    def __init__(
        self,
        so: ShardingOption,
        sizes: list[list[int]],
        offsets: list[list[int]],
    ) -> None:
        self.so = so
        n = len(sizes)
        self.n = n
        self.replicated = n > 1 and sizes.count(sizes[0]) == n and offsets.count(offsets[0]) == n
        self.sizes = sizes[:1] if self.replicated else sizes
        self.offsets = offsets[:1] if self.replicated else offsets
        self.st: list[tuple[int, int, int]] = []
        self.st_pos: list[int] | None = None
        self.pf: list[tuple[float, ...]] = []
        self.pf_pos: list[int] | None = None

    @classmethod
    def from_option(cls, so: ShardingOption) -> CompactOption:
        """Describe an option whose shards are built and estimated (any estimator's types)."""
        shards = so.shards
        c = cls(so, [s.size for s in shards], [s.offset for s in shards])
        storages = [s.storage for s in shards]
        perfs = [s.perf for s in shards]
        if set(map(type, storages)) != {Storage} or set(map(type, perfs)) != {Perf}:
            raise CompactUnsupported("shard without a stock Storage or Perf estimate")
        c.st, c.st_pos = _distinct([(x.hbm, x.ddr, x.ssd) for x in storages])
        c.pf, c.pf_pos = _distinct([_perf_fields(x) for x in perfs])
        return c

    def shard_sizes(self) -> list[list[int]]:
        """Every shard's size, as ``calculate_shard_sizes_and_offsets`` returned them."""
        return self.sizes * self.n if self.replicated else self.sizes

    def materialise(self) -> ShardingOption:
        """Build ``so.shards`` (once) and return ``so``."""
        so = self.so
        if so.shards or not self.n:
            return so
        n = self.n
        if self.replicated:
            sizes = self.sizes * n
            offsets = self.offsets * n
        else:
            sizes, offsets = self.sizes, self.offsets
        st_pos = self.st_pos if self.st_pos is not None else [0] * n
        pf_pos = self.pf_pos if self.pf_pos is not None else [0] * n
        st, pf = self.st, self.pf
        shards = []
        for size, offset, a, b in zip(sizes, offsets, st_pos, pf_pos):
            sh = _new_shard(size, offset)
            sh.storage = _new_storage(*st[a])
            sh.perf = _perf_from_fields(pf[b])
            shards.append(sh)
        so.shards = shards
        return so


def _distinct(values: list[Any]) -> tuple[list[Any], list[int] | None]:
    """``(distinct values in first-seen order, per value its index)``; None: all the first."""
    if not values:
        return [], None
    if values.count(values[0]) == len(values):
        return values[:1], None
    index: dict[Any, int] = {}
    out: list[Any] = []
    pos = []
    for v in values:
        k = index.get(v)
        if k is None:
            k = index[v] = len(out)
            out.append(v)
        pos.append(k)
    return out, pos


def _is_identity_post_process(config: Any) -> bool:
    """The config's ``post_process_perfs`` is the base one, which returns the perfs unchanged."""
    return (
        getattr(type(config), "post_process_perfs", None) is HardwarePerfConfig.post_process_perfs
    )


class MemoPerfEstimator(EmbeddingPerfEstimator):
    """``EmbeddingPerfEstimator`` (1.8.0) that evaluates each distinct shard context once.

    The stock ``estimate`` builds one ``ShardPerfContext`` per shard and runs the evaluator on each;
    a context depends only on the shard's ``[rows, cols]`` and on per-option data, and the evaluator
    is a pure function of ``(context, config)``. So contexts are built for the distinct shard sizes
    of an option only, and evaluator results are memoised by context value within one ``estimate``
    call (across options and tables). Every shard still gets its own ``Perf`` object, and the
    config's ``post_process_perfs`` still sees every shard. The context's ``table_name`` is left out
    of the memo key only for TorchRec's own configs, which never read it.
    """

    def _memo_fields(self) -> list[str]:
        skip_name = type(self._config).__module__.startswith("torchrec.")
        return [
            f.name
            for f in dataclasses.fields(ShardPerfContext)
            if not (skip_name and f.name == "table_name")
        ]

    def _distinct_perfs(
        self,
        sharding_option: ShardingOption,
        distinct: list[list[int]],
        sharder_data_map: SharderDataMap,
        memo: dict[Hashable, tuple[float, ...]],
        field_names: list[str],
    ) -> tuple[list[tuple[float, ...]], bool]:
        """The perf fields of each distinct shard size; sets ``is_weighted`` as stock does.

        Returns:
            ``(fields per distinct size, has_feature_processor)``.
        """
        config = self._config
        config.validate_sharding_type(sharding_option.sharding_type)
        sharder_data = sharder_data_map[sharding_option.module_type_key]
        contexts = ShardPerfContext.build_shard_perf_contexts(
            config=config,
            shard_sizes=distinct,
            sharding_option=sharding_option,
            topology=self._topology,
            constraints=self._constraints,
            sharder_data=sharder_data,
            is_inference=self._is_inference,
            use_batch_inputs_for_expected_cache_fetches=self._use_batch_inputs_for_expected_cache_fetches,
            use_linear_regression_prefetch_estimate=self._use_linear_regression_prefetch_estimate,
        )
        has_fp = False
        if contexts:
            sharding_option.is_weighted = contexts[0].is_weighted
            has_fp = bool(contexts[0].has_feature_processor)
        perfs: list[tuple[float, ...]] = []
        for ctx in contexts:
            values = ctx.__dict__
            ctx_key: Hashable | None = tuple(
                tuple(v) if type(v) is list else v for v in map(values.get, field_names)
            )
            try:
                fields = memo.get(ctx_key)
            except TypeError:  # an unhashable value: no memo for this context
                ctx_key = fields = None
            if fields is None:
                evaluator = get_embedding_perf_sharding_evaluator(
                    sharding_type=ctx.sharding_type, is_inference=ctx.is_inference
                )
                fields = _perf_fields(evaluator.compute_perf(ctx=ctx, config=config))
                if ctx_key is not None:
                    memo[ctx_key] = fields
            perfs.append(fields)
        return perfs, has_fp

    def estimate(
        self,
        sharding_options: list[ShardingOption],
        sharder_data_map: SharderDataMap,
    ) -> None:
        """Same result as ``EmbeddingPerfEstimator.estimate``; see the class docstring."""
        assert self._topology is not None, "Topology must be set to use estimate method"
        config = self._config
        field_names = self._memo_fields()
        memo: dict[Hashable, tuple[float, ...]] = {}
        num_feature_processors = 0
        for sharding_option in sharding_options:
            shard_sizes = [shard.size for shard in sharding_option.shards]
            distinct, positions = _distinct_sizes(shard_sizes)
            perfs, has_fp = self._distinct_perfs(
                sharding_option, distinct, sharder_data_map, memo, field_names
            )
            num_feature_processors += has_fp
            if len(perfs) == 1:
                only = perfs[0]
                for shard in sharding_option.shards:
                    shard.perf = _perf_from_fields(only)
            else:
                for shard, pos in zip(sharding_option.shards, positions):
                    shard.perf = _perf_from_fields(perfs[pos])
            shard_perfs = [s.perf for s in sharding_option.shards if s.perf is not None]
            shard_perfs = config.post_process_perfs(
                shard_perfs=shard_perfs,
                shard_sizes=shard_sizes,
                sharding_type=sharding_option.sharding_type,
                uneven_sharding_perf_multiplier=self._topology.uneven_sharding_perf_multiplier,
            )
            for shard, perf in zip(sharding_option.shards, shard_perfs):
                shard.perf = perf
        logger.info(f"Total {num_feature_processors} feature processor.")

    def estimate_compact(
        self, options: list[CompactOption], sharder_data_map: SharderDataMap
    ) -> None:
        """``estimate`` on described shards: fills ``pf``/``pf_pos`` of each option.

        Raises:
            CompactUnsupported: the config post-processes perfs (it must see every shard).
        """
        assert self._topology is not None, "Topology must be set to use estimate method"
        if not _is_identity_post_process(self._config):
            raise CompactUnsupported("perf config with post_process_perfs")
        field_names = self._memo_fields()
        memo: dict[Hashable, tuple[float, ...]] = {}
        num_feature_processors = 0
        for c in options:
            if c.replicated:
                distinct, positions = c.sizes, None
            else:
                distinct, positions = _distinct_sizes(c.sizes)
            perfs, has_fp = self._distinct_perfs(
                c.so, distinct, sharder_data_map, memo, field_names
            )
            num_feature_processors += has_fp
            if positions is None or len(perfs) == 1:
                c.pf, c.pf_pos = perfs[:1], None
            else:
                c.pf, c.pf_pos = _distinct([perfs[p] for p in positions])
        logger.info(f"Total {num_feature_processors} feature processor.")


def _distinct_sizes(shard_sizes: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct shard sizes (first-seen order) and, per shard, the index of its size."""
    if shard_sizes and shard_sizes.count(shard_sizes[0]) == len(shard_sizes):
        return shard_sizes[:1], [0] * len(shard_sizes)
    index_of: dict[tuple[int, ...], int] = {}
    distinct: list[list[int]] = []
    positions: list[int] = []
    for size in shard_sizes:
        key = tuple(size)
        pos = index_of.get(key)
        if pos is None:
            pos = index_of[key] = len(distinct)
            distinct.append(size)
        positions.append(pos)
    return distinct, positions


def _tensor_key(tensor: torch.Tensor) -> Hashable:
    return (
        type(tensor),
        tuple(tensor.shape),
        tensor.dtype,
        getattr(tensor, "_optimizer_classes", [None])[0],
    )


def _storage_key(kwargs: dict[str, Any]) -> Hashable | None:
    """A hashable key of ``calculate_shard_storages``' arguments (None: some value is unhashable).

    Values are compared by value, except ``sharder_data`` (by identity: one per sharder) and the
    tensor (by type, shape, dtype and optimizer class). Lists of scalars, the common case, become
    tuples directly; anything else goes through ``_freeze``.
    """
    parts: list[Any] = []
    try:
        for name, v in kwargs.items():
            if name == "sharder_data":
                parts.append(id(v))
            elif name == "tensor":
                parts.append(_tensor_key(v))
            elif name == "shard_sizes":
                parts.append(tuple(map(tuple, v)))
            elif type(v) is list:
                t: Hashable = tuple(v)
                try:
                    hash(t)
                except TypeError:
                    t = _freeze(v)
                parts.append(t)
            else:
                try:
                    hash(v)
                except TypeError:
                    v = _freeze(v)
                parts.append(v)
    except TypeError:
        return None
    return tuple(parts)


_STORAGE_ESTIMATE = (
    "torchrec.distributed.planner.shard_estimators:EmbeddingStorageEstimator.estimate"
)


def _kv_params_from_constraints_only() -> bool:
    """The installed ``EmbeddingStorageEstimator.estimate`` is 1.8.0's, which reads
    ``key_value_params`` from the constraints only (1.9 prefers the option's own value)."""
    from fastinit import ports

    return ports.mirrors_release(_STORAGE_ESTIMATE, "torchrec 1.8.0")


class MemoStorageEstimator(EmbeddingStorageEstimator):
    """``EmbeddingStorageEstimator`` (1.8.0) that memoises ``calculate_shard_storages``.

    Within one ``estimate`` call, options whose storage inputs are equal (same shape, dtype,
    optimizer, sharding type, kernel, shard sizes, pooling, batch sizes, ...) share one computation;
    every shard still gets its own ``Storage`` object.
    """

    def _storages(
        self,
        sharding_option: ShardingOption,
        shard_sizes: list[list[int]],
        n_shards: int,
        sharder_data_map: SharderDataMap,
        memo: dict[Hashable, list[tuple[Any, Any, Any]]],
    ) -> list[tuple[Any, Any, Any]] | list[Any]:
        """The storages of an option's shards, as ``(hbm, ddr, ssd)`` tuples.

        Args:
            sharding_option: the option.
            shard_sizes: every shard's size, or (data parallel, all alike) the first one only.
            n_shards: the number of shards.
            sharder_data_map: the enumerator's sharder data.
            memo: results by storage inputs, shared across the options of one ``estimate``.

        Returns:
            One tuple per shard, or a single tuple when every shard has that storage; or, where
            ``calculate_shard_storages`` returned something other than stock ``Storage`` objects,
            its result as it is (one object per shard of ``shard_sizes``).
        """
        from torchrec.distributed.planner.constants import (
            BIGINT_DTYPE,
            KV_CACHING_RATIO,
            UVM_CACHING_RATIO,
        )

        sharder_data = sharder_data_map[sharding_option.module_type_key]
        caching_ratio = sharding_option.cache_load_factor
        if caching_ratio is None:
            caching_ratio = sharder_data.fused_params.get("cache_load_factor")
        constraints: ParameterConstraints | None = (
            self._constraints.get(sharding_option.name, None) if self._constraints else None
        )
        num_poolings = get_num_poolings(self._constraints, sharding_option)
        assert len(num_poolings) == sharding_option.num_inputs
        batch_sizes = (
            constraints.batch_sizes
            if constraints and constraints.batch_sizes
            else [sharding_option.batch_size] * sharding_option.num_inputs
        )
        key_value_params: KeyValueParams | None
        if _kv_params_from_constraints_only():  # 1.8.0: the constraint's, if truthy
            key_value_params = (
                constraints.key_value_params
                if constraints and constraints.key_value_params
                else None
            )
        elif sharding_option.key_value_params is not None:  # 1.9: the option's own first
            key_value_params = sharding_option.key_value_params
        else:
            key_value_params = constraints.key_value_params if constraints is not None else None
        kv_cache_load_factor: float = sharder_data.fused_params.get(
            "cache_load_factor", KV_CACHING_RATIO
        )
        use_virtual_table: bool = constraints.use_virtual_table if constraints else False
        input_data_type_size = BIGINT_DTYPE
        output_data_type_size: float = (
            DATA_TYPE_NUM_BITS[sharding_option.output_dtype] / 8
            if sharding_option.output_dtype
            else sharding_option.tensor.element_size()
        )
        mpp_conf = (
            sharding_option.cache_params.multipass_prefetch_config
            if sharding_option.cache_params
            else None
        )
        if mpp_conf is None:
            mpp_conf = sharder_data.fused_params.get("multipass_prefetch_config")
        kwargs: dict[str, Any] = {
            "sharder_data": sharder_data,
            "sharding_type": sharding_option.sharding_type,
            "tensor": sharding_option.tensor,
            "compute_device": self._topology.compute_device,
            "compute_kernel": sharding_option.compute_kernel,
            "shard_sizes": shard_sizes,
            "batch_sizes": batch_sizes,
            "world_size": self._topology.world_size,
            "local_world_size": self._topology.intra_group_size,
            "input_lengths": sharding_option.input_lengths,
            "num_poolings": num_poolings,
            "caching_ratio": caching_ratio if caching_ratio else UVM_CACHING_RATIO,
            "is_pooled": sharding_option.is_pooled,
            "input_data_type_size": input_data_type_size,
            "output_data_type_size": output_data_type_size,
            "pipeline_type": self._pipeline_type,
            "count_ephemeral_storage_cost": self._run_embedding_at_peak_memory,
            "is_inference": self._is_inference,
            "multipass_prefetch_max_pass": mpp_conf.num_passes if mpp_conf else None,
            "key_value_params": key_value_params,
            "kv_cache_load_factor": kv_cache_load_factor,
            "use_virtual_table": use_virtual_table,
        }
        key = _storage_key(kwargs)
        storages = memo.get(key) if key is not None else None
        if storages is not None:
            return storages
        try:
            computed = calculate_shard_storages(**kwargs)
        except ZeroDivisionError as e:
            raise ValueError(
                f"Failed to calculate sharding plan: {str(e)} "
                f"Context: table_name='{sharding_option.name}', "
                f"module_path='{sharding_option.path}', "
                f"tensor.shape={sharding_option.tensor.shape}, "
                f"sharding_type='{sharding_option.sharding_type}', "
                f"compute_kernel='{sharding_option.compute_kernel}'"
            ) from e
        if len(computed) == len(shard_sizes) and all(
            type(s) is Storage and len(s.__dict__) == 3 for s in computed
        ):
            storages = [(s.hbm, s.ddr, s.ssd) for s in computed]
            if key is not None:
                memo[key] = storages
            return storages
        return computed

    @staticmethod
    def _data_parallel_one(sharding_option: ShardingOption, n: int) -> bool:
        # data parallel: every value is per shard and no value depends on the shard count
        # (_calculate_dp_shard_io_sizes replicates one value): compute one shard, replicate
        return sharding_option.sharding_type == ShardingType.DATA_PARALLEL.value and n > 1

    def estimate(
        self,
        sharding_options: list[ShardingOption],
        sharder_data_map: SharderDataMap,
    ) -> None:
        """Same result as ``EmbeddingStorageEstimator.estimate``; see the class docstring."""
        memo: dict[Hashable, list[tuple[Any, Any, Any]]] = {}
        for sharding_option in sharding_options:
            full_sizes = [shard.size for shard in sharding_option.shards]
            n_shards = len(full_sizes)
            shard_sizes = full_sizes
            if self._data_parallel_one(sharding_option, n_shards) and all(
                size == full_sizes[0] for size in full_sizes
            ):
                shard_sizes = full_sizes[:1]
            storages = self._storages(
                sharding_option, shard_sizes, n_shards, sharder_data_map, memo
            )
            if storages and type(storages[0]) is not tuple:  # not the stock type: as computed
                computed = storages
                if shard_sizes is not full_sizes:
                    computed = self._storages(
                        sharding_option, full_sizes, n_shards, sharder_data_map, {}
                    )
                for shard, storage in zip(sharding_option.shards, computed):
                    shard.storage = storage
                continue
            if len(storages) == 1 and n_shards > 1:
                hbm, ddr, ssd = storages[0]
                for shard in sharding_option.shards:
                    shard.storage = _new_storage(hbm, ddr, ssd)
            else:
                for shard, (hbm, ddr, ssd) in zip(sharding_option.shards, storages):
                    shard.storage = _new_storage(hbm, ddr, ssd)

    def estimate_compact(
        self, options: list[CompactOption], sharder_data_map: SharderDataMap
    ) -> None:
        """``estimate`` on described shards: fills ``st``/``st_pos`` of each option.

        Raises:
            CompactUnsupported: ``calculate_shard_storages`` returned non-stock storages.
        """
        memo: dict[Hashable, list[tuple[Any, Any, Any]]] = {}
        for c in options:
            so = c.so
            if c.replicated and self._data_parallel_one(so, c.n):
                sizes = c.sizes
            else:
                sizes = c.shard_sizes()
            storages = self._storages(so, sizes, c.n, sharder_data_map, memo)
            if storages and type(storages[0]) is not tuple:
                raise CompactUnsupported("storage estimate of a non-stock type")
            c.st, c.st_pos = _distinct(cast(list[tuple[int, int, int]], storages))


def _may_carry_annotation(attr: Any) -> bool:
    """``attr`` is callable and may carry an annotation attribute (see ``_with_cached_dir``)."""
    if not callable(attr):
        return False
    func = attr.__func__ if isinstance(attr, types.MethodType) else attr
    return not (isinstance(func, types.FunctionType) and not func.__dict__)


def _with_cached_dir(config_cls: type) -> type:
    """A subclass of ``config_cls`` whose ``dir()`` lists only its public callables.

    The 1.8.0 evaluators find a config's annotated methods by scanning ``dir(config)`` on every
    call (``annotations._get_annotated_method`` and ``_get_coefficient_method``): they skip names
    starting with ``_`` and attributes that are not callable, and return the first match in
    ``dir`` order. Listing only the public callables (``dir`` still sorts them) finds the same
    method without re-reading every property each time. Name and module are the base's.

    The scanners only ever return a method that carries the annotation they look for
    (``getattr(method, "_is_...", False)``), and the annotation decorators set it as an attribute
    of the function. A plain function with no attributes of its own (an empty ``__dict__``) can
    carry none, so those are left out too: the scans then read the few annotated methods only.
    """

    def __dir__(self: Any) -> list[str]:
        names = self.__dict__.get("_fastinit_dir")
        if names is None:
            names = [
                n
                for n in cast(Any, config_cls).__dir__(self)
                if not n.startswith("_")
                and n != "coefficients"
                and _may_carry_annotation(getattr(self, n, None))
            ]
            self.__dict__["_fastinit_dir"] = names
        return list(names)

    sub = type(
        config_cls.__name__,
        (config_cls,),
        {
            "__dir__": __dir__,
            "__module__": config_cls.__module__,
            "__qualname__": config_cls.__qualname__,
        },
    )
    return sub


def default_fast_estimators(
    topology: Topology, constraints: dict[str, ParameterConstraints] | None
) -> list[ShardEstimator]:
    """The estimators ``EmbeddingEnumerator`` builds by default, in their memoising form.

    Args:
        topology: the planner's topology.
        constraints: the planner's constraints.

    Returns:
        ``[perf estimator, storage estimator]`` as 1.8.0's ``EmbeddingEnumerator.__init__`` makes
        them (``EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, ...)`` and
        ``EmbeddingStorageEstimator(topology, constraints)``).
    """
    config_cls = EmbeddingPerfEstimatorFactory._registry[DEFAULT_PERF_ESTIMATOR.lower()]
    config = _with_cached_dir(config_cls)()
    return [
        MemoPerfEstimator(topology=topology, constraints=constraints, config=config),
        MemoStorageEstimator(topology=topology, constraints=constraints),
    ]


class FastEnumerator(EmbeddingEnumerator):
    """``EmbeddingEnumerator`` (1.8.0) with memoising estimators, described shards, a lazy copy.

    ``enumerate`` is a port of the stock method with these changes, none of which changes a value:

    * the stock method deep-copies the whole search space to keep it as
      ``last_stored_search_space`` (seconds at hundreds of ranks, where every data-parallel option
      has one shard per rank). Here the copy is made on first use of ``last_stored_search_space``
      or of the enumerate cache, from the options as enumerated (the fast planner only assigns
      shard ranks to them, which the copy resets to ``None``);
    * ``enumerate_compact`` gives the same search space as ``CompactOption`` descriptions, whose
      shards are built only when asked for (the fast planner builds those of its plan only);
    * ``_get_num_buckets`` scans the module's table configs once per module, not once per table.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: ShardEstimator | list[ShardEstimator] | None = None,
        use_exact_enumerate_order: bool | None = False,
    ) -> None:
        if estimator is None:
            estimator = default_fast_estimators(topology, constraints)
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            constraints=constraints,
            estimator=estimator,
            use_exact_enumerate_order=use_exact_enumerate_order,
        )
        self._pending_snapshot: list[CompactOption] | None = None

    @property
    def last_stored_search_space(self) -> list[ShardingOption] | None:
        """The search space of the last ``enumerate`` call (a private deep copy)."""
        self._materialise_snapshot()
        return self._last_stored_search_space

    def _materialise_snapshot(self) -> None:
        if self._pending_snapshot is not None:
            options = [c.materialise() for c in self._pending_snapshot]
            snapshot = copy_sharding_options(options)
            for so in snapshot:
                for shard in so.shards:
                    shard.rank = None
            self._last_stored_search_space = snapshot
            self._pending_snapshot = None

    def _cached(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> bool:
        last_module: Any = getattr(self, "_last_stored_module", None)
        last_sharders: Any = getattr(self, "_last_stored_sharders", None)
        return bool(last_module == module and last_sharders == sharders)

    def enumerate(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
    ) -> list[ShardingOption]:
        """Port of ``EmbeddingEnumerator.enumerate`` (1.8.0); see the class docstring."""
        if self._cached(module, sharders):
            self._materialise_snapshot()
            assert self._last_stored_search_space is not None
            return copy_sharding_options(self._last_stored_search_space)
        return [c.materialise() for c in self.enumerate_compact(module, sharders)]

    def enumerate_compact(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
    ) -> list[CompactOption]:
        """``enumerate``'s search space, as options whose shards are described, not built.

        With the default (memoising) estimators, no per-shard object is made; with any other
        estimator the shards are built and estimated as ``enumerate`` does, then described.
        """
        if self._cached(module, sharders):
            return [CompactOption.from_option(so) for so in self.enumerate(module, sharders)]
        options = self._enumerate_described(module, sharders)
        if all(type(e) in (MemoPerfEstimator, MemoStorageEstimator) for e in self._estimators):
            try:
                for e in self._estimators:
                    cast(MemoPerfEstimator | MemoStorageEstimator, e).estimate_compact(
                        options, self._sharder_data_map
                    )
            except CompactUnsupported:
                options = self._estimate_built(options)
        else:
            options = self._estimate_built(options)
        self._last_stored_module = module
        self._last_stored_sharders = sharders
        self._pending_snapshot = list(options)
        return options

    def _estimate_built(self, options: list[CompactOption]) -> list[CompactOption]:
        """Build every shard, run the estimators as the stock enumerator does, describe again."""
        built = []
        for c in options:
            so = c.so
            so.shards = [
                _new_shard(size, offset)
                for size, offset in zip(
                    c.shard_sizes(), c.offsets * c.n if c.replicated else c.offsets
                )
            ]
            built.append(so)
        self.populate_estimates(built)
        return [CompactOption.from_option(so) for so in built]

    def _enumerate_described(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
    ) -> list[CompactOption]:
        """The enumeration loop of ``EmbeddingEnumerator.enumerate`` (1.8.0), shards described."""
        self._sharder_map = {sharder_name(sharder.module_type): sharder for sharder in sharders}
        self._sharder_data_map = build_sharder_data_map(self._sharder_map)
        sharding_options: list[CompactOption] = []

        named_modules_queue: list[tuple[str, nn.Module]] = [("", module)]
        while named_modules_queue:
            if not self._use_exact_enumerate_order:
                child_path, child_module = named_modules_queue.pop()
            else:
                child_path, child_module = named_modules_queue.pop(0)
            sharder_key = sharder_name(type(child_module))
            sharder = self._sharder_map.get(sharder_key, None)
            if not sharder:
                for n, m in child_module.named_children():
                    if child_path != "":
                        named_modules_queue.append((child_path + "." + n, m))
                    else:
                        named_modules_queue.append((n, m))
                continue

            is_pooled = ShardingOption.module_pooled(child_module, child_path)
            num_buckets_of = self._num_buckets_lookup(child_module)
            # 1.9: each option carries its table's stash_weights (1.8.0 has neither)
            stash_of = self._stash_weights_lookup(child_module)

            for name, param in sharder.shardable_parameters(child_module).items():
                (
                    input_lengths,
                    col_wise_shard_dim,
                    cache_params,
                    enforce_hbm,
                    stochastic_rounding,
                    bounds_check_mode,
                    feature_names,
                    output_dtype,
                    device_group,
                    key_value_params,
                ) = _extract_constraints_for_param(self._constraints, name)

                if device_group and device_group != self._compute_device:
                    continue
                num_buckets = (
                    num_buckets_of.get(name)
                    if num_buckets_of is not None
                    else self._get_num_buckets(name, child_module)
                )
                sharding_options_per_table: list[CompactOption] = []
                extra: dict[str, Any] = {}
                if stash_of is not None:
                    extra["stash_weights"] = stash_of(name)

                for sharding_type in self._filter_sharding_types(
                    name, sharder.sharding_types(self._compute_device), sharder_key
                ):
                    for compute_kernel in self._filter_compute_kernels(
                        name,
                        sharder.compute_kernels(sharding_type, self._compute_device),
                        sharding_type,
                    ):
                        try:
                            shard_sizes, shard_offsets = calculate_shard_sizes_and_offsets(
                                tensor=param,
                                world_size=self._world_size,
                                local_world_size=self._local_world_size,
                                sharding_type=sharding_type,
                                col_wise_shard_dim=col_wise_shard_dim,
                                device_memory_sizes=self._device_memory_sizes,
                                num_buckets=num_buckets,
                            )
                        except ZeroDivisionError as e:
                            raise ValueError(
                                f"Failed to calculate sharding plan: {str(e)} "
                                f"Context: table_name='{name}', module_path='{child_path}', "
                                f"module_type='{type(child_module).__name__}', "
                                f"sharder='{sharder.__class__.__name__}', "
                                f"tensor.shape={param.shape}, sharding_type='{sharding_type}', "
                                f"compute_kernel='{compute_kernel}', world_size={self._world_size}, "
                                f"local_world_size={self._local_world_size}, "
                                f"col_wise_shard_dim={col_wise_shard_dim}, "
                                f"compute_device='{self._compute_device}'"
                            ) from e
                        dependency = None
                        if isinstance(child_module, EmbeddingTower):
                            dependency = child_path
                        elif isinstance(child_module, EmbeddingTowerCollection):
                            tower_index = _get_tower_index(name, child_module)
                            dependency = child_path + ".tower_" + str(tower_index)
                        so = ShardingOption(
                            name=name,
                            tensor=param,
                            module=(child_path, child_module),
                            input_lengths=input_lengths,
                            batch_size=self._batch_size,
                            compute_kernel=compute_kernel,
                            sharding_type=sharding_type,
                            partition_by=get_partition_by_type(sharding_type),
                            shards=[],
                            cache_params=cache_params,
                            enforce_hbm=enforce_hbm,
                            stochastic_rounding=stochastic_rounding,
                            bounds_check_mode=bounds_check_mode,
                            dependency=dependency,
                            is_pooled=is_pooled,
                            feature_names=feature_names,
                            output_dtype=output_dtype,
                            key_value_params=key_value_params,
                            **extra,
                        )
                        sharding_options_per_table.append(
                            CompactOption(so, shard_sizes, shard_offsets)
                        )
                if not sharding_options_per_table:
                    raise RuntimeError(
                        "No available sharding type and compute kernel combination "
                        f"after applying user provided constraints for {name}. "
                        f"Module: {sharder_key}, sharder: {sharder.__class__.__name__}, compute device: {self._compute_device}. "
                        f"To debug, search above for warning logs about no available sharding types/compute kernels for table: {name}"
                    )

                sharding_options.extend(sharding_options_per_table)
        return sharding_options

    def _stash_weights_lookup(self, module: nn.Module) -> Callable[[str], bool] | None:
        """``_get_stash_weights(name, module)`` as a function of the table name (None where the
        installed enumerator has no ``_get_stash_weights``). The stock method scans the module's
        table configs for each table and option; for an ``EmbeddingBagCollection`` or
        ``EmbeddingCollection`` it returns ``stash_weights`` of the first config with the
        table's name (else False), read here once per module. Other modules keep the stock
        method."""
        stock = getattr(self, "_get_stash_weights", None)
        if stock is None:
            return None
        if isinstance(module, EmbeddingBagCollection):
            configs: list[Any] = list(module.embedding_bag_configs())
        elif isinstance(module, EmbeddingCollection):
            configs = list(module.embedding_configs())
        else:
            return lambda name: bool(stock(name, module))
        flags: dict[str, bool] = {}
        for config in configs:
            flags.setdefault(config.name, bool(getattr(config, "stash_weights", False)))
        return lambda name: flags.get(name, False)

    def _num_buckets_lookup(self, module: nn.Module) -> dict[str, int | None] | None:
        """``_get_num_buckets`` for every table of ``module`` at once, where it only reads configs.

        The stock method scans the module's table configs for each table (quadratic in tables):
        for an ``EmbeddingBagCollection`` or ``EmbeddingCollection`` it returns the
        ``total_num_buckets`` of the first config with the table's name and ``use_virtual_table``,
        else None. Other modules return None here and keep the stock method.
        """
        if isinstance(module, EmbeddingBagCollection):
            configs: list[Any] = list(module.embedding_bag_configs())
        elif isinstance(module, EmbeddingCollection):
            configs = list(module.embedding_configs())
        else:
            return None
        out: dict[str, int | None] = {}
        for config in configs:
            if config.use_virtual_table and config.name not in out:
                out[config.name] = config.total_num_buckets
        return out


# ---- end of section: planner -------------------------------------------------------------------


# =================================================================================================
# Section: fingerprint (fastinit.sharding.fingerprint) -- written against torchrec 1.8.0.
#
# Reads only; nothing here writes to a TorchRec object. Touches:
#   torchrec.distributed.planner.planners.EmbeddingPlannerBase / EmbeddingShardingPlanner: the
#       attributes _batch_size, _constraints, _enumerator, _storage_reservation, _proposers,
#       _partitioner, _perf_model, _callbacks, _timeout_seconds (and the public plan_loader).
#   torchrec.distributed.planner.types.Topology._custom_topology_data and
#       CustomTopologyData._data (EmbeddingEnumerator reads them for per-device memory).
#   The "_<parameter>" attributes in which planner components (enumerators, estimators, proposers,
#       partitioners, storage reservations, comms bandwidths, qcomm codecs, ...) keep their
#       constructor arguments (constructor_settings), e.g. GreedyProposer._use_depth, ._threshold;
#       GreedyPerfPartitioner._sort_by; HeuristicalStorageReservation._percentage;
#       EmbeddingEnumerator._estimators (kept for the "estimator" argument).
# =================================================================================================

FINGERPRINT_TORCHREC_VERSION = "1.8.0"

# Planner attribute -> name in the fingerprint. Left out: stats and debug (logging only).
_PLANNER_ATTRIBUTES: dict[str, str] = {
    "_batch_size": "batch_size",
    "_constraints": "constraints",
    "_enumerator": "enumerator",
    "_storage_reservation": "storage_reservation",
    "_proposers": "proposers",
    "_partitioner": "partitioner",
    "_perf_model": "performance_model",
    "_callbacks": "callbacks",
    "_timeout_seconds": "timeout_seconds",
    "plan_loader": "plan_loader",
}


def planner_settings(planner: Any) -> dict[str, Any]:
    """The settings of a TorchRec planner that decide its plan, by name.

    Args:
        planner: an ``EmbeddingShardingPlanner`` (or a subclass, or another planner: only the
            attributes it has are read).

    Returns:
        ``{"batch_size": ..., "constraints": ..., "enumerator": ..., ...}`` for the attributes
        present; the planner's topology is not included (the fingerprint takes it separately).
    """
    state = vars(planner) if hasattr(planner, "__dict__") else {}
    return {name: state[attr] for attr, name in _PLANNER_ATTRIBUTES.items() if attr in state}


def topology_custom_data(topology: Topology) -> dict[str, list[int]] | None:
    """``Topology._custom_topology_data._data`` (per-device memory overrides), or None."""
    custom = getattr(topology, "_custom_topology_data", None)
    if custom is None:
        return None
    data = getattr(custom, "_data", None)
    return dict(data) if isinstance(data, dict) else None


def constructor_settings(obj: Any) -> dict[str, Any]:
    """The constructor arguments ``obj`` keeps, read from ``_<name>``, ``<name>`` or ``_<name>s``.

    Only attributes named after a parameter of ``type(obj).__init__`` are read, so state an
    object accumulates while planning (proposals, search spaces, best ratings) never enters the
    fingerprint.

    Args:
        obj: any object (a planner component, a codec, ...).

    Returns:
        ``{parameter name: value}`` for the parameters found; empty when none are.
    """
    import inspect

    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return {}
    try:
        params = inspect.signature(type(obj).__init__).parameters
    except (TypeError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for name, param in params.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        for attr in (f"_{name}", name, f"_{name}s"):
            if attr in state:
                out[name] = state[attr]
                break
    return out
