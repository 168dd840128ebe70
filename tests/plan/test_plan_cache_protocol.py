"""TorchRec 1.9's PlanCache protocol: fastinit's cache as one, and setup(plan_cache=<any get/put>).

The protocol (``torchrec/distributed/planner/dry_run/protocols.py``) exists from TorchRec 1.9 on;
the tests that need it skip on 1.8. What ``setup`` does with an object that has ``get``/``put``
needs nothing from TorchRec beyond its ``ShardingPlan`` and runs on both.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchrec")

from torchrec.distributed.types import (  # noqa: E402
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

from fastinit.errors import PlanMismatchError  # noqa: E402
from fastinit.plan.cache import (  # noqa: E402
    FastinitCacheWarning,
    PlanCache,
    TorchRecPlanCache,
    as_plan_cache,
    cache_metadata,
)
from fastinit.plan.codec import encode_plan  # noqa: E402
from fastinit.testing.models import ModelSpec, build_model, build_plan  # noqa: E402


def _protocols() -> Any:
    return pytest.importorskip(
        "torchrec.distributed.planner.dry_run.protocols",
        reason="TorchRec < 1.9 has no PlanCache protocol",
    )


def _plan(rank: int = 0) -> ShardingPlan:
    mp = EmbeddingModuleShardingPlan()
    mp["t0"] = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[rank])
    return ShardingPlan({"ebc": mp})


def _quietly(fn: Any, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


def test_torchrec_plan_cache_is_a_torchrec_plan_cache(tmp_path: Path) -> None:
    protocols = _protocols()
    cache = TorchRecPlanCache(tmp_path / "plans")
    assert isinstance(cache, protocols.PlanCache)
    assert _quietly(cache.get, "f1d63c861288d125") is None
    meta = protocols.CacheMetadata(created_by="me", sku="A100", world_size=8, extra={"a": "b"})
    cache.put("f1d63c861288d125", _plan(1), meta)
    got = _quietly(cache.get, "f1d63c861288d125")
    assert got is not None
    plan, back = got
    assert isinstance(back, protocols.CacheMetadata) and back == meta
    assert encode_plan(plan) == encode_plan(_plan(1))
    assert _quietly(cache.get, "c4f3cb6ff72d339e") is None
    # entries are the directory's own (format and checks), plus a metadata sidecar
    names = sorted(os.listdir(tmp_path / "plans"))
    assert len(names) == 2 and names[0].endswith(".fimeta.json") and names[1].endswith(".fiplan")
    assert names[0].split(".")[0] == names[1].split(".")[0]
    # a second put of another plan replaces both
    cache.put("f1d63c861288d125", _plan(0), protocols.CacheMetadata(sku="H100"))
    plan, back = cache.get("f1d63c861288d125")
    assert encode_plan(plan) == encode_plan(_plan(0)) and back.sku == "H100"
    with pytest.raises(ValueError, match="request fingerprint"):
        cache.get("")


def test_torchrec_plan_cache_survives_a_bad_sidecar_and_a_bad_entry(tmp_path: Path) -> None:
    protocols = _protocols()
    cache = TorchRecPlanCache(tmp_path)
    cache.put("k", _plan(), protocols.CacheMetadata(sku="A100"))
    (sidecar,) = [p for p in tmp_path.iterdir() if p.name.endswith(".fimeta.json")]
    sidecar.write_text("{not json")
    with pytest.warns(FastinitCacheWarning, match="ignoring"):
        plan, meta = cache.get("k")
    assert meta == protocols.CacheMetadata() and encode_plan(plan) == encode_plan(_plan())
    (entry,) = [p for p in tmp_path.iterdir() if p.name.endswith(".fiplan")]
    entry.write_bytes(entry.read_bytes()[:-3])
    with pytest.warns(FastinitCacheWarning, match="ignoring"):
        assert cache.get("k") is None
    # a key of its own: never the entry of a fastinit planner fingerprint
    assert not PlanCache(tmp_path).path(b"k").endswith(entry.name)


def test_torchrec_plan_cache_holds_dry_run_plans(tmp_path: Path) -> None:
    """TorchRec 1.9's dry-run planner (its CLI's ``run``): each SKU's plan cached by its
    ``request_fingerprint``, read back the same."""
    _protocols()
    from torchrec.distributed.planner.dry_run import CacheMetadata, cli

    args = cli.build_arg_parser().parse_args(
        ["--sku-list", "A100,H100", "--world-size", "2", "--num-tables", "3",
         "--num-embeddings", "1000", "--embedding-dim", "16"]
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = cli.run(args)
    cache = TorchRecPlanCache(tmp_path)
    for sku, result in results.items():
        assert result.success and result.sharding_plan is not None, result.planner_failure_reason
        meta = CacheMetadata(created_by="dry-run", sku=sku, world_size=2)
        cache.put(result.request_fingerprint, result.sharding_plan, meta)
    for sku, result in results.items():
        plan, meta = _quietly(TorchRecPlanCache(tmp_path).get, result.request_fingerprint)
        assert meta.sku == sku and meta.world_size == 2
        assert encode_plan(plan) == encode_plan(result.sharding_plan)


class DictCache:
    """Any object with TorchRec's get/put, in memory; records the calls."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[ShardingPlan, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    def get(self, key: str) -> tuple[ShardingPlan, Any] | None:
        self.calls.append(("get", key))
        return self.entries.get(key)

    def put(self, key: str, plan: ShardingPlan, metadata: Any) -> None:
        self.calls.append(("put", key))
        self.entries[key] = (plan, metadata)


