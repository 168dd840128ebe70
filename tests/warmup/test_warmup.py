"""fastinit.warmup: stage graph, fast batch, side-effect-free warm-up, compile cache, resume."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from fastinit.testing.dist import run_ranks

# -- stage graph (no processes) ----------------------------------------------------------------


def _after(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


def test_import_loads_no_torch() -> None:
    code = "import sys, fastinit.warmup as w; w.StageGraph; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_graph_runs_ready_stages_concurrently_and_passes_results() -> None:
    from fastinit import trace
    from fastinit.warmup import StageGraph

    graph = StageGraph()
    graph.add("a", lambda: _after(0.4, 2))
    graph.add("b", lambda: _after(0.4, 3))
    graph.add("c", lambda a, b: a * b, deps=("a", "b"))
    with trace.Tracer(comm=False) as tracer:
        start = time.perf_counter()
        results = graph.run()
        elapsed = time.perf_counter() - start
    assert results == {"a": 2, "b": 3, "c": 6}
    assert elapsed < 0.75, elapsed  # sequential would be 0.8 s
    spans = {e["name"]: e for e in tracer.events if e["kind"] == "span"}
    assert set(spans) == {"a", "b", "c"}
    a, b = spans["a"], spans["b"]
    assert a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]  # they overlap
    assert spans["c"]["ts"] >= max(a["ts"] + a["dur"], b["ts"] + b["dur"]) - 1e3


def test_graph_rejects_bad_declarations() -> None:
    from fastinit.warmup import GraphConfig, StageGraph

    graph = StageGraph()
    graph.add("a", lambda: None)
    with pytest.raises(ValueError, match="declared twice"):
        graph.add("a", lambda: None)
    with pytest.raises(ValueError, match="undeclared"):
        graph.add("b", lambda x: x, deps=("later",))
    with pytest.raises(ValueError):
        GraphConfig(max_workers=0)


def test_collective_lane_is_one_thread_in_declaration_order() -> None:
    from fastinit.warmup import StageGraph

    seen: list[tuple[str, str]] = []

    def collective(name: str) -> Any:
        def fn(*_: Any) -> str:
            seen.append((name, threading.current_thread().name))
            return name

        return fn

    graph = StageGraph()
    graph.add("slow", lambda: time.sleep(0.3))
    graph.add("fast", lambda: None)
    graph.add("c1", collective("c1"), deps=("slow",), collective=True)
    graph.add("c2", collective("c2"), deps=("fast",), collective=True)  # ready first, runs second
    graph.add("c3", collective("c3"), collective=True)
    assert graph.collective_order() == ["c1", "c2", "c3"]
    graph.run()
    assert [name for name, _ in seen] == ["c1", "c2", "c3"]
    assert {thread for _, thread in seen} == {"fastinit-collective-lane"}


def test_first_failure_cancels_pending_and_raises_stage_error() -> None:
    from fastinit.warmup import GraphConfig, StageError, StageGraph

    ran: list[str] = []

    def boom() -> None:
        time.sleep(0.05)
        raise ValueError("bad input")

    graph = StageGraph(GraphConfig(rank=3))
    graph.add("boom", boom)

    def running() -> None:
        time.sleep(0.3)
        ran.append("running")

    graph.add("running", running)
    graph.add("after", lambda _: ran.append("after"), deps=("boom",))
    graph.add("lane", lambda _: ran.append("lane"), deps=("boom",), collective=True)
    with pytest.raises(StageError) as info:
        graph.run()
    err = info.value
    assert (err.stage, err.rank) == ("boom", 3)
    assert isinstance(err.__cause__, ValueError)
    assert "'boom'" in str(err) and "rank 3" in str(err)
    assert ran == ["running"]  # drained, not killed; dependents never started


def test_hung_stage_is_bounded() -> None:
    from fastinit.warmup import GraphConfig, StageError, StageGraph

    release = threading.Event()
    graph = StageGraph(GraphConfig(timeout_s=0.5, drain_timeout_s=0.2, rank=0))
    graph.add("hangs", lambda: release.wait(60))
    graph.add("fine", lambda: 1)
    start = time.perf_counter()
    with pytest.raises(StageError) as info:
        graph.run()
    release.set()
    assert time.perf_counter() - start < 2.0
    assert info.value.stage == "hangs"
    assert isinstance(info.value.__cause__, TimeoutError)


# -- stage graph on two gloo ranks -------------------------------------------------------------


def _ordering_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fastinit import trace
    from fastinit.warmup import StageGraph

    rank = dist.get_rank()
    finished: list[str] = []
    lock = threading.Lock()

    def local(name: str, seconds: float) -> Any:
        def fn() -> str:
            time.sleep(seconds)
            with lock:
                finished.append(name)
            return name

        return fn

    def collective(index: int) -> Any:
        def fn(*_: Any) -> float:
            # A different size per stage: a mismatched order would fail or give wrong sums.
            t = torch.full((index + 1,), float(index * 10 + rank + 1))
            dist.all_reduce(t)
            return float(t[0])

        return fn

    slow, fast = (0.6, 0.05) if rank == 0 else (0.05, 0.6)
    graph = StageGraph()
    graph.add("data", local("data", slow))
    graph.add("model", local("model", fast))
    graph.add("sync_data", collective(0), deps=("data",), collective=True)
    graph.add("sync_model", collective(1), deps=("model",), collective=True)
    graph.add("sync_all", collective(2), deps=("data", "model"), collective=True)
    results = graph.run()
    tracer = trace.active()
    assert tracer is not None
    c10d = [(e["name"], e["thread"]) for e in tracer.events if e["kind"] == "c10d"]
    spans = [e["name"] for e in sorted(tracer.events, key=lambda e: e["ts"]) if e["kind"] == "span"]
    return {
        "finished": finished,
        "sums": [results[k] for k in ("sync_data", "sync_model", "sync_all")],
        "c10d": c10d,
        "span_starts": [s for s in spans if s.startswith("sync_")],
    }


def test_collective_order_matches_across_ranks_whatever_finishes_first() -> None:
    r0, r1 = run_ranks(_ordering_rank, 2, trace=True, timeout=90)
    assert r0["finished"] == ["model", "data"] and r1["finished"] == ["data", "model"]
    assert r0["span_starts"] == r1["span_starts"] == ["sync_data", "sync_model", "sync_all"]
    assert r0["sums"] == r1["sums"] == [3.0, 23.0, 43.0]
    for r in (r0, r1):  # counted by the tracer on the lane thread (attach_thread)
        assert r["c10d"] == [("allreduce_", "fastinit-collective-lane")] * 3


def _failing_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from fastinit.warmup import GraphConfig, StageError, StageGraph

    rank = dist.get_rank()

    def load() -> int:
        time.sleep(0.2)
        if rank == 1:
            raise OSError("checkpoint shard missing")
        return 1

    def sync(_: int) -> None:
        dist.all_reduce(torch.ones(1))

    store = c10d._get_default_store()
    graph = StageGraph(GraphConfig(store=store, drain_timeout_s=5.0))
    graph.add("load", load)
    graph.add("sync", sync, deps=("load",), collective=True)
    start = time.perf_counter()
    try:
        graph.run()
    except StageError as e:
        return {
            "stage": e.stage,
            "rank": e.rank,
            "first": e.first_failure,
            "message": str(e),
            "seconds": time.perf_counter() - start,
        }
    return {"stage": None}


def test_failure_on_one_rank_reaches_every_rank_without_hanging() -> None:
    # The peer waits in all_reduce until the process group's timeout (4 s here) releases it.
    r0, r1 = run_ranks(_failing_rank, 2, pg_timeout=4.0, timeout=60)
    assert (r1["stage"], r1["rank"], r1["first"]) == ("load", 1, ("load", 1))
    assert (r0["stage"], r0["rank"], r0["first"]) == ("sync", 0, ("load", 1))
    assert "stage 'load' on rank 1" in r0["message"]
    assert r0["seconds"] < 20.0 and r1["seconds"] < 5.0


# -- fast batch, warm-up, resume on a real 2-rank DMP ------------------------------------------

SPEC: dict[str, Any] = {
    "num_tables": 3,
    "num_weighted_tables": 2,
    "rows": 64,
    "dims": (8, 16),
    "pooling": 2.0,
}


def _state_tensors(model: Any, optimizers: list[Any]) -> dict[str, Any]:
    """Every local tensor of the model's and optimizers' state dicts, cloned."""
    import torch

    from fastinit.warmup.warmup import _local_tensors

    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        else:
            for i, t in enumerate(_local_tensors(obj)):
                out[f"{prefix}#{i}"] = t.detach().clone()
            if not isinstance(obj, torch.Tensor) and not _local_tensors(obj):
                out[prefix] = obj

    walk("model", model.state_dict())
    for i, opt in enumerate(optimizers):
        walk(f"opt{i}", opt.state_dict())
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    bad = []
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


def _build(seed: int) -> tuple[Any, Any]:
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
    except ImportError:  # pragma: no cover - older fbgemm layout
        from torchrec.distributed.embedding_types import EmbOptimType

    import torch.distributed as dist

    torch.manual_seed(seed)
    spec = ModelSpec(**SPEC)
    module = build_model(spec, device="meta", seed=seed)
    plan = build_plan(module, ["table_wise", "row_wise"], dist.get_world_size())
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    )
    model = stock_setup(module, plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    return model, optimizer


def _step(model: Any, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()


def _warmup_rank(ckpt_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fastinit.testing.models import ModelSpec, make_batch
    from fastinit.warmup import (
        CompileConfig,
        StageGraph,
        WarmupConfig,
        compile_count,
        fast_batch,
        resume_stage,
        schema_from_batch,
        schema_from_model,
        warm_up,
    )

    rank = dist.get_rank()
    spec = ModelSpec(**SPEC)
    model, optimizer = _build(seed=0)
    _step(model, optimizer, make_batch(spec, 16, seed=100 + rank))  # non-trivial optimizer state
    optimizer.zero_grad()
    out: dict[str, Any] = {}

    # The schema, read off the sharded model.
    schema = schema_from_model(model)
    out["schema"] = (
        schema.dense_features,
        [(f.name, f.num_embeddings, f.weighted) for f in schema.sparse],
    )
    # The fast batch takes the pipeline's form (fastinit's test Batch here) from one of its batches.
    batch = fast_batch(schema_from_batch(make_batch(spec, 2), model), 4, torch.device("cpu"))
    out["batch_type"] = type(batch).__name__

    # Warm-up: compile the dense part, forward+backward, every state bit-identical afterwards.
    before = _state_tensors(model, [optimizer, model.fused_optimizer])
    rng = torch.get_rng_state()
    grads = [p.grad for p in model.parameters()]
    report = warm_up(
        model,
        batch,
        optimizers=[optimizer],
        config=WarmupConfig(
            compile=CompileConfig(targets=("dense_arch", "over_arch"), backend="aot_eager")
        ),
    )
    after = _state_tensors(model, [optimizer, model.fused_optimizer])
    out["changed"] = _same(before, after)
    out["rng_same"] = torch.equal(rng, torch.get_rng_state())
    out["grads_same"] = all(a is b for a, b in zip(grads, [p.grad for p in model.parameters()]))
    out["compiled"] = report.compiled_modules
    out["graphs"] = report.graphs_compiled
    full = warm_up(model, batch, optimizers=[optimizer], config=WarmupConfig(snapshot="full"))
    out["snapshot"] = (report.snapshot_bytes, full.snapshot_bytes, report.model_bytes)

    # Real batches of other sizes and jagged lengths: no recompile; the fused tables do change.
    graphs = compile_count()
    _step(model, optimizer, make_batch(spec, 32, seed=200 + rank))
    _step(model, optimizer, make_batch(spec, 24, seed=300 + rank))
    out["recompiles"] = compile_count() - graphs
    trained = _state_tensors(model, [model.fused_optimizer])
    out["fused_changed"] = [k for k in _same(after, trained) if "sparse" in k or "momentum" in k]

    # Resume: save, then load into a fresh model while the "data pipeline" starts.
    from fastinit import checkpoint

    checkpoint.save(ckpt_dir, model, {"optim": model.fused_optimizer}, blocking=True)
    reference = _state_tensors(model, [model.fused_optimizer])
    graph = StageGraph()
    graph.add("train_module_creation", lambda: _build(seed=1)[0], collective=True)
    graph.add(
        "optimizers",
        lambda m: {"optim": m.fused_optimizer},
        deps=("train_module_creation",),
    )
    graph.add_stage(resume_stage(ckpt_dir, optimizer_stage="optimizers"))
    graph.add("preproc_creation", lambda: _after(0.3, "pipeline"))
    started = time.perf_counter()
    results = graph.run()
    out["resume_seconds"] = time.perf_counter() - started
    fresh = results["resume"]
    out["resume_diff"] = _same(reference, _state_tensors(fresh, [fresh.fused_optimizer]))

    # Priming a TrainPipelineSparseDist (one full step, optimizer included) leaves no trace either.
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(fresh.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    )
    combined = CombinedOptimizer([fresh.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(fresh, combined, torch.device("cpu"))
    before = _state_tensors(fresh, [combined, fresh.fused_optimizer])
    warm_up(fresh, batch, pipeline=pipeline)
    out["pipeline_changed"] = _same(
        before, _state_tensors(fresh, [combined, fresh.fused_optimizer])
    )
    loss = pipeline.progress(iter([make_batch(spec, 16, seed=400 + rank)]))[0]
    out["pipeline_ok"] = bool(torch.isfinite(loss))

    # Control: the same forward+backward without preserved_state does move the fused tables.
    plain = _state_tensors(model, [model.fused_optimizer])
    model(batch)[0].backward()
    out["control_changed"] = bool(_same(plain, _state_tensors(model, [model.fused_optimizer])))
    return out


def test_warm_up_is_side_effect_free_does_not_recompile_and_resume_round_trips(
    tmp_path: Any,
) -> None:
    results = run_ranks(_warmup_rank, 2, args=(str(tmp_path / "ckpt"),), timeout=150)
    for out in results:
        dense, sparse = out["schema"]
        assert dense == 13
        assert [(n, w) for n, _, w in sparse] == [
            ("tf0", False),
            ("tf1", False),
            ("tf2", False),
            ("wf0", True),
            ("wf1", True),
        ]
        assert out["batch_type"] == "Batch"
        assert out["changed"] == []
        touched, full, model_bytes = out["snapshot"]
        assert 0 < touched < full and model_bytes > 0, out["snapshot"]  # rows, not whole tables
        assert out["rng_same"] and out["grads_same"]
        assert out["compiled"] == ["dense_arch", "over_arch"]
        assert out["graphs"] >= 2
        assert out["recompiles"] == 0
        assert out["fused_changed"], "the fused optimizer should update tables in backward"
        assert out["resume_diff"] == []
        assert out["pipeline_changed"] == [] and out["pipeline_ok"]
        assert out["control_changed"]


# -- compile cache -----------------------------------------------------------------------------


def test_fingerprint_tracks_structure_not_values() -> None:
    import torch
    from torch import nn

    from fastinit.warmup import module_fingerprint

    a = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    b = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with torch.no_grad():
        b[0].weight.add_(1.0)  # type: ignore[operator]
    assert module_fingerprint(a) == module_fingerprint(b)
    assert module_fingerprint(a) != module_fingerprint(nn.Sequential(nn.Linear(4, 9), nn.ReLU()))
    assert module_fingerprint(a) != module_fingerprint(a.half())
    assert module_fingerprint(b) != module_fingerprint(b, {"backend": "aot_eager"})


def test_corrupt_entry_is_ignored_with_a_warning(tmp_path: Any) -> None:
    import hashlib
    import json

    from fastinit import knobs
    from fastinit.warmup import CompileCache, CompileCacheConfig

    with knobs.override(FASTINIT_COMPILE_CACHE=str(tmp_path)):
        cache = CompileCache("f" * 64, CompileCacheConfig(inductor_dir=False))
    assert cache.path is not None and cache.path.startswith(str(tmp_path))
    assert cache.restore().status == "miss"
    os.makedirs(cache.path, exist_ok=True)
    # 1. torn write: the checksum does not match.
    with open(os.path.join(cache.path, "artifacts.bin"), "wb") as f:
        f.write(b"garbage")
    meta = {"key": cache.key_fields, "sha256": "0" * 64}
    with open(os.path.join(cache.path, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.warns(RuntimeWarning, match="corrupt compile-cache entry"):
        assert cache.restore().status == "corrupt"
    assert not os.path.exists(os.path.join(cache.path, "meta.json"))
    # 2. checksum right, content not a cache: torch refuses it.
    with open(os.path.join(cache.path, "artifacts.bin"), "wb") as f:
        f.write(b"garbage")
    meta["sha256"] = hashlib.sha256(b"garbage").hexdigest()
    with open(os.path.join(cache.path, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.warns(RuntimeWarning, match="load_cache_artifacts failed"):
        assert cache.restore().status == "corrupt"
    # 3. unreadable metadata.
    with open(os.path.join(cache.path, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.warns(RuntimeWarning):
        assert cache.restore().status == "corrupt"
    assert cache.restore().status == "miss"
    assert CompileCache("f" * 64, CompileCacheConfig()).restore().status == "off"


def _compile_job(cache_dir: str, inductor_dir: bool) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    from fastinit.warmup import (
        CompileCache,
        CompileCacheConfig,
        CompileConfig,
        compile_modules,
        module_fingerprint,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config = CompileConfig(targets=("",))
    cache = CompileCache(
        module_fingerprint(model, {"backend": config.backend}),
        CompileCacheConfig(directory=cache_dir, inductor_dir=inductor_dir),
    )
    if not inductor_dir:  # a fresh, private Inductor directory: only the MegaCache file can help
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"private-{os.getpid()}")
    start = time.perf_counter()
    with cache as restored:
        compile_modules(model, config)
        model(torch.randn(4, 8)).sum().backward()
        saved = cache.save()
    return {
        "status": restored.status,
        "loaded": restored.artifacts_loaded,
        "warm": restored.inductor_warm,
        "saved": saved,
        "seconds": time.perf_counter() - start,
        "fx_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
    }


@pytest.mark.slow  # three Inductor compiles in fresh processes: 1-3.5 min on 2 shared cores
@pytest.mark.timeout(900)
def test_compile_cache_miss_then_hit_across_jobs(tmp_path: Any) -> None:
    def job(inductor_dir: bool) -> dict[str, Any]:
        args = (str(tmp_path), inductor_dir)
        return run_ranks(_compile_job, 1, args=args, init_pg=False, timeout=120)[0]

    first = job(inductor_dir=True)  # cold: compiles, fills the entry's Inductor dir, saves
    assert (first["status"], first["saved"], first["fx_hits"]) == ("miss", True, 0)
    warm = job(inductor_dir=True)  # next job, same host: the Inductor dir is warm
    assert (warm["status"], warm["warm"], warm["loaded"]) == ("hit", True, False)
    assert warm["fx_hits"] >= 1  # Inductor served the compiled graph from the cache
    shipped = job(inductor_dir=False)  # a new host: only the MegaCache file travels
    assert (shipped["status"], shipped["warm"], shipped["loaded"]) == ("hit", False, True)
    assert shipped["fx_hits"] >= 1
