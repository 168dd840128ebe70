"""Stock TorchRec start-up, per phase: c10d ops, bytes, groups, store ops and seconds per rank.

    python -m benchmarks.baseline [--nproc 2] [--out bench-out/baseline]

Runs the stock path (``collective_plan`` + ``DistributedModelParallel``) on real gloo ranks for a
few reference models and prints one row per (model, phase), the max over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

from fastinit.testing.models import SHARDING_TYPES

MODELS: dict[str, dict[str, Any]] = {
    "ebc26-planner": {"spec": {"num_tables": 26}, "plan": "planner"},
    "ec64-tw": {"spec": {"num_tables": 0, "num_ec_tables": 64}, "plan": "table_wise"},
    "mixed-7types": {
        "spec": {"num_tables": 14, "num_weighted_tables": 4},
        "plan": list(SHARDING_TYPES),
    },
}


def _rank(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    model = build_model(ModelSpec(**cfg["spec"]), device="meta")
    plan = (
        None if cfg["plan"] == "planner" else build_plan(model, cfg["plan"], dist.get_world_size())
    )
    phases: dict[str, Any] = {}
    tracer = trace.active()
    assert tracer is not None
    stock_setup(model, plan, phases=phases)
    return phases


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fastinit.testing.dist import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--local-world-size", type=int, default=None)
    parser.add_argument("--out", default="bench-out/baseline")
    args = parser.parse_args(argv)
    lws = args.local_world_size or (args.nproc // 2 if args.nproc >= 4 else args.nproc)
    rows = []
    for name, cfg in MODELS.items():
        t0 = time.perf_counter()
        per_rank = run_ranks(
            _rank, args.nproc, args=(name, cfg), trace=True, local_world_size=lws, timeout=900
        )
        wall = time.perf_counter() - t0
        for phase in ("plan", "dmp"):
            ranks = [r[phase] for r in per_rank]
            rows.append(
                {
                    "model": name,
                    "phase": phase,
                    "seconds": max(r["spans_s"].get(phase, 0.0) for r in ranks),
                    "c10d_ops": max(r["c10d_total"] for r in ranks),
                    "c10d_by_op": ranks[0]["c10d_ops"],
                    "c10d_bytes": max(r["c10d_bytes"] for r in ranks),
                    "barriers": max(r["barriers"] for r in ranks),
                    "new_groups": max(r["new_groups"] for r in ranks),
                    "store_ops": max(r["store_total"] for r in ranks),
                    "job_wall_s": wall,
                }
            )
    import torch
    import torchrec  # type: ignore[import-untyped]

    result = {
        "nproc": args.nproc,
        "local_world_size": lws,
        "versions": {"torch": torch.__version__, "torchrec": torchrec.__version__},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "baseline.json"), "w") as f:
        json.dump(result, f, indent=2)
    header = f"stock torchrec {result['versions']['torchrec']}, {args.nproc} ranks (gloo, CPU)"
    print(header)
    print(
        f"{'model':<16}{'phase':<6}{'s':>8}{'c10d':>6}{'bytes':>10}{'barr':>6}{'groups':>7}{'store':>7}  ops"
    )
    for r in rows:
        ops = ", ".join(f"{k}×{v}" for k, v in sorted(r["c10d_by_op"].items()))
        print(
            f"{r['model']:<16}{r['phase']:<6}{r['seconds']:>8.2f}{r['c10d_ops']:>6}"
            f"{r['c10d_bytes']:>10}{r['barriers']:>6}{r['new_groups']:>7}{r['store_ops']:>7}  {ops}"
        )
    return result


if __name__ == "__main__":
    main()
