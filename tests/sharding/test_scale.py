"""Per-rank work flat in world size: compact shard layouts, their codec, and the own-rank
construction (fast shardings and ShardedTensors equal to stock's)."""

from __future__ import annotations

import copy
import json
import pickle
import struct
import textwrap
from typing import Any

import pytest

pytest.importorskip("torchrec")

from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec  # noqa: E402

from fastinit.errors import PlanMismatchError  # noqa: E402
from fastinit.plan import layout  # noqa: E402
from fastinit.plan.codec import (  # noqa: E402
    FORMAT_VERSION,
    MAGIC,
    PlanDecodeError,
    decode_plan,
    encode_plan,
)
from fastinit.plan.compact import CompactShardingSpec, validate_compact  # noqa: E402
from fastinit.testing.models import SHARDING_TYPES, ModelSpec, build_model, build_plan  # noqa: E402

SPEC = ModelSpec(num_tables=7, num_ec_tables=7, rows=300)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, device="meta")


def _specs(plan: Any) -> list[tuple[str, Any]]:
    return [
        (f"{path}.{name}", ps.sharding_spec)
        for path, mp in plan.plan.items()
        for name, ps in mp.items()
        if ps.sharding_spec is not None
    ]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_compact_plan_equals_stock_and_stays_small(model: Any, device_type: str) -> None:
    sizes = {}
    for n, local in [(1, 1), (3, 3), (8, 4), (64, 8), (512, 8)]:
        types = list(SHARDING_TYPES) if n > 1 else ["table_wise", "row_wise", "data_parallel"]
        plan = build_plan(
            model, types, world_size=n, local_world_size=local, device_type=device_type
        )
        data = encode_plan(plan)
        sizes[n] = len(data)
        decoded = decode_plan(data)
        assert encode_plan(decoded) == data  # same plan, same bytes, compact or not
        assert encode_plan(copy.deepcopy(decoded)) == data
        assert encode_plan(pickle.loads(pickle.dumps(decoded))) == data
        for (where, spec), (_, got) in zip(_specs(plan), _specs(decoded), strict=True):
            assert isinstance(got, CompactShardingSpec), where
            assert not got.expanded
            for rank in {0, 1 % n, n // 2, n - 1}:
                mine = [(i, s) for i, s in enumerate(spec.shards) if s.placement.rank() == rank]
                assert got.shards_of_rank(rank) == mine, (where, rank)
            assert got.shard_ranks() == [s.placement.rank() for s in spec.shards]
            assert got.num_shards() == len(spec.shards)
            assert got == spec and spec == got and got.shards == spec.shards, where
            assert [str(s.placement) for s in got.shards] == [str(s.placement) for s in spec.shards]
        for path, mp in plan.plan.items():
            for name, ps in mp.items():
                assert decoded.plan[path][name] == ps, (path, name)
    # The encoding does not grow with the world size (row-wise is a few runs at any size).
    assert sizes[512] < 1.3 * sizes[8], sizes


def test_runs_are_few_for_regular_layouts(model: Any) -> None:
    plan = build_plan(model, list(SHARDING_TYPES), world_size=4096, local_world_size=8)
    for where, spec in _specs(plan):
        runs = layout.runs_of(spec.shards)
        layout.check_runs(runs)
        assert len(runs) <= 6, (where, runs)
        assert CompactShardingSpec(runs).shards == spec.shards


def _encoded_with_runs(runs: list[list[Any]]) -> bytes:
    plan = {
        "plan": [
            [
                "m",
                {
                    "$t": "EmbeddingModuleShardingPlan",
                    "$items": [
                        [
                            "t",
                            {
                                "$t": "ParameterSharding",
                                "$f": {
                                    "sharding_type": "row_wise",
                                    "compute_kernel": "fused",
                                    "ranks": [0, 1],
                                    "sharding_spec": {
                                        "$t": "EnumerableShardingSpec",
                                        "$f": {"shards": {"$runs": runs}},
                                    },
                                },
                            },
                        ]
                    ],
                },
            ]
        ]
    }
    body = json.dumps(plan, sort_keys=True, separators=(",", ":"))
    return MAGIC + struct.pack(">H", FORMAT_VERSION) + body.encode()


def test_hostile_or_non_canonical_runs_are_rejected() -> None:
    good = [[2, [5, 4], [0, 0], [5, 0], 0, 1, "cpu", 0]]
    decode_plan(_encoded_with_runs(good))
    bad = {
        "split run": [
            [1, [5, 4], [0, 0], [0, 0], 0, 0, "cpu", 0],
            [1, [5, 4], [5, 0], [0, 0], 1, 0, "cpu", 0],
        ],
        "count 0": [[0, [5, 4], [0, 0], [5, 0], 0, 1, "cpu", 0]],
        "negative": [[2, [5, 4], [0, -1], [5, 0], 0, 1, "cpu", 0]],
        "too many": [[1 << 30, [1, 4], [0, 0], [1, 0], 0, 1, "cpu", 0]],
        "wrong modulus": [[2, [5, 4], [0, 0], [5, 0], 0, 1, "cuda", 7]],
        "literal indexed": [[1, [5, 4], [0, 0], [0, 0], 0, 0, "cuda:0", 0]],
        "dims": [[2, [5, 4], [0], [5, 0], 0, 1, "cpu", 0]],
        "types": [[2, [5, 4], [0, 0], [5, 0], "0", 1, "cpu", 0]],
        "short": [[2, [5, 4], [0, 0]]],
        "empty": [],
    }
    for why, runs in bad.items():
        with pytest.raises(PlanDecodeError):
            decode_plan(_encoded_with_runs(runs))
            pytest.fail(why)


def test_range_lists_are_canonical() -> None:
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ParameterSharding,
        ShardingPlan,
    )

    mp = EmbeddingModuleShardingPlan()
    mp["t"] = ParameterSharding(
        sharding_type="data_parallel", compute_kernel="dense", ranks=list(range(4096))
    )
    data = encode_plan(ShardingPlan({"m": mp}))
    assert len(data) < 400 and b"$range" in data
    assert decode_plan(data).plan["m"]["t"].ranks == list(range(4096))
    spelled = data.replace(
        b'{"$range":[0,4096,1]}', json.dumps(list(range(4096))).replace(" ", "").encode()
    )
    with pytest.raises(PlanDecodeError, match="range"):
        decode_plan(spelled)
    for args in ([0, 3, 1], [0, 10, 0], [0, 10**9, 1], [0, 5, 2]):
        bad = data.replace(b"[0,4096,1]", json.dumps(args).replace(" ", "").encode())
        with pytest.raises(PlanDecodeError):
            decode_plan(bad)


