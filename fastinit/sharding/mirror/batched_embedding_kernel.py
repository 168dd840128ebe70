"""Mirrors ``torchrec/distributed/batched_embedding_kernel.py``: ``EmbeddingFusedOptimizer.__init__``
(:func:`fused_optimizer_init`) with its ShardedTensors built locally
(:func:`fastinit.sharding.local.sharded_tensor`) and each optimizer state's shard metadata
(upstream: ``get_optimizer_{single_value,rowwise,pointwise}_shard_metadata_and_global_metadata``,
nested in that ``__init__``) computed once per table layout.

:mod:`fastinit.sharding.kernels` has the fast kernels' fused optimizer run it.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensorMetadata
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.optim.fused import FusedOptimizer

from fastinit.plan.layout import Expansions, LazyShards, SharedShards
from fastinit.sharding import rules
from fastinit.sharding.local import sharded_tensor

__all__ = ["fused_optimizer_init"]


def _new_shard_metadata(offsets: list[int], sizes: list[int], placement: Any) -> Any:
    """A ``ShardMetadata`` of values taken from checked metadata (no re-validation)."""
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
    from torchrec.distributed.comm import get_node_group_size  # looked up per call

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
