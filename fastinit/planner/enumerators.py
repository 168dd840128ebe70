"""Mirrors ``torchrec/distributed/planner/enumerators.py`` (written against torchrec 1.8.0).

``EmbeddingEnumerator.enumerate`` ported as ``FastEnumerator`` (memoising estimators, described
shards, a lazy copy of the search space); ``_get_num_buckets`` and ``_get_stash_weights`` read once
per module for ``EmbeddingBagCollection`` / ``EmbeddingCollection`` (``embedding_bag_configs()`` /
``embedding_configs()``, ``use_virtual_table``, ``total_num_buckets``, ``stash_weights``; other
modules call the stock methods). Touches ``_extract_constraints_for_param``, ``_get_tower_index``,
``populate_estimates`` and the attributes ``_sharder_map``, ``_sharder_data_map``,
``_last_stored_{module,sharders,search_space}``, ``_constraints``, ``_compute_device``,
``_world_size``, ``_local_world_size``, ``_device_memory_sizes``, ``_batch_size``,
``_use_exact_enumerate_order``, ``_estimators``. Registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import nn
from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR
from torchrec.distributed.planner.enumerators import (
    EmbeddingEnumerator,
    _extract_constraints_for_param,
    _get_tower_index,
    get_partition_by_type,
)
from torchrec.distributed.planner.estimator.estimator import (
    EmbeddingPerfEstimatorFactory,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    ShardEstimator,
    ShardingOption,
    Topology,
)
from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_tower import (
    EmbeddingTower,
    EmbeddingTowerCollection,
)

from fastinit.planner.estimator.estimator import (
    MemoPerfEstimator,
    with_cached_dir,
)
from fastinit.planner.shard_estimators import MemoStorageEstimator
from fastinit.planner.types import (
    CompactOption,
    CompactUnsupported,
    copy_sharding_options,
    new_shard,
)


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
    config = with_cached_dir(config_cls)()
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
                new_shard(size, offset)
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