def test_validate_compact() -> None:
    def spec(*runs: layout.ShardRun) -> Any:
        return CompactShardingSpec(runs)

    rw = spec(
        layout.ShardRun(3, (4, 8), (0, 0), (4, 0), 0, 1, "cpu", 0),
        layout.ShardRun(1, (2, 8), (12, 0), (0, 0), 3, 0, "cpu", 0),
    )
    assert validate_compact(rw, (14, 8), "t")
    with pytest.raises(PlanMismatchError, match="outside"):
        validate_compact(rw, (13, 8), "t")
    with pytest.raises(PlanMismatchError, match="cover"):
        validate_compact(rw, (15, 8), "t")
    overlap = spec(layout.ShardRun(2, (4, 8), (0, 0), (2, 0), 0, 1, "cpu", 0))
    with pytest.raises(PlanMismatchError, match="overlap"):
        validate_compact(overlap, (6, 8), "t")
    interleaved = spec(
        layout.ShardRun(2, (1, 8), (0, 0), (2, 0), 0, 1, "cpu", 0),
        layout.ShardRun(2, (1, 8), (1, 0), (2, 0), 2, 1, "cpu", 0),
    )
    assert validate_compact(interleaved, (4, 8), "t")
    clash = spec(
        layout.ShardRun(2, (1, 8), (0, 0), (2, 0), 0, 1, "cpu", 0),
        layout.ShardRun(2, (1, 8), (0, 0), (3, 0), 2, 1, "cpu", 0),
    )
    with pytest.raises(PlanMismatchError):
        validate_compact(clash, (5, 8), "t")
    stock = EnumerableShardingSpec([ShardMetadata([0, 0], [4, 8], "rank:0/cpu")])
    assert not validate_compact(stock, (4, 8), "t")  # the caller checks it per shard


