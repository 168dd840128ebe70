"""Mirrors ``torchrec/distributed/sharding/rw_sharding.py``: ``BaseRwEmbeddingSharding``'s
``__init__`` and ``_shard``, building this rank's tables only (another rank's when asked for).

:mod:`fastinit.sharding.local` builds the fast row-wise shardings on :class:`OwnRankRw`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata
from torch.distributed._tensor.placement_types import Replicate, Shard
from torchrec.distributed.embedding_sharding import (
    EmbeddingSharding,
    EmbeddingShardingInfo,
    group_tables,
)
from torchrec.distributed.embedding_types import DTensorMetadata, ShardedEmbeddingTable
from torchrec.distributed.types import ShardingEnv

from fastinit.plan.layout import LazyShards, SharedShards
from fastinit.sharding.mirror.sharding._own_rank import PerRank, sharded_table


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
            sharded_table(
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


class OwnRankRw:
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
        self._grouped_embedding_configs_per_rank = PerRank(
            self._world_size,
            self._rank,
            own,
            lambda r: group_tables([_rw_tables(self, sharding_infos, r, cache)])[0],
        )
        self._grouped_embedding_configs = own
        self.enable_embedding_update = any(g.enable_embedding_update for g in own)
        self._has_feature_processor = any(g.has_feature_processor for g in own)
