"""fastinit.sharding.kernels: TorchRec's code run with fastinit's classes bound in, nothing
patched; the fast sharding classes equal TorchRec's."""

from __future__ import annotations

import pickle
import textwrap
from typing import Any

import pytest

from fastinit.errors import CompatibilityError
from fastinit.sharding import kernels
from fastinit.testing.dist import run_script


def _reads_helper() -> str:
    return helper_target()


def helper_target() -> str:
    return "stock"


def test_rebound_copies_the_function_and_changes_nothing() -> None:
    fast = kernels.rebound(_reads_helper, helper_target=lambda: "fast")
    assert fast() == "fast" and _reads_helper() == "stock"
    assert fast.__code__ is _reads_helper.__code__
    assert globals()["helper_target"] is helper_target
    with pytest.raises(CompatibilityError, match="no longer reads not_read"):
        kernels.rebound(_reads_helper, not_read=1)


def test_torchrecs_shardings_lookups_and_kernels_build_the_fast_classes() -> None:
    from torchrec.distributed.embedding_lookup import (
        GroupedEmbeddingsLookup,
        GroupedPooledEmbeddingsLookup,
    )
    from torchrec.distributed.sharding import (
        cw_sequence_sharding,
        cw_sharding,
        dp_sequence_sharding,
        dp_sharding,
        grid_sharding,
        rw_sequence_sharding,
        rw_sharding,
        tw_sequence_sharding,
        tw_sharding,
        twrw_sharding,
    )

    fast = kernels.fast_classes()
    for cls in (
        tw_sharding.TwPooledEmbeddingSharding,
        rw_sharding.RwPooledEmbeddingSharding,
        cw_sharding.CwPooledEmbeddingSharding,
        dp_sharding.DpPooledEmbeddingSharding,
        twrw_sharding.TwRwPooledEmbeddingSharding,
        grid_sharding.GridPooledEmbeddingSharding,
        tw_sequence_sharding.TwSequenceEmbeddingSharding,
        rw_sequence_sharding.RwSequenceEmbeddingSharding,
        cw_sequence_sharding.CwSequenceEmbeddingSharding,
        dp_sequence_sharding.DpSequenceEmbeddingSharding,
    ):
        create = kernels._create_lookup_of(cls)
        assert create is not None, cls  # the sharding's create_lookup builds a fast lookup
        bound = {n: create.__globals__.get(n) for n in kernels._LOOKUP_NAMES}
        assert any(v in fast.lookups.values() for v in bound.values()), cls
    for stock, names in (
        (GroupedPooledEmbeddingsLookup, ("BatchedFusedEmbeddingBag", "BatchedDenseEmbeddingBag")),
        (GroupedEmbeddingsLookup, ("BatchedFusedEmbedding", "BatchedDenseEmbedding")),
    ):
        lookup = fast.lookups[stock.__name__]
        assert issubclass(lookup, stock)
        for name in names:
            kernel = lookup._create_embedding_kernel.__globals__[name]
            assert kernel is fast.kernels[name] and kernel.__name__ == f"Fast{name}"
    fused = fast.kernels["BatchedFusedEmbeddingBag"]
    assert fused.__init__.__globals__["EmbeddingFusedOptimizer"] is fast.optimizer
    assert fused.state_dict.__globals__["get_state_dict"].__globals__["ShardedTensor"] is (
        fast.sharded_tensor
    )


def test_the_shared_empty_list_is_empty_and_cannot_be_changed() -> None:
    empty = kernels.EMPTY
    assert empty == [] and isinstance(empty, list) and not empty and len(empty) == 0
    assert empty + [1] == [1] and [*empty] == []
    for change in (
        lambda: empty.append(1),
        lambda: empty.extend([1]),
        lambda: empty.insert(0, 1),
        lambda: empty.__iadd__([1]),
        lambda: empty.__setitem__(slice(0, 0), [1]),
    ):
        with pytest.raises(TypeError, match="shared by every rank"):
            change()
    assert empty == []
    assert type(pickle.loads(pickle.dumps(empty))) is list


