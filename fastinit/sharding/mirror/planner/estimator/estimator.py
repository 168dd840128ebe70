"""Mirrors ``torchrec/distributed/planner/estimator/estimator.py`` (written against torchrec 1.8.0).

``EmbeddingPerfEstimator.estimate`` ported as ``MemoPerfEstimator`` (each distinct shard context
evaluated once). Touches ``get_embedding_perf_sharding_evaluator``, the factory's ``_registry``,
the estimator's ``_topology``/``_constraints``/``_config``/``_is_inference``/``_use_*`` attributes,
``ShardPerfContext.build_shard_perf_contexts`` and ``HardwarePerfConfig.post_process_perfs`` (the
described path needs the base, identity one). The default config is instantiated from a subclass
with a cached ``__dir__`` (``_with_cached_dir``), which relies on
``estimator/annotations.py``'s ``_get_annotated_method``/``_get_coefficient_method`` scanning
``dir(config)``. Registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Hashable
from typing import Any, cast

from torchrec.distributed.planner.estimator.estimator import (
    EmbeddingPerfEstimator,
    get_embedding_perf_sharding_evaluator,
)
from torchrec.distributed.planner.estimator.types import HardwarePerfConfig, ShardPerfContext
from torchrec.distributed.planner.types import (
    SharderDataMap,
    ShardingOption,
)

from fastinit.sharding.mirror.planner.types import (
    CompactOption,
    CompactUnsupported,
    _distinct,
    _perf_fields,
    _perf_from_fields,
)

logger: logging.Logger = logging.getLogger(__name__)


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
