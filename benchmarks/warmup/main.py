"""Time to first batch: sequential start-up against fastinit.warmup's concurrent stages.

    python -m benchmarks.warmup [--data-seconds 8] [--repeats 1] [--no-cache-bench]

A small reference trainer (a 1-rank gloo DistributedModelParallel of a DLRM-style model) whose data
pipeline — a DataLoader whose spawned worker sleeps ``--data-seconds`` before its first batch —
takes D s to the first batch, and whose compile (Inductor, dense arch + over arch, forward and
backward, a cold cache directory per run) takes C s:

* **sequential**: process group, data pipeline, model, first batch, then the first step compiles:
  about D + C;
* **fastinit**: the same stages in a :class:`fastinit.warmup.StageGraph`; ``pre_train`` compiles
  on a fast batch while the pipeline still produces the real first batch: about max(D, C).

Each run is a fresh process. Then (unless ``--no-cache-bench``) the compile-cache measurement:
cold compile, ``torch.compiler.load_cache_artifacts`` into an empty Inductor directory, and a warm
Inductor directory, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

SPEC: dict[str, Any] = {"num_tables": 4, "num_weighted_tables": 2, "rows": 500}
TARGETS = ("dense_arch", "over_arch")
BATCH = 64


class SlowSource(IterableDataset):
    """An iterable dataset whose worker takes ``seconds`` to produce its first batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __iter__(self) -> Iterator[Any]:
        from fastinit.testing.models import ModelSpec, batches

        time.sleep(self.seconds)  # opening files, shuffling, the first remote read, ...
        yield from batches(ModelSpec(**SPEC), BATCH, seed=1)