def test_as_plan_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTINIT_PLAN_CACHE", raising=False)
    assert as_plan_cache(None, 2) is None
    got = as_plan_cache(tmp_path, 2)
    assert isinstance(got, PlanCache) and got.directory == str(tmp_path)
    mine = PlanCache(tmp_path)
    assert as_plan_cache(mine, 2) is mine
    monkeypatch.setenv("FASTINIT_PLAN_CACHE", str(tmp_path / "env"))
    got = as_plan_cache(None, 2)
    assert isinstance(got, PlanCache) and got.directory == str(tmp_path / "env")
    wrapped = as_plan_cache(DictCache(), 2)
    assert wrapped is not None and not isinstance(wrapped, PlanCache)
    for bad in (42, {"get": 1}, object()):
        with pytest.raises(TypeError, match="plan_cache is a directory"):
            as_plan_cache(bad, 2)


def test_a_get_put_object_is_a_hint_never_an_authority() -> None:
    key = bytes(range(32))
    target = DictCache()
    cache = as_plan_cache(target, 4)
    assert cache is not None
    assert _quietly(cache.get, key) is None
    assert cache.put(key, _plan(1))
    (stored_plan, meta) = target.entries[key.hex()]
    assert meta == cache_metadata(
        created_by="fastinit", world_size=4, extra={"fastinit_key": key.hex()}
    )
    got = _quietly(cache.get, key)
    assert got is not None and got is not stored_plan  # a decoded copy, not the object's
    assert encode_plan(got) == encode_plan(_plan(1))
    target.entries[key.hex()] = stored_plan  # a bare plan is accepted too
    assert encode_plan(_quietly(cache.get, key)) == encode_plan(_plan(1))

    def rejects(plan: ShardingPlan) -> None:
        raise PlanMismatchError("not this model")

    with pytest.warns(FastinitCacheWarning, match="does not fit"):
        assert cache.get(key, accept=rejects) is None
    with pytest.warns(FastinitCacheWarning, match="more than the bound"):
        assert cache.get(key, max_bytes=8) is None
    for junk in ("a plan", (1, 2), {"ebc": {}}):
        target.entries[key.hex()] = junk  # type: ignore[assignment]
        with pytest.warns(FastinitCacheWarning, match="not a ShardingPlan"):
            assert cache.get(key) is None

    class Broken:
        def get(self, key: str) -> Any:
            raise OSError("the store is down")

        def put(self, key: str, plan: ShardingPlan, metadata: Any) -> None:
            raise OSError("the store is down")

    broken = as_plan_cache(Broken(), 2)
    assert broken is not None
    with pytest.warns(FastinitCacheWarning, match="raised OSError"):
        assert broken.get(key) is None
    with pytest.warns(FastinitCacheWarning, match="raised OSError"):
        assert broken.put(key, _plan()) is False


