"""A model and an explicit plan of a user's own, for ``make scale``'s factories.

    python -m benchmarks.scale --ranks 64,512,4096 --stock-max 0 --paths compact,explicit \\
        --model-factory benchmarks.scale.factories:user_model \\
        --plan-factory benchmarks.scale.factories:user_plan

Not fastinit's reference model: TorchRec modules built directly (no ``fastinit.testing``), nested
under a ``ModuleDict``, tables of several sizes and dims (small enough that
setup's time is its own work, not filling the tables), and a plan written the way a user
writes one with TorchRec's ``construct_module_sharding_plan``: the sharding type chosen per table
by its size (large tables row-wise over every rank; wide ones column-wise over one host, or a
grid over one host, or over two for two column blocks; mid-sized ones table-row-wise, small ones
table-wise, the smallest data-parallel).
"""

from __future__ import annotations

from typing import Any

__all__ = ["user_model", "user_plan"]


def user_model() -> Any:
    """160 tables on the meta device: ``features.user`` (an EmbeddingBagCollection of 96),
    ``features.item`` (a weighted one of 32) and ``history`` (an EmbeddingCollection of 32)."""
    import torch
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    meta = torch.device("meta")

    def bag(prefix: str, count: int) -> list[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(
                name=f"{prefix}_{i}",
                embedding_dim=(64, 128, 32, 256)[i % 4],
                num_embeddings=(20_000, 500, 4_000, 30, 100_000)[i % 5] + 11 * i,
                feature_names=[f"{prefix}_f{i}"],
            )
            for i in range(count)
        ]

    class UserModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.ModuleDict(
                {
                    "user": EmbeddingBagCollection(tables=bag("user", 96), device=meta),
                    "item": EmbeddingBagCollection(
                        tables=bag("item", 32), is_weighted=True, device=meta
                    ),
                }
            )
            self.history = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name=f"hist_{i}",
                        embedding_dim=64,
                        num_embeddings=(10_000, 200, 3_000)[i % 3] + 7 * i,
                        feature_names=[f"hist_f{i}"],
                    )
                    for i in range(32)
                ],
                device=meta,
            )
            self.dense = nn.Linear(16, 64, device=meta)

    return UserModel()


def user_plan(module: Any, world_size: int, local_world_size: int) -> Any:
    """The explicit plan of :func:`user_model` on ``world_size`` ranks, ``local_world_size`` per
    host, through TorchRec's ``construct_module_sharding_plan``."""
    from torchrec.distributed import sharding_plan as sp

    from benchmarks.scale.main import explicit_plan

    hosts = max(1, world_size // local_world_size)

    def choose(c: Any, i: int, is_ec: bool) -> Any:
        rows, dim = c.num_embeddings, c.embedding_dim
        local = list(range((i % hosts) * local_world_size, (i % hosts + 1) * local_world_size))
        if rows >= 10_000:
            return sp.row_wise()
        if is_ec:  # EmbeddingCollection: table-wise, column-wise, row-wise, data-parallel
            return (
                sp.column_wise(ranks=local[: min(4, len(local))])
                if rows >= 2_000
                else sp.table_wise(rank=(7 * i) % world_size)
            )
        if rows <= 600:
            return sp.data_parallel()
        if dim == 256 and hosts >= 2 and i % 2:  # two column blocks of 128: two hosts
            return sp.grid_shard(host_indexes=[i % hosts, (i + 1) % hosts])
        if dim == 128 and i % 2:  # one column block: one host
            return sp.grid_shard(host_indexes=[i % hosts])
        if dim >= 128:
            return sp.column_wise(ranks=local[: dim // 32])
        if rows >= 2_000:
            return sp.table_row_wise(host_index=(3 * i) % hosts)
        return sp.table_wise(rank=(13 * i) % world_size)

    return explicit_plan(module, world_size, local_world_size, choose)
