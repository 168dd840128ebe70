"""Mirrors ``torchrec/distributed/planner/shard_estimators.py`` (written against torchrec 1.8.0).

``EmbeddingStorageEstimator.estimate`` ported as ``MemoStorageEstimator`` (memoised
``calculate_shard_storages``; ``key_value_params`` read in the installed release's order). Touches
``calculate_shard_storages``, ``get_num_poolings`` and the estimator's ``_topology``,
``_constraints``, ``_pipeline_type``, ``_run_embedding_at_peak_memory``, ``_is_inference``.
Registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, cast

import torch
from torchrec.distributed.planner.constants import BIGINT_DTYPE, KV_CACHING_RATIO, UVM_CACHING_RATIO
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingStorageEstimator,
    calculate_shard_storages,
    get_num_poolings,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    SharderDataMap,
    ShardingOption,
    Storage,
)
from torchrec.distributed.types import KeyValueParams, ShardingType
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS

from fastinit import ports
from fastinit.planner.types import (
    CompactOption,
    CompactUnsupported,
    distinct_values,
    new_storage,
)


def _freeze(v: Any) -> Hashable:
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    hash(v)  # raises TypeError for unhashable values: the caller then skips the memo
    return v


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


#: first element of the memo's "seen" entries (``MemoStorageEstimator._storages``)
_HEAD = object()

_STORAGE_ESTIMATE = (
    "torchrec.distributed.planner.shard_estimators:EmbeddingStorageEstimator.estimate"
)


def _kv_params_from_constraints_only() -> bool:
    """The installed ``EmbeddingStorageEstimator.estimate`` is 1.8.0's, which reads
    ``key_value_params`` from the constraints only (1.9 prefers the option's own value)."""
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
        # the full key costs more than most storages when every table differs: it is made only
        # for an option whose sharding type, kernel and tensor shape were seen before in this
        # call (the first such option is computed, not looked up: no result can be stored yet)
        key: Hashable | None = None
        try:
            head = (
                _HEAD,
                kwargs["sharding_type"],
                kwargs["compute_kernel"],
                _tensor_key(kwargs["tensor"]),
            )
            seen = head in memo
        except TypeError:
            seen = True
        if not seen:
            memo[head] = []
        else:
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
                    shard.storage = new_storage(hbm, ddr, ssd)
            else:
                for shard, (hbm, ddr, ssd) in zip(sharding_option.shards, storages):
                    shard.storage = new_storage(hbm, ddr, ssd)

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
            c.st, c.st_pos = distinct_values(cast(list[tuple[int, int, int]], storages))
