"""Sharding-setup time, stock (``collective_plan`` + DMP) versus ``fastinit.setup``, cold and warm.

    python -m benchmarks.setup [--nproc 4] [--ec-tables 1024] [--ebc-tables 0] [--rows 1000]
        [--dim D]

Every rank times each path between barriers (outside the timed regions); the figure reported is
the max over ranks (wall and CPU seconds of the rank process: the CPU figure is the steadier one
on a shared host). Counts come from the tracer. Writes ``bench-out/setup/setup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any


def _rank(spec_kwargs: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    import fastinit
    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model
    from fastinit.testing.stock import stock_setup

    tracer = trace.active()
    assert tracer is not None
    spec = ModelSpec(**spec_kwargs)
    out: dict[str, Any] = {}
    runs = [
        ("stock", lambda: stock_setup(build_model(spec, device="meta"))),
        (
            "fastinit_cold",
            lambda: fastinit.setup(build_model(spec, device="meta"), plan_cache=cache_dir),
        ),
        (
            "fastinit_warm",
            lambda: fastinit.setup(build_model(spec, device="meta"), plan_cache=cache_dir),
        ),
    ]
    for name, fn in runs:
        dist.barrier()
        with tracer.window() as counts:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        out[name] = {
            "seconds": seconds,
            "cpu_s": cpu,
            "c10d_ops": counts["c10d_ops"],
            "c10d_total": counts["c10d_total"],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fastinit.testing.dist import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ec-tables", type=int, default=1024)
    parser.add_argument("--ebc-tables", type=int, default=0)
    parser.add_argument("--rows", type=int, default=1000, help="rows per table")
    parser.add_argument("--dim", type=int, default=None, help="one embedding dim for every table")
    parser.add_argument("--out", default="bench-out/setup")
    args = parser.parse_args(argv)
    spec: dict[str, Any] = {
        "num_tables": args.ebc_tables,
        "num_ec_tables": args.ec_tables,
        "rows": args.rows,
    }
    if args.dim is not None:
        spec["dims"] = (args.dim,)
    with tempfile.TemporaryDirectory() as cache:
        per_rank = run_ranks(
            _rank, args.nproc, args=(spec, cache), trace=True, timeout=3600, pg_timeout=3600
        )
    result: dict[str, Any] = {"nproc": args.nproc, "spec": spec, "runs": {}}
    for name in per_rank[0]:
        result["runs"][name] = {
            "seconds": max(r[name]["seconds"] for r in per_rank),
            "cpu_s": max(r[name]["cpu_s"] for r in per_rank),
            "c10d_total": max(r[name]["c10d_total"] for r in per_rank),
            "c10d_ops": per_rank[0][name]["c10d_ops"],
        }
    stock = result["runs"]["stock"]["seconds"]
    print(
        f"{args.nproc} ranks, {args.ec_tables} EC + {args.ebc_tables} EBC tables of "
        f"{args.rows} rows"
    )
    for name, r in result["runs"].items():
        print(
            f"{name:<15}{r['seconds']:>9.2f} s  x{stock / r['seconds']:>7.1f}  "
            f"cpu {r['cpu_s']:>7.2f} s  "
            f"c10d {r['c10d_total']:>5}  {r['c10d_ops']}"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "setup.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
