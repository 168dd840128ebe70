"""Time the stock start-up path (collective_plan + DistributedModelParallel) on a given torchrec.

Usage::

    python patches/apply.py --target /tmp/trc-patched
    python patches/measure.py --tables 256 --kind ec                       # installed torchrec
    python patches/measure.py --tables 256 --kind ec --torchrec /tmp/trc-patched
    python patches/measure.py --plan-only --tables 128 [--torchrec /tmp/trc-patched]

Runs in a child interpreter with ``--torchrec`` first on ``sys.path`` (spawned ranks inherit the
parent's path), on ``--nproc`` gloo ranks; prints per phase the median wall time over ranks, and
the c10d ops of rank 0 (from ``fastinit.trace``). ``--plan-only`` times
``EmbeddingShardingPlanner.plan`` alone, in one process (``--tables`` EBC tables of dim 16 on meta,
``Topology(world_size=4, local_world_size=2, compute_device="cpu")``), best of ``--repeats``, as
wall and CPU seconds (the CPU time is what a loaded machine distorts least).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _rank(kind: str, tables: int, planner: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    if kind == "ec":
        spec = ModelSpec(num_tables=0, num_ec_tables=tables, rows=64, dims=(16,))
    else:
        spec = ModelSpec(num_tables=tables, rows=64, dims=(16,))
    model = build_model(spec, device="meta")
    plan = None if planner else build_plan(model, "table_wise", dist.get_world_size())
    phases: dict[str, Any] = {}
    tracer = trace.active()
    assert tracer is not None
    t0 = time.perf_counter()
    with trace.span("plan_and_dmp"):
        stock_setup(model, plan, phases=phases)
    return {
        "total_s": time.perf_counter() - t0,
        "ops": {k: v["c10d_ops"] for k, v in phases.items()},
        "spans": {k: v["spans_s"] for k, v in phases.items()},
    }


def _plan_only(tables: int, repeats: int) -> dict[str, Any]:
    import torchrec
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    from fastinit.testing.models import ModelSpec, build_model

    walls, cpus = [], []
    for _ in range(repeats):
        model = build_model(ModelSpec(num_tables=tables, dims=(16,)), "meta")
        topology = Topology(world_size=4, local_world_size=2, compute_device="cpu")
        planner = EmbeddingShardingPlanner(topology=topology)
        w, c = time.perf_counter(), time.process_time()
        planner.plan(model, get_default_sharders())
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return {"torchrec": torchrec.__file__, "wall_s": min(walls), "cpu_s": min(cpus)}


def _child(args: argparse.Namespace) -> None:
    from fastinit.testing.dist import run_ranks

    if args.plan_only:
        print(json.dumps(_plan_only(args.tables, args.repeats)))
        return

    results = run_ranks(
        _rank, args.nproc, args=(args.kind, args.tables, args.planner), trace=True, timeout=1800
    )
    print(json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["ec", "ebc"], default="ec")
    parser.add_argument("--tables", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--planner", action="store_true", help="plan with collective_plan")
    parser.add_argument("--torchrec", type=Path, help="directory holding a (patched) torchrec")
    parser.add_argument(
        "--plan-only", action="store_true", help="time EmbeddingShardingPlanner.plan"
    )
    parser.add_argument("--repeats", type=int, default=3, help="--plan-only: best of N")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return 0
    path = [str(REPO)] + ([str(args.torchrec.resolve())] if args.torchrec else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(reversed(path))}
    cmd = [sys.executable, "-m", "patches.measure", "--child", *sys.argv[1:]]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(out.stdout, out.stderr, file=sys.stderr)
        return out.returncode
    results = json.loads(out.stdout.strip().splitlines()[-1])
    if args.plan_only:
        print(f"torchrec: {results['torchrec']}  plan() of {args.tables} EBC tables, world 4")
        print(
            f"  best of {args.repeats}: {results['wall_s']:.2f} s wall, {results['cpu_s']:.2f} s CPU"
        )
        return 0
    totals = sorted(r["total_s"] for r in results)
    print(
        f"torchrec: {args.torchrec or 'installed'}  {args.kind} x{args.tables}, {args.nproc} ranks"
    )
    print(f"  plan+DMP wall time, median over ranks: {totals[len(totals) // 2]:.2f} s")
    print(f"  rank 0 c10d ops per phase: {results[0]['ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
