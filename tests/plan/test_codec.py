"""The plan codec: round trips of every ParameterSharding field, determinism, hostile input."""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import json
import logging
import pickle
import random
import struct
import sys
from typing import Any

import pytest

pytest.importorskip("torchrec")

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec  # noqa: E402
from torchrec.distributed.types import (  # noqa: E402
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

from fastinit.plan.codec import (  # noqa: E402
    FORMAT_VERSION,
    MAGIC,
    PlanDecodeError,
    PlanEncodeError,
    decode_plan,
    encode_plan,
    plan_digest,
)
from fastinit.testing.models import SHARDING_TYPES, ModelSpec, build_model, build_plan  # noqa: E402

SPEC = ModelSpec(num_tables=7, num_ec_tables=7, num_weighted_tables=2, fp16_every=3)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, device="meta")


@pytest.fixture(scope="module")
def seven_types_plan(model: Any) -> ShardingPlan:
    return build_plan(model, list(SHARDING_TYPES), world_size=4, local_world_size=2)


@pytest.fixture(scope="module")
def planner_plan(model: Any) -> ShardingPlan:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=4, compute_device="cpu"), debug=False
    )
    return planner.plan(model, [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])


def _hand_plan() -> ShardingPlan:
    """Every optional ParameterSharding field set to a non-default value, nested types too."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        CacheAlgorithm,
        MultiPassPrefetchConfig,
    )
    from fbgemm_gpu.tbe.monitoring import TBEStatsReporterConfig
    from fbgemm_gpu.tbe.ssd.ssd_config import EnrichmentPolicy, EnrichmentType, KVZCHTBEConfig
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torchrec.distributed.types import (
        CacheParams,
        KeyValueParams,
        ObjectPoolShardingPlan,
        ObjectPoolShardingType,
    )
    from torchrec.types import DataType

    spec = EnumerableShardingSpec(
        [
            ShardMetadata([0, 0], [50, 8], "rank:1/cuda:1"),
            ShardMetadata([50, 0], [50, 8], "rank:0/cpu"),
        ]
    )
    cached = ParameterSharding(
        sharding_type="row_wise",
        compute_kernel="fused_uvm_caching",
        ranks=[1, 0],
        sharding_spec=spec,
        cache_params=CacheParams(
            algorithm=CacheAlgorithm.LFU,
            load_factor=0.25,
            reserved_memory=1.5,
            precision=DataType.FP16,
            prefetch_pipeline=True,
            multipass_prefetch_config=MultiPassPrefetchConfig(num_passes=3),
        ),
        enforce_hbm=True,
        stochastic_rounding=False,
        bounds_check_mode=BoundsCheckMode.IGNORE,
        output_dtype=DataType.BF16,
    )
    kv = ParameterSharding(
        sharding_type="table_wise",
        compute_kernel="key_value",
        ranks=[3],
        sharding_spec=EnumerableShardingSpec([ShardMetadata([0, 0], [100, 8], "rank:3/cpu")]),
        key_value_params=KeyValueParams(
            ssd_storage_directory="data00_nvidia@local_rank",
            ssd_rocksdb_shards=4,
            gather_ssd_cache_stats=True,
            stats_reporter_config=TBEStatsReporterConfig(interval=7),
            use_passed_in_path=False,
            l2_cache_size=3,
            ps_hosts=(("::1", 2000), ("::1", 2001)),
            kvzch_tbe_config=KVZCHTBEConfig(
                threshold_calculation_bucket_stride=0.5,
                optimizer_state_dtypes_for_st=frozenset({("momentum1", 1), ("momentum2", 2)}),
                enrichment_policy=EnrichmentPolicy(
                    enrichment_type=EnrichmentType.IGR_LASER_SID, provider_name="p"
                ),
            ),
        ),
        output_dtype=DataType.FP32,
    )
    dp = ParameterSharding(
        sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1, 2, 3]
    )
    emb = EmbeddingModuleShardingPlan()
    emb["cached"] = cached
    emb["kv"] = kv
    emb["dp"] = dp
    pool = ObjectPoolShardingPlan(
        sharding_type=ObjectPoolShardingType.REPLICATED_ROW_WISE,
        inference=True,
        memory_capacity_per_rank=[1, 2],
    )
    return ShardingPlan({"sparse.ebc": emb, "pool": pool})


def assert_plans_equal(a: ShardingPlan, b: ShardingPlan) -> None:
    """Same modules and parameters in the same order, the same module-plan classes, and every
    ParameterSharding field equal by value (ShardMetadata compares by value)."""
    assert list(a.plan) == list(b.plan)
    for path, ma in a.plan.items():
        mb = b.plan[path]
        assert type(ma) is type(mb), path
        if not isinstance(ma, EmbeddingModuleShardingPlan):
            assert ma == mb, path
            continue
        assert list(ma) == list(mb), path
        for name, pa in ma.items():
            pb = mb[name]
            assert type(pb) is ParameterSharding
            for f in dataclasses.fields(ParameterSharding):
                va, vb = getattr(pa, f.name), getattr(pb, f.name)
                if f.name == "sharding_spec" and va is not None:
                    # decoded specs are compact (rules, expanded on demand): equal shards
                    assert isinstance(vb, EnumerableShardingSpec), (path, name)
                    assert va.shards == vb.shards and va == vb and vb == va, (path, name)
                    continue
                assert type(va) is type(vb), (path, name, f.name)
                assert va == vb, (path, name, f.name, va, vb)


def test_seven_types_round_trip(seven_types_plan: ShardingPlan) -> None:
    kinds = {ps.sharding_type for mp in seven_types_plan.plan.values() for ps in mp.values()}
    assert kinds == set(SHARDING_TYPES)
    decoded = decode_plan(encode_plan(seven_types_plan))
    assert_plans_equal(seven_types_plan, decoded)
    # data_parallel tables have no sharding spec; the rest keep theirs
    for mp in decoded.plan.values():
        for ps in mp.values():
            assert (ps.sharding_spec is None) == (ps.sharding_type == "data_parallel")


def test_planner_plan_round_trip(planner_plan: ShardingPlan) -> None:
    assert_plans_equal(planner_plan, decode_plan(encode_plan(planner_plan)))


def test_non_default_fields_round_trip() -> None:
    plan = _hand_plan()
    data = encode_plan(plan)
    decoded = decode_plan(data)
    assert_plans_equal(plan, decoded)
    kv = decoded.plan["sparse.ebc"]["kv"].key_value_params
    assert isinstance(kv.ps_hosts, tuple) and isinstance(kv.ps_hosts[0], tuple)
    opt = kv.kvzch_tbe_config.optimizer_state_dtypes_for_st
    assert isinstance(opt, frozenset) and ("momentum2", 2) in opt
    assert str(decoded.plan["sparse.ebc"]["cached"].sharding_spec.shards[0].placement) == (
        "rank:1/cuda:1"
    )
    assert encode_plan(decoded) == data


def test_header_and_digest(seven_types_plan: ShardingPlan) -> None:
    import hashlib

    data = encode_plan(seven_types_plan)
    assert data.startswith(MAGIC)
    assert struct.unpack(">H", data[len(MAGIC) : len(MAGIC) + 2]) == (FORMAT_VERSION,)
    assert b"pickle" not in data and b"\x80\x04" not in data
    digest = plan_digest(seven_types_plan)
    assert len(digest) == 32 and digest == hashlib.sha256(data).digest()


def test_deterministic_bytes(seven_types_plan: ShardingPlan) -> None:
    data = encode_plan(seven_types_plan)
    assert encode_plan(copy.deepcopy(seven_types_plan)) == data
    assert encode_plan(_hand_plan()) == encode_plan(_hand_plan())
    # the body is canonical JSON: sorted keys, fixed separators
    body = data[len(MAGIC) + 2 :].decode("utf-8")
    assert json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")) == body


def test_module_and_parameter_order_are_kept(seven_types_plan: ShardingPlan) -> None:
    paths = list(seven_types_plan.plan)
    reordered: dict[str, Any] = {}
    for path in reversed(paths):
        mp = seven_types_plan.plan[path]
        flipped = EmbeddingModuleShardingPlan()
        for name in reversed(list(mp)):
            flipped[name] = mp[name]
        reordered[path] = flipped
    other = ShardingPlan(reordered)
    assert encode_plan(other) != encode_plan(seven_types_plan)
    decoded = decode_plan(encode_plan(other))
    assert list(decoded.plan) == list(reversed(paths))
    for path in paths:
        assert list(decoded.plan[path]) == list(reversed(list(seven_types_plan.plan[path])))


def test_unknown_spec_type_fails_clearly() -> None:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    mp = EmbeddingModuleShardingPlan()
    mp["t0"] = ParameterSharding(
        sharding_type="row_wise",
        compute_kernel="fused",
        ranks=[0],
        sharding_spec=ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]),
    )
    with pytest.raises(PlanEncodeError, match=r"sharding_spec.*ChunkShardingSpec"):
        encode_plan(ShardingPlan({"m": mp}))


def test_user_cache_statistics_fail_clearly() -> None:
    from torchrec.distributed.types import CacheParams, CacheStatistics

    class Stats(CacheStatistics):
        expected_lookups = 1.0
        cacheability = 0.5

        def expected_miss_rate(self, clf: float) -> float:
            return 0.1

    mp = EmbeddingModuleShardingPlan()
    mp["t0"] = ParameterSharding(
        sharding_type="data_parallel",
        compute_kernel="dense",
        cache_params=CacheParams(stats=Stats()),
    )
    with pytest.raises(PlanEncodeError, match=r"cache_params\.stats"):
        encode_plan(ShardingPlan({"m": mp}))


# ---- hostile and malformed input ------------------------------------------------------------


def _with_body(body: Any) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body)
    return MAGIC + struct.pack(">H", FORMAT_VERSION) + text.encode("utf-8")


def _body(plan: ShardingPlan) -> Any:
    return json.loads(encode_plan(plan)[len(MAGIC) + 2 :])


def test_truncated_wrong_magic_wrong_version() -> None:
    data = encode_plan(_hand_plan())
    for cut in (0, 3, len(MAGIC), len(MAGIC) + 1, len(MAGIC) + 2, len(MAGIC) + 10, len(data) - 1):
        with pytest.raises(PlanDecodeError):
            decode_plan(data[:cut])
    with pytest.raises(PlanDecodeError, match="truncated"):
        decode_plan(data[: len(data) // 2])
    with pytest.raises(PlanDecodeError, match="magic"):
        decode_plan(b"XXPLAN\x00" + data[len(MAGIC) :])
    with pytest.raises(PlanDecodeError, match="version 3"):
        decode_plan(MAGIC + struct.pack(">H", 3) + data[len(MAGIC) + 2 :])
    with pytest.raises(PlanDecodeError, match="magic"):
        decode_plan(pickle.dumps(_hand_plan()))
    with pytest.raises(PlanDecodeError):
        decode_plan(MAGIC + struct.pack(">H", FORMAT_VERSION) + pickle.dumps(_hand_plan()))
    assert issubclass(PlanDecodeError, ValueError)


def test_random_bytes_never_decode() -> None:
    rng = random.Random(0)
    header = MAGIC + struct.pack(">H", FORMAT_VERSION)
    for i in range(300):
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        with pytest.raises(PlanDecodeError):
            decode_plan(junk if i % 2 else header + junk)


def test_bit_flips_decode_or_fail_cleanly() -> None:
    data = bytearray(encode_plan(_hand_plan()))
    rng = random.Random(1)
    for _ in range(200):
        mutated = bytearray(data)
        pos = rng.randrange(len(MAGIC) + 2, len(mutated))
        mutated[pos] = rng.getrandbits(8)
        with contextlib.suppress(PlanDecodeError):  # the only exception allowed
            decode_plan(bytes(mutated))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda ps: ps["$f"].__setitem__("ranks", "0,1"), "ranks"),
        (lambda ps: ps["$f"].__setitem__("ranks", [0, "1"]), "ranks"),
        (lambda ps: ps["$f"].__setitem__("sharding_type", 5), "sharding_type"),
        (lambda ps: ps["$f"].__setitem__("enforce_hbm", 1), "enforce_hbm"),
        (lambda ps: ps["$f"].__setitem__("unknown_field", 1), "unknown_field"),
        (lambda ps: ps["$f"].__setitem__("output_dtype", {"$e": "DataType", "$v": "FP99"}), "FP99"),
        (
            lambda ps: ps["$f"].__setitem__("output_dtype", {"$e": "os.system", "$v": "x"}),
            "allowlist",
        ),
        (lambda ps: ps["$f"].__setitem__("cache_params", {"$t": "Nope", "$f": {}}), "allowlist"),
        (lambda ps: ps["$f"].__setitem__("cache_params", {"$weird": 1}), "keys"),
        (lambda ps: ps.__setitem__("$t", "CacheParams"), "ParameterSharding|field"),
        (lambda ps: ps["$f"].pop("compute_kernel"), "compute_kernel"),
    ],
)
def test_wrong_types_raise(edit: Any, message: str) -> None:
    body = _body(_hand_plan())
    edit(body["plan"][0][1]["$items"][0][1])
    with pytest.raises(PlanDecodeError, match=message):
        decode_plan(_with_body(body))


def test_structure_errors_raise() -> None:
    good = _body(_hand_plan())
    bodies: list[Any] = [
        [],
        {"plan": {}},
        {"plan": [["m"]]},
        {"plan": [[1, {"$t": "EmbeddingModuleShardingPlan", "$items": []}]]},
        {"plan": [["m", {"$t": "dict", "$items": []}]]},
        {"plan": [["m", {"$t": "EmbeddingModuleShardingPlan", "$items": [["t", 1]]}]]},
        {"plan": [["m", {"$t": "EmbeddingModuleShardingPlan", "$items": {}}]]},
        {"plan": [good["plan"][0], good["plan"][0]]},  # a module twice
        {"plan": good["plan"], "extra": 1},
        "[" * 100_000 + "]" * 100_000,  # nested too deeply
        '{"plan": NaN}',
        b"\xff\xfe".decode("latin-1"),
    ]
    for body in bodies:
        with pytest.raises(PlanDecodeError):
            decode_plan(_with_body(body))


class _Canary:
    constructed = False

    def __init__(self, **kwargs: Any) -> None:
        _Canary.constructed = True


def test_named_classes_are_never_imported_or_built(monkeypatch: pytest.MonkeyPatch) -> None:
    canary_module = "fastinit_codec_canary_module"
    requested: list[str] = []
    real_import = builtins.__import__

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        requested.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    hostile = [
        {"$t": f"{__name__}._Canary", "$f": {}},
        {"$t": "_Canary", "$f": {}},
        {"$t": f"{canary_module}.Thing", "$f": {}},
        {"$t": "builtins.eval", "$f": {"source": "1"}},
        {"$t": "os.system", "$f": {"command": "touch /tmp/fastinit-pwned"}},
        {"$t": "subprocess.Popen", "$f": {"args": ["true"]}},
        {"$e": f"{canary_module}.Enum", "$v": "A"},
        {"py/object": "os.system"},
        {"__reduce__": ["os.system", ["true"]]},
    ]
    for obj in hostile:
        body = _body(_hand_plan())
        body["plan"][0][1]["$items"][0][1]["$f"]["cache_params"] = obj
        with pytest.raises(PlanDecodeError):
            decode_plan(_with_body(body))
        body = {"plan": [["m", obj]]}
        with pytest.raises(PlanDecodeError):
            decode_plan(_with_body(body))
    assert not _Canary.constructed
    assert canary_module not in sys.modules
    assert not any(canary_module in name for name in requested)