def _setup_with_get_put_objects(cache_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    import fastinit
    from fastinit.plan.cache import TorchRecPlanCache

    spec = ModelSpec(num_tables=4, num_ec_tables=0)
    out: dict[str, Any] = {}

    class Recorder:
        def __init__(self, target: Any) -> None:
            self.target, self.calls = target, []

        def get(self, key: str) -> Any:
            self.calls.append("get")
            return self.target.get(key)

        def put(self, key: str, plan: ShardingPlan, metadata: Any) -> None:
            self.calls.append("put")
            self.target.put(key, plan, metadata)

    first = Recorder(TorchRecPlanCache(cache_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastinitCacheWarning)
        planned = fastinit.setup(build_model(spec, device="meta"), plan_cache=first, seed=1)
    out["first"] = first.calls
    dist.barrier()
    second = Recorder(TorchRecPlanCache(cache_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastinitCacheWarning)
        hit = fastinit.setup(build_model(spec, device="meta"), plan_cache=second, seed=1)
    out["second"] = second.calls
    out["same_plan"] = encode_plan(hit.plan) == encode_plan(planned.plan)
    out["entries"] = sorted(n.rsplit(".", 1)[-1] for n in os.listdir(cache_dir))
    # an object that answers with another model's plan: a miss with one warning, then replaced
    dist.barrier()
    foreign = build_plan(build_model(ModelSpec(num_tables=6, num_ec_tables=0), device="meta"),
                         ["table_wise"], world_size=2)  # fmt: skip

    class Liar:
        def __init__(self) -> None:
            self.put_plan: ShardingPlan | None = None

        def get(self, key: str) -> Any:
            return foreign, None

        def put(self, key: str, plan: ShardingPlan, metadata: Any) -> None:
            self.put_plan = plan

    liar = Liar()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fastinit.setup(build_model(spec, device="meta"), plan_cache=liar, seed=1)
    out["liar_warned"] = [str(w.message) for w in caught if "does not fit" in str(w.message)]
    out["liar_plan"] = encode_plan(model.plan) == encode_plan(planned.plan)
    out["liar_replaced"] = liar.put_plan is not None and (
        encode_plan(liar.put_plan) == encode_plan(planned.plan)
    )
    # not a cache at all: the same clear error on every rank
    try:
        fastinit.setup(build_model(spec, device="meta"), plan_cache=42, seed=1)
    except Exception as e:
        out["bad"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(300)
def test_setup_takes_any_get_put_object(tmp_path: Path) -> None:
    from fastinit.testing.dist import run_ranks

    results = run_ranks(_setup_with_get_put_objects, 2, args=(str(tmp_path / "c"),), timeout=240)
    for rank, out in enumerate(results):
        # a miss: rank 0 plans and puts; rank 1 (LOCAL_RANK 1) only reads
        assert out["first"] == (["get", "put"] if rank == 0 else ["get"]), (rank, out)
        assert out["second"] == ["get"] and out["same_plan"], (rank, out)  # a hit: no put
        assert out["entries"] == ["fiplan", "json"], (rank, out)  # a plan, its metadata
        assert len(out["liar_warned"]) == 1 and out["liar_plan"], (rank, out)
        assert out["liar_replaced"] == (rank == 0), (rank, out)
        assert "plan_cache is a directory" in out["bad"], (rank, out)
