"""The floor: the irreducible pieces of a start-up, each timed alone, on every rank.

    torchrun --nproc-per-node 2 -m benchmarks.ttfb.floor --model small --plan PLAN.pt --out DIR

Run with the same ranks, host and caches as the trainer (:mod:`benchmarks.ttfb.trainer`), one piece
after the other with the ranks lined up (a store barrier, not timed) before each:

* ``launch``: process start to ``torch``, TorchRec (``torchrec.distributed``) and fbgemm imported;
* ``build``: the model (on the meta device) and its sharded form built from a given plan with no
  communication:
  :func:`fastinit.setup` with ``plan=`` on torch's fake process-group backend (under another name,
  so TorchRec builds its sharded tensors), where every message is free; stock's
  ``DistributedModelParallel`` cannot run without its messages;
* ``process_group_init``: the real gloo / NCCL process group (rendezvous on the launcher's store);
* ``get_first_batch_data``: the data pipeline's first batch (one worker forked, as the trainer);
* ``first_step``: the first training step (``TrainPipelineSparseDist.progress``, dense arch
  compiled) on that batch, with the caches the scenario has (``TORCHINDUCTOR_CACHE_DIR`` as the
  driver left it: empty when cold, warm when restarting), on a model built untimed beforehand;
  the piece includes wrapping the dense modules with ``torch.compile`` (which imports
  ``torch._dynamo``) and creating the pipeline.

Every rank writes ``trace-rank<N>.jsonl`` with one span per piece and a ``floor`` record
(the seconds of each piece); :func:`benchmarks.ttfb.analysis.floor_of` turns them into the floor:
launch + the longest chain through the rest (``FLOOR_DEPS``).
"""

from __future__ import annotations

import time

_T_IMPORT = time.time()

import argparse  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["FLOOR_PIECES", "FLOOR_DEPS", "main"]

#: The pieces timed after ``launch``.
FLOOR_PIECES: tuple[str, ...] = (
    "build",
    "process_group_init",
    "get_first_batch_data",
    "first_step",
)
#: What waits for what: the step needs the model (built on a process group); the batch needs
#: only the imports (the step can be compiled on a synthetic batch meanwhile).
FLOOR_DEPS: dict[str, tuple[str, ...]] = {
    "process_group_init": (),
    "build": ("process_group_init",),
    "first_step": ("build",),
    "get_first_batch_data": (),
}


def _register_fakestate() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg

    if "fakestate" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "fakestate", fake_pg._create_fake_pg, extended_api=True, devices=["cpu", "cuda"]
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One rank's floor pieces; returns (and records) its ``floor`` record."""
    from benchmarks.ttfb.trainer import process_start_time

    t_start = process_start_time()
    import torch
    import torchrec  # noqa: F401
    import torchrec.distributed  # noqa: F401
    from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401

    t_launch = time.time()
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fastinit
    from benchmarks.ttfb.data import DataConfig, DatasetConfig, ensure_dataset, make_loader
    from benchmarks.ttfb.trainer import COMPILE_TARGETS, _sharders, model_spec
    from fastinit import trace
    from fastinit.testing.models import build_model
    from fastinit.warmup import CompileConfig, compile_modules

    logging.disable(logging.WARNING)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tracer = trace.Tracer(rank=rank, out_dir=args.out, comm=False).start()
    tracer.record(
        {
            "kind": "span",
            "name": "launch",
            "ts": t_start * 1e6,
            "dur": (t_launch - t_start) * 1e6,
            "tid": 0,
            "thread": "MainThread",
        }
    )
    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
        timeout=timeout,
    )
    store = dist.PrefixStore(f"floor/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    counter = itertools.count()

    def line_up() -> None:
        key = f"line{next(counter)}"
        store.add(key, 1)
        while int(store.add(key, 0)) < world:
            time.sleep(0.002)

    spec = model_spec(args.model)
    sharders = _sharders()
    plan = torch.load(args.plan, weights_only=False)
    seconds: dict[str, float] = {"launch": t_launch - t_start}

    def timed(name: str, fn: Any) -> Any:
        line_up()
        t = time.perf_counter()
        with trace.span(name):
            out = fn()
        seconds[name] = time.perf_counter() - t
        return out

    # build: from the plan, no communication (the fake backend makes every message free).
    _register_fakestate()
    dist.init_process_group("fakestate", store=FakeStore(), rank=rank, world_size=world)
    timed(
        "build",
        lambda: fastinit.setup(
            build_model(spec, device="meta"), device=device, plan=plan, sharders=sharders, seed=0
        ),
    )
    dist.destroy_process_group()

    backend = "nccl" if cuda else "gloo"
    timed(
        "process_group_init",
        lambda: dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if cuda else None,
        ),
    )
    path = ensure_dataset(DatasetConfig(spec=spec), args.data_dir)
    config = DataConfig(batch_size=args.batch_size, num_workers=1, context="fork")

    def first_batch() -> tuple[Any, Any]:
        it = iter(make_loader(path, spec, config, rank=rank, world_size=world))
        return it, next(it)

    it, batch = timed("get_first_batch_data", first_batch)

    # The model the step runs on, built untimed (on the real group).
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = fastinit.setup(
        build_model(spec, device="meta"), device=device, plan=plan, sharders=sharders, seed=0
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.02),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    model.train()

    def first_step() -> Any:
        if not args.no_compile:  # wrapping imports torch._dynamo: part of any compiled step
            compile_modules(model, CompileConfig(targets=COMPILE_TARGETS))
        pipeline = TrainPipelineSparseDist(model, optimizer, device)
        return pipeline.progress(itertools.chain([batch], it))

    timed("first_step", first_step)

    record = {
        "kind": "floor",
        "rank": rank,
        "world_size": world,
        "model": args.model,
        "scenario": args.cache,
        "process_start": t_start,
        "seconds": seconds,
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }
    tracer.record(record)
    line_up()
    tracer.stop()
    return record


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--plan", required=True, help="a torch.save-d ShardingPlan")
    parser.add_argument("--cache", default="cold", help="scenario label")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", default="bench-out/data")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    record = run(_parse(argv))
    print(f"rank {record['rank']}: floor pieces {record['seconds']}", flush=True)
    from benchmarks.ttfb.trainer import exit_now

    exit_now()


if __name__ == "__main__":
    main()
