"""Mirrors ``torchrec/distributed/planner/estimator/estimator.py`` (written against torchrec 1.8.0).

``EmbeddingPerfEstimator.estimate`` ported as ``MemoPerfEstimator`` (each distinct shard context
evaluated once). Touches ``get_embedding_perf_sharding_evaluator``, the factory's ``_registry``,
the estimator's ``_topology``/``_constraints``/``_config``/``_is_inference``/``_use_*`` attributes,
``ShardPerfContext.build_shard_perf_contexts`` and ``HardwarePerfConfig.post_process_perfs`` (the
described path needs the base, identity one). The default config is instantiated from a subclass
with a cached ``__dir__`` (``with_cached_dir``), which relies on
``estimator/annotations.py``'s ``_get_annotated_method``/``_get_coefficient_method`` scanning
``dir(config)``. Registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
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

from fastinit.planner.types import (
    CompactOption,
    CompactUnsupported,
    distinct_values,
    perf_fields,
    perf_from_fields,
)

logger: logging.Logger = logging.getLogger(__name__)


def _is_identity_post_process(config: Any) -> bool:
    """The config's ``post_process_perfs`` is the base one, which returns the perfs unchanged."""
    return (
        getattr(type(config), "post_process_perfs", None) is HardwarePerfConfig.post_process_perfs
    )


class _HashSizeRead(BaseException):
    """A trial evaluation used a hash size (a ``BaseException``: no ``except Exception`` in the
    evaluator can take it for one of its own errors)."""