# ---- construction on the fake backend (one process, N ranks) ---------------------------------

_FAKE = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg
    from torch.testing._internal.distributed.fake_pg import FakeStore
    n, rank = int(sys.argv[1]), int(sys.argv[2])
    dist.Backend.register_backend("fakestate", fake_pg._create_fake_pg, extended_api=True, devices=["cpu"])
    dist.init_process_group("fakestate", store=FakeStore(), rank=rank, world_size=n)
    from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
    from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
    from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
    from torchrec.distributed.types import ShardingEnv
    from torch.distributed._shard.sharded_tensor import ShardedTensor, Shard, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from fastinit.sharding import local
    import dataclasses

    def key(groups):
        # init_fn is a fresh functools.partial per ShardedEmbeddingTable (stock's too)
        out = []
        for g in groups:
            fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name != "embedding_tables"}
            tables = [{f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name != "init_fn"} for t in g.embedding_tables]
            out.append((fields, tables))
        return out
    from fastinit.plan.codec import decode_plan, encode_plan
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    model = build_model(ModelSpec(num_tables=4, num_ec_tables=2, rows=37), device="meta")
    plan = decode_plan(encode_plan(build_plan(model, ["row_wise", "data_parallel"], world_size=n, local_world_size=4 if n % 4 == 0 else 1)))
    env = ShardingEnv(world_size=n, rank=rank, pg=dist.GroupMember.WORLD)
    paths = dict(model.named_modules())
    ebc_path, ec_path = list(plan.plan)
    infos = ShardedEmbeddingBagCollection.create_grouped_sharding_infos(
        paths[ebc_path], plan.plan[ebc_path], "embedding_bags.", None
    )
    checked = 0
    for kind, group in infos.items():
        stock_cls = {"row_wise": RwPooledEmbeddingSharding, "data_parallel": DpPooledEmbeddingSharding}[kind]
        fast = local.embedding_bag_sharding(group, env, torch.device("cpu"), None)
        lazy = local.embedding_bag_sharding(group, env, torch.device("cpu"), None)  # never compared
        stock = stock_cls(group, env, torch.device("cpu"))  # builds the plan's shard lists
        assert type(fast).__mro__[2] is stock_cls, type(fast)
        assert key(fast._grouped_embedding_configs) == key(stock._grouped_embedding_configs)
        for r in (0, rank, n - 1):
            assert key(fast._grouped_embedding_configs_per_rank[r]) == key(stock._grouped_embedding_configs_per_rank[r])
        assert len(fast._grouped_embedding_configs_per_rank) == n
        for attr in ("embedding_dims", "embedding_names", "feature_names", "embedding_shard_metadata"):
            assert getattr(fast, attr)() == getattr(stock, attr)(), attr
        if kind == "row_wise":
            assert fast.embedding_names_per_rank() == stock.embedding_names_per_rank()
            assert fast._get_feature_hash_sizes() == stock._get_feature_hash_sizes()
            # comparing with stock's lists above built those shard lists: not this one's
            table = lazy.embedding_tables()[0]
            md = table.global_metadata
            import copy
            deep = copy.deepcopy(md)
            assert type(md.shards_metadata).__name__ == "LazyShards"
            assert deep == md and deep.shards_metadata[0] is not md.shards_metadata[0]
            md = ShardedTensorMetadata(md.shards_metadata, md.size, TensorProperties(dtype=torch.float32))
            local_md = md.shards_metadata[rank]
            shards = [Shard(torch.zeros(local_md.shard_sizes), local_md)]
            fast = local.fast_sharded_tensor
            b = fast(shards, md)
            c = fast(shards, md)
            assert not md.shards_metadata.expanded  # checked on the rule, the list never built
            a = ShardedTensor._init_from_local_shards_and_global_metadata(shards, md)
            bad = ShardedTensorMetadata(md.shards_metadata, torch.Size([md.size[0] - 1, md.size[1]]), md.tensor_properties)
            for call, err in ((fast, ValueError), (ShardedTensor._init_from_local_shards_and_global_metadata, ValueError)):
                try:
                    call(shards, bad)
                    raise AssertionError("bounds not checked")
                except err:
                    pass
            try:
                fast([], md)
                raise AssertionError("local count not checked")
            except RuntimeError:
                pass
            for x in (b, c):
                assert type(x) is type(a)
                assert x.metadata() == a.metadata() and x.sharding_spec() == a.sharding_spec()
                assert [s.metadata for s in x.local_shards()] == [s.metadata for s in a.local_shards()]
        checked += 1
    ec_group = ShardedEmbeddingCollection.create_grouped_sharding_infos(
        paths[ec_path], plan.plan[ec_path], None
    )
    for kind, group in ec_group.items():
        fast = local.embedding_sharding(kind, group, env, torch.device("cpu"), None)
        if kind == "row_wise":
            stock = RwSequenceEmbeddingSharding(sharding_infos=group, env=env, device=torch.device("cpu"))
            assert key(fast._grouped_embedding_configs) == key(stock._grouped_embedding_configs)
            checked += 1
    print("@@" + json.dumps({"checked": checked}))
    """
)


def test_fast_shardings_and_sharded_tensors_equal_stock_on_the_fake_backend() -> None:
    from fastinit.testing.dist import run_script

    for n, rank in [(8, 5), (13, 12)]:
        assert run_script(_FAKE, n, rank)["checked"] == 3


# ---- the benchmark ----------------------------------------------------------------------------


def test_fit_exponent_and_table() -> None:
    from benchmarks.scale.main import fit_exponent, format_table

    flat = [(n, 3.0) for n in (512, 1024, 4096, 8192)]
    assert fit_exponent(flat, 512, 8192) == pytest.approx(0.0)
    linear = [(n, n / 100) for n in (64, 512, 1024, 8192)]
    assert fit_exponent(linear, 512, 8192) == pytest.approx(1.0)
    assert fit_exponent([(64, 1.0)], 512, 8192) is None
    row = {"world_size": 64, "mode": "fastinit", "setup_s": 1.0, "peak_rss_mb": 300.0}
    text = format_table(
        {
            "model": "m",
            "plan": "p",
            "notes": "n",
            "details": [
                dict(row, plan_bytes=10, samples_s=[0.9, 1.0, 1.2], samples_gc_s=[0, 0, 0.2]),
                dict(
                    row,
                    mode="explicit",
                    setup_s=1.5,
                    plan_bytes=0,
                    torchrec_plan_s=2.0,
                    samples_s=[1.4, 1.5, 1.6],
                    samples_gc_s=[0.1, 0.3, 0.5],
                ),
            ],
            "same_as_stock": [],
            "errors": [],
            "exponent_512_8192": None,
        }
    )
    assert "| 64 | 1.00 | 0.90/1.00/1.20 | 0.00/0.00/0.20 | 300 | 10 |" in text
    # the explicit plan's runs and the garbage collector's share of each
    assert "| 10 | 1.50 | 1.40/1.50/1.60 | 0.10/0.30/0.50 | 2.00 |" in text


@pytest.mark.slow
def test_scale_benchmark_quick(tmp_path: Any) -> None:
    from benchmarks.scale.main import main

    result = main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "scale.json").read_text())
    assert set(data) >= {"model", "rows"} and data["model"] == result["model"]
    modes = {(r["world_size"], r["mode"]) for r in data["rows"]}
    assert modes == {(16, "fastinit"), (64, "fastinit"), (16, "stock"), (64, "stock")}
    for r in data["rows"]:
        assert set(r) == {"world_size", "mode", "setup_s", "peak_rss_mb"}
        assert r["setup_s"] > 0 and r["peak_rss_mb"] > 0
    assert (tmp_path / "scale.png").stat().st_size > 0
