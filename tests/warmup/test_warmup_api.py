"""fastinit.warmup's public API: imports, stage inputs, per-thread device, TorchRec's own batch,
and the compile cache's guarantees (never raises, owner-only, hit only when used)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from fastinit.testing.dist import run_ranks

# -- imports cannot be shadowed ----------------------------------------------------------------

_ORDERS = [
    # the docstring / README orders, then every submodule imported first
    "from fastinit.warmup import schema_from_model, fast_batch",
    "from fastinit.warmup import fast_batch, schema_from_model, warm_up, StageGraph",
    "import fastinit.warmup.batch; from fastinit.warmup import fast_batch",
    "import fastinit.warmup.warmup; from fastinit.warmup import warm_up",
    "from fastinit.warmup.batch import fast_batch as f; from fastinit.warmup import fast_batch",
]


def test_every_public_name_is_the_object_in_every_import_order() -> None:
    code = """
import importlib, itertools, pkgutil, sys, types
import fastinit
names = {}
for package in ("fastinit", "fastinit.warmup", "fastinit.sharding", "fastinit.pg"):
    mod = importlib.import_module(package)
    subs = [m.name for m in pkgutil.iter_modules(mod.__path__)]
    clash = sorted(set(subs) & set(getattr(mod, "__all__", [])) - {"trace", "knobs", "errors"})
    assert not clash, f"{package}: submodules named like public names: {clash}"
    names[package] = (mod, subs)
for order in ORDERS:
    exec(order, {})
w, subs = names["fastinit.warmup"]
for sub in subs:  # import every submodule, then every public name must still be the object
    importlib.import_module(f"fastinit.warmup.{sub}")
for name in w.__all__:
    exec(f"from fastinit.warmup import {name} as value", g := {})
    assert not isinstance(g["value"], types.ModuleType), name