def _hash_size_read(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise _HashSizeRead


class _HashSizeProbe:
    """Stands for a shard's hash sizes in a trial evaluation (``MemoPerfEstimator``).

    The only operation it allows is a product with a float zero (``0.0 * h``), whose value is that
    zero (same sign) for every integer ``h >= 0``; every other use (arithmetic, comparison,
    conversion, hashing, formatting, attribute access, truth value) raises ``_HashSizeRead``. So a
    trial that completes computed what the evaluator computes for any non-negative hash size.
    """

    __slots__ = ()

    def __mul__(self, other: Any) -> Any:
        if type(other) is float and other == 0.0:
            return other
        raise _HashSizeRead

    __rmul__ = __mul__
    __getattr__ = _hash_size_read
    __call__ = _hash_size_read
    __hash__ = _hash_size_read
    __eq__ = _hash_size_read
    __ne__ = _hash_size_read
    __lt__ = __le__ = __gt__ = __ge__ = _hash_size_read
    __add__ = __radd__ = __sub__ = __rsub__ = _hash_size_read
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _hash_size_read
    __mod__ = __rmod__ = __divmod__ = __rdivmod__ = __pow__ = __rpow__ = _hash_size_read
    __matmul__ = __rmatmul__ = _hash_size_read
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _hash_size_read
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _hash_size_read
    __neg__ = __pos__ = __abs__ = __invert__ = _hash_size_read
    __int__ = __float__ = __complex__ = __index__ = __bool__ = _hash_size_read
    __round__ = __trunc__ = __floor__ = __ceil__ = _hash_size_read
    __str__ = __repr__ = __format__ = __bytes__ = _hash_size_read
    __len__ = __iter__ = __getitem__ = __contains__ = _hash_size_read
    __reduce__ = __reduce_ex__ = __copy__ = __deepcopy__ = _hash_size_read


_PROBE = _HashSizeProbe()
#: the context fields a trial evaluation replaces by ``_PROBE`` (a shard's rows and its table's)
_HASH_FIELDS = ("hash_size", "hash_size_for_clamping")


class MemoPerfEstimator(EmbeddingPerfEstimator):
    """``EmbeddingPerfEstimator`` (1.8.0) that evaluates each distinct shard context once.

    The stock ``estimate`` builds one ``ShardPerfContext`` per shard and runs the evaluator on each;
    a context depends only on the shard's ``[rows, cols]`` and on per-option data, and the evaluator
    is a pure function of ``(context, config)``. So contexts are built for the distinct shard sizes
    of an option only, and evaluator results are memoised by context value within one ``estimate``
    call (across options and tables). Every shard still gets its own ``Perf`` object, and the
    config's ``post_process_perfs`` still sees every shard. The context's ``table_name`` is left out
    of the memo key only for TorchRec's own configs, which never read it.

    Contexts that differ only in their hash sizes (``hash_size``, ``hash_size_for_clamping``:
    tables of one shape but their row counts) share one result where the evaluator does not read
    them: the first such context is evaluated once more with both replaced by ``_PROBE``, which
    raises on any use but a product with a float zero (the default coefficients multiply the hash
    size by ``0.0``). A trial that completes, and gives the real evaluation's numbers, is the
    result for every non-negative hash size (the evaluator inspects no field's type and catches
    no ``BaseException``; both hold for the 1.8.0 and 1.9.2 sources, registered in
    ``fastinit/ports.py``). A trial that raises keeps those contexts on the full key.
    """

    #: share results across hash sizes where a trial shows they are not read (tests turn it off)
    _any_hash_size = True
    #: trials made and contexts that took a shared result (counted over the estimator's life)
    _num_any_hash_trials = 0
    _num_any_hash_hits = 0

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
        any_memo: dict[Hashable, tuple[float, ...] | None] | None = None,
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
        shared = any_memo if any_memo is not None else {}
        hash_at = (
            [field_names.index(n) for n in _HASH_FIELDS if n in field_names]
            if any_memo is not None and self._any_hash_size
            else []
        )
        for ctx in contexts:
            values = ctx.__dict__
            ctx_key: Hashable | None = tuple(
                tuple(v) if type(v) is list else v for v in map(values.get, field_names)
            )
            try:
                fields = memo.get(ctx_key)
            except TypeError:  # an unhashable value: no memo for this context
                ctx_key = fields = None
            any_key: Hashable | None = None
            if fields is None and ctx_key is not None and hash_at:
                parts = cast(tuple[Any, ...], ctx_key)
                if all(type(parts[k]) is int and parts[k] >= 0 for k in hash_at):
                    listed = list(parts)
                    for k in hash_at:
                        listed[k] = None
                    any_key = tuple(listed)
                    fields = shared.get(any_key)
                    if fields is not None:
                        self._num_any_hash_hits += 1
            if fields is None:
                evaluator = get_embedding_perf_sharding_evaluator(
                    sharding_type=ctx.sharding_type, is_inference=ctx.is_inference
                )
                fields = perf_fields(evaluator.compute_perf(ctx=ctx, config=config))
                if ctx_key is not None:
                    memo[ctx_key] = fields
                if any_key is not None and any_key not in shared:
                    # a trial with the hash sizes replaced by the probe: it must complete and
                    # give the real numbers, bit for bit; else these contexts keep the full key
                    trial = _trial_fields(evaluator, ctx, config)
                    same = trial is not None and trial == fields and _same_bits(trial, fields)
                    shared[any_key] = fields if same else None
                    self._num_any_hash_trials += 1
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
        any_memo: dict[Hashable, tuple[float, ...] | None] = {}
        num_feature_processors = 0
        for sharding_option in sharding_options:
            shard_sizes = [shard.size for shard in sharding_option.shards]
            distinct, positions = _distinct_sizes(shard_sizes)
            perfs, has_fp = self._distinct_perfs(
                sharding_option, distinct, sharder_data_map, memo, field_names, any_memo
            )
            num_feature_processors += has_fp
            if len(perfs) == 1:
                only = perfs[0]
                for shard in sharding_option.shards:
                    shard.perf = perf_from_fields(only)
            else:
                for shard, pos in zip(sharding_option.shards, positions):
                    shard.perf = perf_from_fields(perfs[pos])
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
        any_memo: dict[Hashable, tuple[float, ...] | None] = {}
        num_feature_processors = 0
        for c in options:
            if c.replicated:
                distinct, positions = c.sizes, None
            else:
                distinct, positions = _distinct_sizes(c.sizes)
            perfs, has_fp = self._distinct_perfs(
                c.so, distinct, sharder_data_map, memo, field_names, any_memo
            )
            num_feature_processors += has_fp
            if positions is None or len(perfs) == 1:
                c.pf, c.pf_pos = perfs[:1], None
            else:
                c.pf, c.pf_pos = distinct_values([perfs[p] for p in positions])
        logger.info(f"Total {num_feature_processors} feature processor.")


def _trial_fields(evaluator: Any, ctx: ShardPerfContext, config: Any) -> tuple[float, ...] | None:
    """The perf fields of ``ctx`` with its hash sizes replaced by ``_PROBE``; None where the
    evaluator used them (or a field is not a plain number: the probe must not leak out)."""
    trial = object.__new__(type(ctx))
    trial.__dict__.update(ctx.__dict__)
    for name in _HASH_FIELDS:
        trial.__dict__[name] = _PROBE
    try:
        fields = perf_fields(evaluator.compute_perf(ctx=trial, config=config))
    except _HashSizeRead:
        return None
    if not all(type(v) in (int, float) for v in fields):
        return None
    return fields


def _same_bits(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Equal values with equal signs of zero (``==`` alone takes ``0.0`` for ``-0.0``)."""
    return all(math.copysign(1.0, x) == math.copysign(1.0, y) for x, y in zip(a, b))


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
    """``attr`` is callable and may carry an annotation attribute (see ``with_cached_dir``)."""
    if not callable(attr):
        return False
    func = attr.__func__ if isinstance(attr, types.MethodType) else attr
    return not (isinstance(func, types.FunctionType) and not func.__dict__)


def with_cached_dir(config_cls: type) -> type:
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
