"""What the own-rank row-wise and data-parallel shardings share (``rw_sharding.py`` and
``dp_sharding.py`` here): every rank's grouped tables built on demand, and the
``ShardedEmbeddingTable`` fields both upstream ``_shard`` methods set alike. Not an upstream file."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)


class PerRank(Sequence[list[GroupedEmbeddingConfig]]):
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


def sharded_table(info: EmbeddingShardingInfo, **fields: Any) -> ShardedEmbeddingTable:
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
