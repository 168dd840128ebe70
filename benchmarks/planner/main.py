"""Cold planning time: TorchRec's EmbeddingShardingPlanner against fastinit's FastPlanner.

    python -m benchmarks.planner [--tables 64,256,1024] [--world-sizes 8,64,512]
        [--stock-cap 120] [--fast-cap 600] [--device cpu] [--local-world-size 8]
        [--out bench-out/planner]
    python -m benchmarks.planner --sweep [--tables 256,1024,4096,16384]
        [--world-sizes 8,512,4096] [--out benchmarks/results/planner-sweep]
    python -m benchmarks.planner --profile OUT.txt --tables 4096 --world-sizes 4096

For every (tables, world size) pair, each planner plans the same model for the same topology in its
own fresh process (``plan()`` alone is timed: wall and CPU seconds; the process's peak RSS is
recorded). The stock planner is killed after ``--stock-cap`` seconds and reported as "> cap". Where
both finish, the plans are compared field by field (sharding type, kernel, ranks, shard
offsets/sizes/placements, cache parameters).

``--sweep`` runs FastPlanner alone over the grid and writes ``sweep.json``, ``sweep.md`` (the table
and the fitted growth) and ``sweep.png`` (log-log plot). ``--profile`` runs FastPlanner once under
cProfile and writes the statistics (cumulative and own time) as text.

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


def _peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_profile(profiler: Any, path: str, title: str) -> None:
    """Write cProfile statistics as text: top functions by cumulative and by own time."""
    import io
    import pstats

    buf = io.StringIO()
    buf.write(f"# {title}\n# (cProfile adds overhead to every Python call; compare shares)\n")
    stats = pstats.Stats(profiler, stream=buf).strip_dirs()
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    Path(path).write_text(buf.getvalue())


def worker(
    which: str,
    tables: int,
    world_size: int,
    lws: int,
    device: str,
    out: str,
    profile: str | None = None,
) -> None:
    """Plan once in this process and write timings and the plan to ``out``."""
    import logging

    logging.disable(logging.WARNING)
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    from fastinit.planner import FastPlanner
    from fastinit.testing.models import plan_to_plain

    model = build_model(tables)
    topology = Topology(
        world_size=world_size, local_world_size=min(lws, world_size), compute_device=device
    )
    cls = FastPlanner if which == "fast" else EmbeddingShardingPlanner
    planner = cls(topology=topology)
    sharders = get_default_sharders()
    rss_before = _peak_rss_mb()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    wall, cpu = time.perf_counter(), time.process_time()
    plan = planner.plan(model, sharders)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, profile, f"{which} plan(): {tables} tables x {world_size} ranks")
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_rss_before_plan_mb": rss_before,
        "num_plans": planner._num_plans,
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
            "benchmarks.planner",
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


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torchrec

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "device": args.device,
        "local_world_size": args.local_world_size,
    }


# ---- the sweep: launch, analysis (pure), report --------------------------------------------------


def fit_growth(rows: list[dict[str, Any]], key: str = "cpu_s") -> dict[str, Any]:
    """Fit ``key ~ a * T**b * W**c`` (least squares on logs) over rows with ``key`` measured.

    Args:
        rows: sweep rows with ``tables``, ``world_size`` and ``key``.
        key: the measured column.

    Returns:
        ``{"a", "b" (exponent of tables), "c" (exponent of world size), "n", "per_w", "per_t"}``;
        ``per_w[W]`` is the exponent of T at that world size, ``per_t[T]`` the exponent of W at
        that table count (only where two or more points exist).
    """
    import numpy as np

    pts = [r for r in rows if r.get(key) and r[key] > 0]
    out: dict[str, Any] = {"n": len(pts), "per_w": {}, "per_t": {}}
    if len(pts) >= 3:
        x = np.array(
            [[1.0, np.log(r["tables"]), np.log(r["world_size"])] for r in pts], dtype=float
        )
        y = np.log(np.array([r[key] for r in pts], dtype=float))
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        out.update(a=float(np.exp(coef[0])), b=float(coef[1]), c=float(coef[2]))
    for by, other, name in (("world_size", "tables", "per_w"), ("tables", "world_size", "per_t")):
        groups: dict[int, list[dict[str, Any]]] = {}
        for r in pts:
            groups.setdefault(r[by], []).append(r)
        for k, grp in sorted(groups.items()):
            if len({r[other] for r in grp}) >= 2:
                lx = np.log([r[other] for r in grp])
                ly = np.log([r[key] for r in grp])
                out[name][k] = float(np.polyfit(lx, ly, 1)[0])
    return out


def sweep_markdown(rows: list[dict[str, Any]], fits: dict[str, dict[str, Any]], env: Any) -> str:
    """The sweep as a markdown table, with the fitted growth below it."""
    lines = [
        "| tables T | world size W | plan() wall s | plan() CPU s | peak RSS MiB | proposals "
        "| partitions run |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("cpu_s") is None:
            lines.append(
                f"| {r['tables']} | {r['world_size']} | not run ({r.get('note', '')}) | | | | |"
            )
            continue
        lines.append(
            f"| {r['tables']} | {r['world_size']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} "
            f"| {r['peak_rss_mb']:.0f} | {r['num_proposals']} | {r['num_plans']} |"
        )
    text = "\n".join(lines) + "\n\n## Fitted growth (least squares on logs)\n\n"
    for key, fit in fits.items():
        if "b" in fit:
            text += (
                f"- {key}: {fit['a']:.3g} x T^{fit['b']:.2f} x W^{fit['c']:.2f} "
                f"(over {fit['n']} cells)\n"
            )
        per_w = ", ".join(f"W={w}: T^{e:.2f}" for w, e in fit["per_w"].items())
        per_t = ", ".join(f"T={t}: W^{e:.2f}" for t, e in fit["per_t"].items())
        text += f"  - per world size: {per_w}\n  - per table count: {per_t}\n"
    return text + f"\nEnvironment: `{json.dumps(env)}`\n"


def sweep_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Log-log plot: CPU and wall seconds against T (one line per W), and RSS against T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("cpu_s") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for w in sorted({r["world_size"] for r in done}):
        pts = sorted((r for r in done if r["world_size"] == w), key=lambda r: r["tables"])
        t = [r["tables"] for r in pts]
        (line,) = axes[0].plot(t, [r["cpu_s"] for r in pts], "o-", label=f"W={w} CPU")
        axes[0].plot(
            t, [r["wall_s"] for r in pts], "x--", color=line.get_color(), label=f"W={w} wall"
        )
        axes[1].plot(t, [r["peak_rss_mb"] for r in pts], "o-", label=f"W={w}")
    for ax, ylabel in ((axes[0], "plan() seconds"), (axes[1], "process peak RSS (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tables T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].axhline(10, color="grey", lw=0.8, ls=":")
    axes[0].set_title("FastPlanner plan(): CPU (o) and wall (x)")
    axes[1].set_title("peak RSS (model + planner)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep(tables: list[int], world_sizes: list[int], args: argparse.Namespace) -> int:
    """Run FastPlanner over ``tables x world_sizes`` (fresh process per cell) and report."""
    rows: list[dict[str, Any]] = []
    for t in tables:
        for w in world_sizes:
            row: dict[str, Any] = {"tables": t, "world_size": w}
            try:
                r = run_worker("fast", t, w, args.local_world_size, args.device, args.fast_cap)
            except subprocess.CalledProcessError as e:
                r = None
                row["note"] = f"failed (exit {e.returncode})"
            if r is None:
                row.setdefault("note", f"> {args.fast_cap:g} s cap")
            else:
                row.update({k: v for k, v in r.items() if k != "plan"})
            rows.append(row)
            print(json.dumps(row), flush=True)
    fits = {key: fit_growth(rows, key) for key in ("cpu_s", "wall_s", "peak_rss_mb")}
    env = _environment(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"env": env, "rows": rows, "fits": fits}, indent=2))
    md = (
        "# FastPlanner sweep: tables x world size\n\n"
        f"`python -m benchmarks.planner --sweep --tables {args.tables} "
        f"--world-sizes {args.world_sizes} --out {args.out}`; one fresh process per cell, "
        "`plan()` alone timed.\n\n" + sweep_markdown(rows, fits, env)
    )
    (out / "sweep.md").write_text(md)
    sweep_plot(rows, out / "sweep.png")
    print(md)
    return 0


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
    p.add_argument("--sweep", action="store_true", help="FastPlanner alone over the grid")
    p.add_argument("--profile", help="FastPlanner once under cProfile; statistics to this file")
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
            args.profile,
        )
        return 0
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            worker(
                "fast",
                tables[0],
                world_sizes[0],
                args.local_world_size,
                args.device,
                out,
                args.profile,
            )
            result = json.loads(Path(out).read_text())
        print({k: v for k, v in result.items() if k != "plan"})
        return 0
    if args.sweep:
        return sweep(tables, world_sizes, args)

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
    env = {**_environment(args), "stock_cap_s": args.stock_cap}
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