def test_fast_group_tables_equals_torchrecs() -> None:
    from torchrec.distributed.embedding_sharding import group_tables
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel, ShardedEmbeddingTable

    def tables(n: int) -> list[list[Any]]:
        out: list[list[Any]] = [[] for _ in range(n)]
        for i in range(12):
            out[(i * 7) % n].append(
                ShardedEmbeddingTable(
                    num_embeddings=10 + i,
                    embedding_dim=8 * (1 + i % 3),
                    name=f"t{i}",
                    feature_names=[f"f{i}"],
                    local_rows=10 + i,
                    local_cols=8 * (1 + i % 3),
                    compute_kernel=(
                        EmbeddingComputeKernel.FUSED if i % 2 else EmbeddingComputeKernel.DENSE
                    ),
                )
            )
        return out

    def key(per_rank: list[list[Any]]) -> list[Any]:  # init_fn: a new partial per table
        import dataclasses

        return [
            [
                (
                    {
                        f.name: getattr(g, f.name)
                        for f in dataclasses.fields(g)
                        if f.name != "embedding_tables"
                    },
                    [
                        {
                            f.name: getattr(t, f.name)
                            for f in dataclasses.fields(t)
                            if f.name != "init_fn"
                        }
                        for t in g.embedding_tables
                    ],
                )
                for g in groups
            ]
            for groups in per_rank
        ]

    for n in (1, 5, 64):
        stock, fast = group_tables(tables(n)), kernels.fast_group_tables(tables(n))
        assert len(stock) == len(fast) == n
        assert key(stock) == key(fast)
        assert sum(1 for g in fast if g is kernels.EMPTY) == sum(1 for g in stock if not g)


_FAKE = textwrap.dedent(
    """
    import dataclasses, json, os, sys
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    n, rank, local = (int(x) for x in sys.argv[1:4])
    os.environ.update(LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local), RANK=str(rank))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.types import ShardingEnv
    from fastinit.plan.codec import decode_plan, encode_plan
    from fastinit.sharding.sharders import (
        FastShardedEmbeddingBagCollection, FastShardedEmbeddingCollection)
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.sharding import kernels

    def key(groups):
        out = []
        for g in groups:
            fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)
                      if f.name != "embedding_tables"}
            tables = [{f.name: getattr(t, f.name) for f in dataclasses.fields(t)
                       if f.name != "init_fn"} for t in g.embedding_tables]
            out.append((fields, tables))
        return out

    kinds = ["table_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard"]
    model = build_model(ModelSpec(num_tables=10, num_ec_tables=4, rows=41), device="meta")
    types = {}
    for m in model.modules():
        if hasattr(m, "embedding_bag_configs"):
            for i, c in enumerate(m.embedding_bag_configs()):
                types[c.name] = kinds[i % len(kinds)]
        elif hasattr(m, "embedding_configs"):
            for i, c in enumerate(m.embedding_configs()):
                types[c.name] = ["table_wise", "column_wise"][i % 2]
    env = ShardingEnv(world_size=n, rank=rank, pg=dist.GroupMember.WORLD)
    paths = dict(model.named_modules())
    checked = []

    def plan():
        return decode_plan(encode_plan(build_plan(
            model, types, world_size=n, local_world_size=local)))

    ebc_path, ec_path = list(plan().plan)
    for cls, fast_cls, path, create in (
        (ShardedEmbeddingBagCollection, FastShardedEmbeddingBagCollection, ebc_path,
         lambda c, kind, group: c.create_embedding_bag_sharding(group, env, torch.device("cpu"))),
        (ShardedEmbeddingCollection, FastShardedEmbeddingCollection, ec_path,
         lambda c, kind, group: c.create_embedding_sharding(kind, group, env, torch.device("cpu"))),
    ):
        def infos():
            p = plan().plan[path]
            if cls is ShardedEmbeddingBagCollection:
                return cls.create_grouped_sharding_infos(paths[path], p, "embedding_bags.", None)
            return cls.create_grouped_sharding_infos(paths[path], p, None)
        for (kind, stock_group), (_, fast_group) in zip(infos().items(), infos().items()):
            stock = create(cls, kind, stock_group)
            fast = create(fast_cls, kind, fast_group)
            assert isinstance(fast, type(stock)) and type(fast) is not type(stock), type(fast)
            assert len(fast._grouped_embedding_configs_per_rank) == n
            for r in range(n):
                assert key(fast._grouped_embedding_configs_per_rank[r]) == key(
                    stock._grouped_embedding_configs_per_rank[r]), (kind, r)
            for attr in ("embedding_dims", "embedding_names", "feature_names",
                         "embedding_names_per_rank", "embedding_shard_metadata"):
                try:
                    want = getattr(stock, attr)()
                except NotImplementedError:  # TorchRec's own TWRW, for one
                    continue
                assert getattr(fast, attr)() == want, (kind, attr)
            if hasattr(stock, "_emb_dim_per_rank_per_feature"):
                assert fast._emb_dim_per_rank_per_feature() == stock._emb_dim_per_rank_per_feature()
                assert any(x is kernels.EMPTY for x in fast._emb_dim_per_rank_per_feature())
            assert any(x is kernels.EMPTY for x in fast._grouped_embedding_configs_per_rank)
            checked.append(kind)
    print("@@" + json.dumps(checked))
    """
)


def test_fast_shardings_of_every_other_type_equal_torchrecs_on_the_fake_backend() -> None:
    checked = run_script(_FAKE, 16, 13, 4)
    for kind in ("table_wise", "column_wise", "table_row_wise", "grid_shard"):
        assert kind in checked, checked