def _stages(data_seconds: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    def process_group_init() -> None:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def preproc_creation(*_: Any) -> Iterator[Any]:
        loader = DataLoader(
            SlowSource(data_seconds),
            batch_size=None,
            num_workers=1,
            multiprocessing_context="spawn",
        )
        return iter(loader)

    def train_module_creation(*_: Any) -> Any:
        module = build_model(ModelSpec(**SPEC), device="meta")
        plan = build_plan(module, "table_wise", dist.get_world_size())
        model = stock_setup(module, plan)
        optimizer = torch.optim.SGD(
            [p for n, p in model.named_parameters() if "embedding_bags" not in n], lr=0.01
        )
        return model, optimizer

    def get_first_batch_data(it: Iterator[Any]) -> Any:
        return next(it)

    return {
        "process_group_init": process_group_init,
        "preproc_creation": preproc_creation,
        "train_module_creation": train_module_creation,
        "get_first_batch_data": get_first_batch_data,
    }


def _step(model: Any, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()


def _trainer(mode: str, data_seconds: float) -> dict[str, Any]:
    """One start-up, to the first batch consumed; runs in a fresh process."""
    import torch
    import torch.distributed as dist

    from fastinit import trace
    from fastinit.testing.models import ModelSpec, make_batch
    from fastinit.warmup import (
        CompileConfig,
        StageGraph,
        WarmupConfig,
        compile_modules,
        fast_batch,
        schema_from_batch,
        warm_up,
    )

    stages = _stages(data_seconds)
    compile_config = CompileConfig(targets=TARGETS)
    with trace.Tracer(comm=False) as tracer:
        start = time.perf_counter()
        if mode == "sequential":
            with trace.span("process_group_init"):
                stages["process_group_init"]()
            with trace.span("preproc_creation"):
                it = stages["preproc_creation"]()
            with trace.span("train_module_creation"):
                model, optimizer = stages["train_module_creation"]()
                compile_modules(model, compile_config)
            with trace.span("get_first_batch_data"):
                batch = stages["get_first_batch_data"](it)
        else:

            def pre_train(built: tuple[Any, Any]) -> None:
                model, optimizer = built
                schema = schema_from_batch(make_batch(ModelSpec(**SPEC), 2), model)
                batch = fast_batch(schema, 8, torch.device("cpu"))
                warm_up(
                    model,
                    batch,
                    optimizers=[optimizer],
                    config=WarmupConfig(compile=compile_config),
                )

            graph = StageGraph()
            graph.add("process_group_init", stages["process_group_init"], collective=True)
            graph.add("preproc_creation", stages["preproc_creation"])
            graph.add(
                "train_module_creation",
                stages["train_module_creation"],
                deps=("process_group_init",),
                collective=True,
            )
            graph.add(
                "get_first_batch_data",
                stages["get_first_batch_data"],
                deps=("preproc_creation",),
            )
            graph.add("pre_train", pre_train, deps=("train_module_creation",), collective=True)
            results = graph.run()
            model, optimizer = results["train_module_creation"]
            batch = results["get_first_batch_data"]
        with trace.span("first_step"):
            _step(model, optimizer, batch)
        first_batch = time.perf_counter() - start
        with trace.span("second_step"):
            _step(model, optimizer, next(it) if mode == "sequential" else batch)
    spans = tracer.summary()["spans_s"]
    dist.destroy_process_group()
    return {"mode": mode, "first_batch_s": first_batch, "spans": spans}


def _compile_only(cache_dir: str, how: str) -> dict[str, Any]:
    """Compile the reference dense part (fwd+bwd) with the cache in state ``how``."""
    import torch

    from fastinit.testing.models import ModelSpec, build_model, make_batch
    from fastinit.warmup import (
        CompileCache,
        CompileCacheConfig,
        CompileConfig,
        compile_modules,
        module_fingerprint,
    )

    model = build_model(ModelSpec(**SPEC))
    batch = make_batch(ModelSpec(**SPEC), BATCH)
    config = CompileConfig(targets=TARGETS)
    cache = CompileCache(
        module_fingerprint([model.get_submodule(t) for t in TARGETS], {"backend": "inductor"}),
        CompileCacheConfig(directory=cache_dir, inductor_dir=how != "mega_cache"),
    )
    if how == "mega_cache":  # an empty private Inductor directory: only the file can help
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    start = time.perf_counter()
    with cache as restored:
        compile_modules(model, config)
        loss, _ = model(batch)
        loss.backward()
        if how == "cold":
            cache.save()
    seconds = time.perf_counter() - start
    del torch
    return {"how": how, "status": restored.status, "restore_s": restored.seconds, "s": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    import torchrec

    from fastinit.testing.dist import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-seconds", type=float, default=8.0, help="pipeline's first-batch delay"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-cache-bench", action="store_true", help="skip the cache measurement")
    parser.add_argument("--out", default="bench-out/warmup")
    args = parser.parse_args(argv)

    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for mode in ("sequential", "fastinit"):
            env = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-cold-")}
            out = run_ranks(
                _trainer, 1, args=(mode, args.data_seconds), init_pg=False, env=env, timeout=600
            )[0]
            runs.append(out)
            print(f"  {mode:<10} first batch {out['first_batch_s']:6.1f} s", flush=True)

    def med(mode: str, key: str) -> float:
        values = [
            r["first_batch_s"] if key == "total" else r["spans"].get(key, 0.0)
            for r in runs
            if r["mode"] == mode
        ]
        return statistics.median(values)

    seq, fast = med("sequential", "total"), med("fastinit", "total")
    data = med("sequential", "preproc_creation") + med("sequential", "get_first_batch_data")
    compile_s = med("sequential", "first_step") - med("sequential", "second_step")
    print(
        f"\ntorch {torch.__version__}, torchrec {torchrec.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; median of {args.repeats}"
    )
    print(f"data pipeline to first batch D = {data:5.1f} s")
    print(f"compile (first step - second) C = {compile_s:5.1f} s")
    print(f"sequential first batch          {seq:5.1f} s   (D + C = {data + compile_s:.1f} s)")
    print(
        f"fastinit.warmup first batch     {fast:5.1f} s   (max(D, C) = {max(data, compile_s):.1f} s)"
    )
    print(f"speed-up                        {seq / fast:5.2f}x")
    result: dict[str, Any] = {
        "versions": {"torch": torch.__version__, "torchrec": torchrec.__version__},
        "runs": runs,
        "sequential_s": seq,
        "fastinit_s": fast,
        "data_s": data,
        "compile_s": compile_s,
    }
    if not args.no_cache_bench:
        cache_dir = tempfile.mkdtemp(prefix="fastinit-compile-cache-")
        cache_runs = []
        for how in ("cold", "mega_cache", "warm_inductor_dir"):
            env = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
            out = run_ranks(
                _compile_only, 1, args=(cache_dir, how), init_pg=False, env=env, timeout=600
            )[0]
            cache_runs.append(out)
        print("\ncompile of dense_arch + over_arch, fwd+bwd, fresh process each:")
        for out in cache_runs:
            print(
                f"  {out['how']:<18} {out['s']:5.1f} s  (cache {out['status']}, "
                f"restore {out['restore_s']:.2f} s)"
            )
        result["cache"] = cache_runs
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_warmup.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