assert "fastinit.testing" not in sys.modules, "production code imported fastinit.testing"
"""
    code = f"ORDERS = {_ORDERS!r}\n{code}"
    for order in (_ORDERS[0], _ORDERS[-1]):  # the docs' order first / a submodule first
        subprocess.run([sys.executable, "-c", f"{order}\n{code}"], check=True, timeout=120)


# -- stage graph: named inputs, ordering-only deps, per-thread device ---------------------------


def test_stage_inputs_by_keyword_and_after_for_ordering_only() -> None:
    from fastinit.warmup import StageGraph

    order: list[str] = []
    graph = StageGraph()
    graph.add("pg", lambda: order.append("pg"))
    graph.add("data", lambda: [1, 2, 3])
    graph.add("model", lambda: (time.sleep(0.05), "model")[1], after=("pg",))

    def warm(model: str, *, batch: list[int]) -> str:  # names, not positions
        order.append("warm")
        return f"{model}:{sum(batch)}"

    graph.add("warm", warm, {"batch": "data", "model": "model"}, after=("pg",), collective=True)
    graph.add("count", len, ["data"])  # a sequence still passes results positionally
    results = graph.run()
    assert results["warm"] == "model:6" and results["count"] == 3
    assert order == ["pg", "warm"]
    with pytest.raises(ValueError, match="undeclared"):
        graph.add("late", lambda: None, after=("nope",))
    with pytest.raises(TypeError):
        graph.add("bad", lambda: None, "data")


def test_every_stage_thread_sets_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fastinit.warmup import GraphConfig, StageGraph

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda d: calls.append((threading.current_thread().name, str(torch.device(d)))),
    )
    graph = StageGraph(GraphConfig(device="cuda:1", max_workers=2))
    graph.add("a", lambda: None)
    graph.add("b", lambda: None)
    graph.add("c", lambda: None, collective=True)
    graph.run()
    assert len(calls) == 3 and {d for _, d in calls} == {"cuda:1"}
    assert "fastinit-collective-lane" in {t for t, _ in calls}
    calls.clear()
    StageGraph().add("cpu", lambda: None).run()  # "auto" on a host without CUDA: nothing
    assert calls == [] or torch.cuda.is_available()


def _pg_from_a_stage() -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    from fastinit.warmup import StageError, StageGraph

    def init_pg() -> None:  # the harness serves the rendezvous store at MASTER_PORT
        timeout = datetime.timedelta(seconds=4)
        port = int(os.environ["MASTER_PORT"])
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=int(os.environ["RANK"]), world_size=2, timeout=timeout
        )

    def load() -> None:
        if dist.get_rank() == 1:
            raise OSError("shard missing")

    graph = StageGraph()  # no store up front: the process group does not exist yet
    graph.add("process_group_init", init_pg, collective=True)
    graph.add("load", load, after=("process_group_init",))
    graph.add("sync", lambda: dist.all_reduce(torch.ones(1)), after=("load",), collective=True)
    try:
        graph.run()
    except StageError as e:
        return {"stage": e.stage, "first": e.first_failure}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"stage": None, "first": None}


def test_a_stage_creates_the_process_group_and_failures_still_name_the_first() -> None:
    r0, r1 = run_ranks(_pg_from_a_stage, 2, init_pg=False, timeout=90)
    assert r1 == {"stage": "load", "first": ("load", 1)}
    assert r0["first"] == ("load", 1)  # read through the default group's store


# -- TorchRec's own batch and model ------------------------------------------------------------


def _dlrm() -> Any:
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10 + i, feature_names=[k])
        for i, k in enumerate(["a", "b", "c"])
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    return DLRMTrain(
        DLRM(ebc, dense_in_features=5, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    )


def test_fast_batch_is_torchrecs_batch_and_dlrm_train_takes_it() -> None:
    import torch
    from torchrec.datasets.random import RandomRecDataset
    from torchrec.datasets.utils import Batch

    from fastinit.warmup import (
        BatchSchemaError,
        check_batch,
        fast_batch,
        schema_from_batch,
        schema_from_model,
    )

    model = _dlrm()
    schema = schema_from_model(model)
    batch = fast_batch(schema, 4, torch.device("cpu"))
    assert type(batch) is Batch and batch.sparse_features.keys() == ["a", "b", "c"]
    loss, _ = model(batch)  # no factory needed
    loss.backward()
    real = next(
        iter(RandomRecDataset(keys=["c", "a", "b"], batch_size=4, hash_size=10, num_dense=5))
    )
    with pytest.raises(BatchSchemaError, match="sparse feature 0 differs: expected 'a', got 'c'"):
        check_batch(schema, real)
    exact = schema_from_batch(real, model)  # the pipeline's order, the model's table rows
    like = fast_batch(exact, 6, torch.device("cpu"))
    check_batch(exact, like)
    assert like.sparse_features.keys() == ["c", "a", "b"]
    assert like.sparse_features.lengths().dtype == real.sparse_features.lengths().dtype
    assert like.labels.dtype == real.labels.dtype and like.dense_features.shape == (6, 5)
    ids = like.sparse_features.to_dict()
    assert all(
        int(ids[k].values().max()) < 10 + i for i, k in enumerate("abc") if ids[k].values().numel()
    )
    model(like)[0].backward()


# -- compile cache -----------------------------------------------------------------------------


def test_restore_never_raises_on_an_unusable_root(tmp_path: Any) -> None:
    from fastinit.warmup import CompileCache, CompileCacheConfig

    a_file = tmp_path / "file"
    a_file.write_text("x")
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    roots = [str(a_file), str(a_file / "below"), str(read_only / "cache")]
    if os.getuid() == 0:  # root writes anywhere: only the non-directory roots are checked
        roots = roots[:2]
    for root in roots:
        cache = CompileCache("f" * 64, CompileCacheConfig(directory=root))
        with pytest.warns(RuntimeWarning, match="unusable"):
            restored = cache.restore()
        assert restored.status == "miss" and restored.reason
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR", "") != cache.inductor_path
        cache.close()


def test_entries_are_owner_only_and_foreign_ones_are_not_used(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from fastinit.warmup import CompileCache, CompileCacheConfig

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    cache = CompileCache("f" * 64, CompileCacheConfig(directory=str(tmp_path / "cc")))
    with cache as restored:
        assert cache.save()
    assert restored.status == "miss"
    assert cache.path is not None and cache.inductor_path is not None
    for d in (cache.path, cache.inductor_path):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for f in ("artifacts.bin", "meta.json"):
        assert stat.S_IMODE(os.stat(os.path.join(cache.path, f)).st_mode) == 0o600, f
    os.chmod(cache.path, 0o777)  # someone else could have written it: it is not used
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert cache.restore().status == "miss"
    cache.close()


def test_junk_in_the_inductor_directory_is_not_a_hit(tmp_path: Any) -> None:
    from fastinit.warmup import CompileCache, CompileCacheConfig

    cache = CompileCache("f" * 64, CompileCacheConfig(directory=str(tmp_path), mega_cache=False))
    assert cache.inductor_path is not None
    os.makedirs(cache.inductor_path, mode=0o700)
    with open(os.path.join(cache.inductor_path, "junk"), "w") as f:
        f.write("not compiled code")
    with cache as restored:
        assert restored.status == "pending" and restored.inductor_warm
        # ... the compile would run here; Inductor serves nothing from the entry ...
    assert restored.status == "miss" and restored.cache_hits == 0


def test_compile_cache_takes_the_compile_targets() -> None:
    from fastinit.warmup import CompileCache, CompileCacheConfig, CompileConfig

    model = _dlrm()
    targets = ("model.dense_arch", "model.over_arch")
    config = CompileCacheConfig(directory="/nonexistent-unused")
    a = CompileCache.for_targets(model, CompileConfig(targets=targets), config)
    b = CompileCache.for_targets(
        model, CompileConfig(targets=(model.model.dense_arch, model.model.over_arch)), config
    )
    c = CompileCache.for_targets(model, CompileConfig(targets=targets, backend="aot_eager"), config)
    assert a.key == b.key != c.key


# -- compile-stack prefetch ---------------------------------------------------------------------


def test_prefetch_compiler_imports_the_compile_stack_on_a_thread() -> None:
    """In a fresh process (the imports are once per process): the prefetch returns at once, runs
    on its own daemon thread, imports what the first torch.compile imports, probes the CPU ISA;
    torch.compile still works after it, and the global RNG is untouched."""
    code = """
import sys, threading
import torch
from fastinit.warmup import prefetch_compiler
state = torch.get_rng_state()
assert "torch._inductor.compile_fx" not in sys.modules
p = prefetch_compiler(cpu_inductor=True)
assert p.thread is not threading.current_thread() and p.thread.daemon
assert p.wait(300), "prefetch did not finish"
assert p.error is None, p.error
assert "torch._inductor.compile_fx" in p.imported and p.seconds > 0, p
assert p.vec_isa is not None
f = torch.compile(lambda x: x * 2 + 1, backend="aot_eager")
assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))
assert torch.equal(torch.get_rng_state(), state)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
