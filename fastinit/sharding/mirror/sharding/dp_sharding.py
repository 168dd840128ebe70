"""Mirrors ``torchrec/distributed/sharding/dp_sharding.py``: ``BaseDpEmbeddingSharding``'s
``__init__`` and ``_shard``, building this rank's tables only (another rank's when asked for).

:mod:`fastinit.sharding.local` builds the fast data-parallel shardings on :class:`OwnRankDp`.
"""

from __future__ import annotations

import torch
from torchrec.distributed.embedding_sharding import (
    EmbeddingSharding,
    EmbeddingShardingInfo,
    group_tables,
)
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.types import ShardingEnv

from fastinit.sharding.mirror.sharding._own_rank import PerRank, sharded_table


def _dp_tables(infos: list[EmbeddingShardingInfo]) -> list[ShardedEmbeddingTable]:
    """``BaseDpEmbeddingSharding._shard(infos)[rank]`` (the same for every rank)."""
    return [
        sharded_table(
            info,
            local_rows=info.param.size(0),
            local_cols=info.param.size(1),
            local_metadata=None,
            global_metadata=None,
        )
        for info in infos
    ]


class OwnRankDp:
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
        self._grouped_embedding_configs_per_rank = PerRank(
            self._world_size,
            self._rank,
            own,
            lambda r: group_tables([_dp_tables(sharding_infos)])[0],
        )
        self._grouped_embedding_configs = own
