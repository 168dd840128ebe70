"""Layouts held as rules: LazyShards behaves as the shard list, and every answer
fastinit.sharding.rules computes from the runs is the one torch and TorchRec compute from the
shards."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec
from torch.distributed._shard.sharding_spec.api import _infer_sharding_spec_from_shards_metadata

from fastinit.plan.layout import Expansions, LazyShards, runs_of
from fastinit.sharding import rules


def _md(offsets: list[int], sizes: list[int], rank: int, device: str = "cpu") -> ShardMetadata:
    return ShardMetadata(offsets, sizes, f"rank:{rank}/{device}")


def _row_wise(rows: int, dim: int, world: int, first: int = 0, device: str = "cpu") -> list[Any]:
    block = -(-rows // world)
    out = []
    for r in range(world):
        start = min(r * block, rows)
        size = max(min(block, rows - start), 0)
        dev = f"{device}:{(first + r) % 8}" if device == "cuda" else device
        out.append(_md([start, 0], [size, dim], first + r, dev))
    return out


def _column_wise(rows: int, dim: int, ranks: list[int]) -> list[Any]:
    width = dim // len(ranks)
    return [_md([0, i * width], [rows, width], r) for i, r in enumerate(ranks)]


def _grid(rows: int, dim: int, hosts: int, cols: int) -> list[Any]:
    width = dim // cols
    block = -(-rows // hosts)
    return [
        _md([h * block, c * width], [min(block, rows - h * block), width], c * hosts + h)
        for c in range(cols)
        for h in range(hosts)
    ]


LAYOUTS: dict[str, tuple[list[Any], tuple[int, int]]] = {
    "row_wise": (_row_wise(37, 16, 8), (37, 16)),
    "row_wise_even": (_row_wise(64, 8, 8), (64, 8)),
    "row_wise_empty_tail": (_row_wise(10, 4, 8), (10, 4)),
    "row_wise_cuda": (_row_wise(1000, 4, 16, device="cuda"), (1000, 4)),
    "table_row_wise": (_row_wise(100, 8, 8, first=8), (100, 8)),
    "column_wise": (_column_wise(20, 64, [3, 1, 2, 0]), (20, 64)),
    "table_wise": ([_md([0, 0], [50, 8], 5)], (50, 8)),
    "grid": (_grid(30, 32, 4, 2), (30, 32)),
    "descending": (list(reversed(_row_wise(40, 4, 4))), (40, 4)),
    "rows_then_columns": (
        [_md([0, 0], [10, 4], 0), _md([10, 0], [10, 4], 1), _md([0, 4], [20, 4], 2)],
        (20, 8),
    ),
}


def _lazy(shards: list[Any]) -> LazyShards:
    return LazyShards(runs_of(shards), Expansions())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lazy_shards_behave_as_the_list(name: str) -> None:
    shards, _ = LAYOUTS[name]
    lazy = _lazy(shards)
    assert len(lazy) == len(shards) and not lazy.expanded
    one = lazy[len(shards) // 2]
    assert one == shards[len(shards) // 2] and lazy[-1] == shards[-1] and not lazy.expanded
    with pytest.raises(IndexError):
        lazy[len(shards)]
    assert lazy == shards and shards == lazy
    assert (lazy != shards) is False
    assert lazy.expanded and lazy[len(shards) // 2] is one  # the item handed out is the one kept
    assert list(lazy) == shards and lazy[1:] == shards[1:] and lazy + [] == shards
    assert pickle.loads(pickle.dumps(lazy)) == shards
    assert type(pickle.loads(pickle.dumps(lazy))) is list

    fresh = _lazy(shards)
    deep = copy.deepcopy(fresh)
    assert deep == fresh and not fresh.expanded
    deep[0].shard_sizes[0] += 1  # a deep copy's shards are its own
    assert fresh[0] == shards[0] and deep[0] != shards[0]
    shallow = copy.copy(fresh)
    assert shallow[0] is fresh[0]
    fresh.append(shards[0])
    assert len(fresh) == len(shards) + 1


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_inferred_spec_is_torchs(name: str) -> None:
    shards, _ = LAYOUTS[name]
    lazy = _lazy(shards)
    ours = rules.infer_spec(lazy)
    theirs = _infer_sharding_spec_from_shards_metadata(copy.deepcopy(shards))
    if ours is None:  # the runs do not decide it: the caller builds the list
        assert name in {"descending", "rows_then_columns"}, name  # shards not in offset order
        return
    assert not lazy.expanded
    assert type(ours) is type(theirs), (name, ours, theirs)
    if isinstance(theirs, ChunkShardingSpec):
        assert ours.dim == theirs.dim
        assert [str(p) for p in ours.placements] == [str(p) for p in theirs.placements]
    else:
        assert isinstance(ours, EnumerableShardingSpec)
        assert list(ours.shards) == list(theirs.shards)
    size = torch.Size(LAYOUTS[name][1])
    built = theirs.build_metadata(size, ShardedTensorMetadata().tensor_properties)
    assert built.shards_metadata == shards  # what fastinit holds unbuilt is what torch builds


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_local_count_and_index_of(name: str) -> None:
    shards, _ = LAYOUTS[name]
    lazy = _lazy(shards)
    ranks = {md.placement.rank() for md in shards}
    for rank in sorted(ranks) + [99]:
        want = sum(1 for md in shards if md.placement.rank() == rank)
        assert rules.local_count(lazy.runs, rank) == want
    for i, md in enumerate(shards):
        assert rules.index_of(lazy, copy.deepcopy(md)) == i  # by value
        assert rules.index_of(lazy, lazy[i]) == i  # by identity
    assert rules.ranks_in(lazy.runs, frozenset(ranks), min(ranks), max(ranks)) is None
    missing = frozenset(ranks - {max(ranks)})
    if missing:
        assert rules.ranks_in(lazy.runs, missing, min(missing), max(missing)) == max(ranks)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "kind,state_shape",
    [("single", (1,)), ("rowwise", "rows"), ("pointwise", "shard")],
)
def test_optimizer_state_layouts_are_torchrecs(
    name: str, kind: str, state_shape: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastinit.sharding.mirror.batched_embedding_kernel import _optimizer_state_metadata

    monkeypatch.setattr("torchrec.distributed.comm.get_node_group_size", lambda *a: 4)
    shards, size = LAYOUTS[name]
    for sharding_dim, is_grid in ((0, False), (1, False), (1, True)):
        state = torch.zeros(1 if kind == "single" else 4, *([4] if kind == "pointwise" else []))
        if kind == "single":
            state = torch.zeros(1)
        table = ShardedTensorMetadata(list(shards), torch.Size(size))
        lazy_table = ShardedTensorMetadata(_lazy(shards), torch.Size(size))  # type: ignore[arg-type]
        # the per-shard path (TorchRec's arithmetic, checked against stock end to end by the
        # equivalence tests) against the rule path
        want_layout, want = _optimizer_state_metadata(kind, table, state, sharding_dim, is_grid)
        got_layout, got = _optimizer_state_metadata(kind, lazy_table, state, sharding_dim, is_grid)
        # the rule path, not the per-shard one the lazy list could fall back to
        assert type(got_layout).__name__ == "_RuledStateLayout", (name, kind, sharding_dim)
        assert isinstance(got.shards_metadata, LazyShards) and not got.shards_metadata.expanded
        assert got.size == want.size and got.tensor_properties == want.tensor_properties
        assert list(got.shards_metadata) == list(want.shards_metadata), (name, sharding_dim)
        for md in shards:
            assert got_layout.of(md) == want_layout.of(md)
