"""Cold planning time: TorchRec's EmbeddingShardingPlanner against fastinit's FastPlanner.

    python -m benchmarks.bench_planner [--tables 64,256,1024] [--world-sizes 8,64,512]
        [--stock-cap 120] [--fast-cap 600] [--device cpu] [--local-world-size 8]
        [--out bench-out/planner]

For every (tables, world size) pair, each planner plans the same model for the same topology in its
own fresh process (``plan()`` alone is timed: wall and CPU seconds). The stock planner is killed
after ``--stock-cap`` seconds and reported as "> cap". Where both finish, the plans are compared
field by field (sharding type, kernel, ranks, shard offsets/sizes/placements, cache parameters).

The model is an EmbeddingBagCollection on the meta device: dims cycle 16/32/64/128, row counts
spread log-uniformly over 1e3..1e6 (all distinct), every fifth table fp16.

Writes ``planner.json`` and ``planner.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOLDEN = 0.6180339887498949


def build_model(num_tables: int) -> Any:
    """The benchmark model (EmbeddingBagCollection on meta)."""
    import torch
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=(16, 32, 64, 128)[i % 4],
            num_embeddings=int(10 ** (3 + 3 * ((i * GOLDEN) % 1.0))) + i,
            feature_names=[f"f{i}"],
            data_type=DataType.FP16 if i % 5 == 4 else DataType.FP32,
        )
        for i in range(num_tables)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def worker(which: str, tables: int, world_size: int, lws: int, device: str, out: str) -> None:
    """Plan once in this process and write timings and the plan to ``out``."""
    import logging

    logging.disable(logging.WARNING)
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    from fastinit.sharding import FastPlanner
    from fastinit.testing.models import plan_to_plain

    model = build_model(tables)
    topology = Topology(
        world_size=world_size, local_world_size=min(lws, world_size), compute_device=device
    )
    cls = FastPlanner if which == "fast" else EmbeddingShardingPlanner
    planner = cls(topology=topology)
    sharders = get_default_sharders()
    wall, cpu = time.perf_counter(), time.process_time()
    plan = planner.plan(model, sharders)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "num_proposals": planner._num_proposals,
        "fallback_reason": getattr(planner, "fallback_reason", None),
        "plan": plan_to_plain(plan),
    }
    Path(out).write_text(json.dumps(result))


def run_worker(
    which: str, tables: int, world_size: int, lws: int, device: str, cap: float
) -> dict[str, Any] | None:
    """Run ``worker`` in a fresh process; None if it ran past ``cap`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_planner",
            "--worker",
            which,
            "--tables",
            str(tables),
            "--world-sizes",
            str(world_size),
            "--local-world-size",
            str(lws),
            "--device",
            device,
            "--worker-out",
            out,
        ]
        try:
            subprocess.run(cmd, check=True, timeout=cap, stdout=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None
        return json.loads(Path(out).read_text())


def _fmt(seconds: float | None, cap: float) -> str:
    return f"> {cap:g}" if seconds is None else f"{seconds:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", default="64,256,1024", help="comma-separated table counts")
    p.add_argument("--world-sizes", default="8,64,512", help="comma-separated world sizes")
    p.add_argument("--local-world-size", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="topology device")
    p.add_argument("--stock-cap", type=float, default=120.0, help="seconds; 0 skips stock")
    p.add_argument("--fast-cap", type=float, default=600.0, help="seconds")
    p.add_argument("--out", default="bench-out/planner")
    p.add_argument("--worker", choices=["fast", "stock"], help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    tables = [int(x) for x in args.tables.split(",")]
    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    if args.worker:
        worker(
            args.worker,
            tables[0],
            world_sizes[0],
            args.local_world_size,
            args.device,
            args.worker_out,
        )
        return 0

    import torch
    import torchrec

    rows = []
    for t in tables:
        for w in world_sizes:
            fast = run_worker("fast", t, w, args.local_world_size, args.device, args.fast_cap)
            stock = None
            if args.stock_cap > 0:
                stock = run_worker(
                    "stock", t, w, args.local_world_size, args.device, args.stock_cap
                )
            identical = None
            if fast is not None and stock is not None:
                identical = fast["plan"] == stock["plan"]
            row = {
                "tables": t,
                "world_size": w,
                "local_world_size": min(args.local_world_size, w),
                "device": args.device,
                "fast_wall_s": fast["wall_s"] if fast else None,
                "fast_cpu_s": fast["cpu_s"] if fast else None,
                "fast_fallback_reason": fast["fallback_reason"] if fast else None,
                "stock_wall_s": stock["wall_s"] if stock else None,
                "stock_cpu_s": stock["cpu_s"] if stock else None,
                "stock_ran": args.stock_cap > 0,
                "num_proposals": (fast or stock or {}).get("num_proposals"),
                "speedup_wall": (stock["wall_s"] / fast["wall_s"]) if fast and stock else None,
                "speedup_cpu": (stock["cpu_s"] / fast["cpu_s"]) if fast and stock else None,
                "identical_plan": identical,
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items()}), flush=True)

    header = (
        "| tables | world size | stock plan() s (cpu s) | FastPlanner plan() s (cpu s) "
        "| speedup (cpu) | proposals | identical plan |\n"
        "|---:|---:|---:|---:|---:|---:|:---|\n"
    )
    lines = []
    for r in rows:
        if not r["stock_ran"]:
            stock_cell = "not run"
        elif r["stock_wall_s"] is None:
            stock_cell = f"> {args.stock_cap:g} (cap)"
        else:
            stock_cell = f"{r['stock_wall_s']:.2f} ({r['stock_cpu_s']:.2f})"
        fast_cell = (
            f"> {args.fast_cap:g}"
            if r["fast_wall_s"] is None
            else f"{r['fast_wall_s']:.2f} ({r['fast_cpu_s']:.2f})"
        )
        if r["speedup_wall"] is not None:
            speed = f"{r['speedup_wall']:.1f}x ({r['speedup_cpu']:.1f}x)"
        elif r["stock_ran"] and r["fast_wall_s"] is not None:
            speed = f"> {args.stock_cap / r['fast_wall_s']:.1f}x"
        else:
            speed = "-"
        ident = {True: "yes", False: "**NO**", None: "-"}[r["identical_plan"]]
        lines.append(
            f"| {r['tables']} | {r['world_size']} | {stock_cell} | {fast_cell} | {speed} "
            f"| {r['num_proposals']} | {ident} |"
        )
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "device": args.device,
        "stock_cap_s": args.stock_cap,
    }
    md = (
        f"# Cold planning time, stock vs FastPlanner ({args.device} topology, "
        f"local world size {args.local_world_size})\n\n"
        + header
        + "\n".join(lines)
        + f"\n\nEnvironment: `{json.dumps(env)}`\n"
        "Wall seconds of `plan()` in a fresh process; CPU seconds in parentheses (the machine is "
        "shared, CPU time is the steadier figure).\n"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    (out / "planner.md").write_text(md)
    print(md)
    return 0 if all(r["identical_plan"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
