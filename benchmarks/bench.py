"""Time to first batch, stock TorchRec against fastinit: per stage, per rank, with a picture.

    python -m benchmarks.bench                       # default: 2 ranks, small + medium, 3 repeats
    python -m benchmarks.bench --models large --nproc 4 --scenarios cold
    python -m benchmarks.bench --one fastinit small new-hosts 2   # one run (make ttfb)

Each run launches :mod:`benchmarks.trainer` on ``--nproc`` ranks through the torchx component
:func:`benchmarks.components.ttfb` (torchx's ``local_cwd`` scheduler; ``--launcher torchrun`` runs
torchrun directly). Stock and fastinit alternate, for three scenarios:

* ``cold``: no caches at all (a fresh Inductor directory; an empty fastinit cache directory);
* ``new-hosts``: a restart on other hosts: fastinit's cache directory (shared storage: plan
  cache, compile-cache entries) is kept, host-local caches are wiped (a fresh default Inductor
  directory; with ``--megacache-only`` also the Inductor directory inside fastinit's compile-cache
  entry, so only the portable MegaCache file travels). Stock has no cache that survives
  a host change, so its new-hosts runs are its cold runs (reused unless ``--no-reuse``);
* ``same-hosts``: a restart on the same hosts: every local cache is kept, for both (stock keeps
  the Inductor directory its cold run filled).

Writes to ``--out`` (default ``bench-out/``): ``summary.json`` (per scenario and mode: time to
first batch as the median over repeats of the max over ranks, per-stage medians, start-up c10d
ops / bytes / process groups / store ops per rank, peak RSS, the critical path, versions),
``report.md`` (the table, with fastinit/stock ratios), ``timeline.png`` (a Gantt chart per rank,
stock above fastinit) and ``trace.json`` (Chrome/Perfetto). Prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.trainer import FASTINIT_DEPS, STAGES

__all__ = [
    "BenchConfig",
    "RunSpec",
    "run_one",
    "analyse_run",
    "critical_path",
    "summarize",
    "write_report",
    "main",
]

MODES: tuple[str, ...] = ("stock", "fastinit")
SCENARIOS: tuple[str, ...] = ("cold", "new-hosts", "same-hosts")
#: Spans drawn and tabulated: interpreter start + imports, the seven stages, the first step.
TIMELINE: tuple[str, ...] = ("launch", *STAGES, "first_step")
COLORS: dict[str, str] = {
    "launch": "#bbbbbb",
    "device_init": "#8c564b",
    "process_group_init": "#e377c2",
    "preproc_creation": "#17becf",
    "train_module_creation": "#1f77b4",
    "init_plugins": "#9467bd",
    "pre_train": "#ff7f0e",
    "get_first_batch_data": "#2ca02c",
    "first_step": "#d62728",
}


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
    """What the driver runs."""

    models: tuple[str, ...] = ("small", "medium")
    """Reference models (keys of :data:`benchmarks.trainer.MODELS`)."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Cache scenarios."""
    nproc: int = 2
    """Ranks (one host)."""
    repeats: int = 3
    """Repeats per (model, scenario, mode); medians are reported."""
    out: str = "bench-out"
    """Output directory."""
    launcher: str = "torchx"
    """"torchx" (the component, local_cwd scheduler) or "torchrun"."""
    reuse_stock_cold: bool = True
    """Stock's new-hosts runs are its cold runs (stock has no cache that survives new hosts)."""
    megacache_only: bool = False
    """new-hosts: also wipe the Inductor directory inside fastinit's compile-cache entry, so only
    the portable MegaCache file (and the plan cache) travel to the new hosts."""
    compile: bool = True
    """Compile the dense arch (off only for tests)."""
    batch_size: int = 256
    """Samples per batch and rank."""
    timeout_s: float = 1200.0
    """Per-run timeout."""

    def __post_init__(self) -> None:
        for s in self.scenarios:
            if s not in SCENARIOS:
                raise ValueError(f"unknown scenario {s!r}; one of {SCENARIOS}")
        if self.nproc < 1 or self.repeats < 1:
            raise ValueError("nproc and repeats must be >= 1")
        if self.launcher not in ("torchx", "torchrun"):
            raise ValueError(f"launcher must be torchx or torchrun, got {self.launcher!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class RunSpec:
    """One launch of the trainer."""

    mode: str
    model: str
    cache: str
    out: str
    """Trace directory of this run."""
    inductor_dir: str
    """``TORCHINDUCTOR_CACHE_DIR`` of the ranks."""
    cache_dir: str | None = None
    """fastinit's cache root (fastinit mode)."""


# -- launching ---------------------------------------------------------------------------------


def _env(spec: RunSpec) -> dict[str, str]:
    return {
        "TORCHINDUCTOR_CACHE_DIR": spec.inductor_dir,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONWARNINGS": "ignore",
        "LOGLEVEL": "WARNING",
    }


def run_one(spec: RunSpec, config: BenchConfig) -> list[str]:
    """Launch one run; returns its per-rank trace files. Raises RuntimeError if it failed."""
    from benchmarks.components import trainer_args, ttfb

    shutil.rmtree(spec.out, ignore_errors=True)
    os.makedirs(spec.out, exist_ok=True)
    data_dir = os.path.join(config.out, "data")
    log = os.path.join(spec.out, "launch.log")
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    if config.launcher == "torchx":
        app = ttfb(
            mode=spec.mode,
            model=spec.model,
            cache=spec.cache,
            out=spec.out,
            cache_dir=spec.cache_dir,
            data_dir=data_dir,
            nproc=config.nproc,
            batch_size=config.batch_size,
            no_compile=not config.compile,
            env=_env(spec),
        )
        ok, detail = _run_torchx(app, spec, config, env)
    else:
        args = trainer_args(
            spec.mode,
            spec.model,
            spec.cache,
            spec.out,
            spec.cache_dir,
            data_dir,
            config.batch_size,
            1,
            not config.compile,
        )
        cmd = [
            os.path.join(bin_dir, "torchrun"),
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(config.nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "--local-addr",
            "127.0.0.1",
            "-m",
            "benchmarks.trainer",
            *args,
        ]
        with open(log, "w") as f:
            proc = subprocess.run(
                cmd,
                env={**env, **_env(spec)},
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=config.timeout_s,
                check=False,
            )
        ok, detail = proc.returncode == 0, f"exit code {proc.returncode}; log {log}"
    paths = sorted(
        os.path.join(spec.out, f) for f in os.listdir(spec.out) if f.startswith("trace-rank")
    )
    if not ok or len(paths) != config.nproc:
        raise RuntimeError(
            f"run {spec.mode}/{spec.model}/{spec.cache} failed ({detail}); "
            f"{len(paths)} of {config.nproc} trace files"
        )
    return paths


def _run_torchx(
    app: Any, spec: RunSpec, config: BenchConfig, env: dict[str, str]
) -> tuple[bool, str]:
    """Run the AppDef on torchx's local_cwd scheduler and wait for it."""
    from torchx.runner import get_runner

    log_dir = os.path.join(spec.out, "torchx")
    saved = dict(os.environ)
    os.environ["PATH"] = env["PATH"]  # the scheduler resolves torchrun through PATH
    try:
        with get_runner() as runner:
            handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": log_dir})
            deadline = time.monotonic() + config.timeout_s
            status = None
            while time.monotonic() < deadline:
                status = runner.status(handle)
                if status is not None and status.is_terminal():
                    break
                time.sleep(0.5)
            else:
                runner.cancel(handle)
                return False, f"timed out after {config.timeout_s:.0f}s; logs {log_dir}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    state = getattr(status, "state", None)
    return str(state).endswith("SUCCEEDED"), f"torchx state {state}; logs {log_dir}"


# -- analysis ----------------------------------------------------------------------------------


def critical_path(
    durations: dict[str, float], deps: dict[str, tuple[str, ...]]
) -> tuple[float, list[str]]:
    """Longest chain through the stage DAG ``deps`` weighted by ``durations``: (seconds, chain)."""
    best: dict[str, tuple[float, list[str]]] = {}

    def longest(stage: str) -> tuple[float, list[str]]:
        if stage not in best:
            prev = max((longest(d) for d in deps.get(stage, ())), default=(0.0, []))
            best[stage] = (prev[0] + durations.get(stage, 0.0), [*prev[1], stage])
        return best[stage]

    return max((longest(s) for s in deps), default=(0.0, []))


def analyse_run(paths: Sequence[str]) -> dict[str, Any]:
    """Per-rank numbers of one run from its trace files."""
    from fastinit.trace import read_jsonl, summarize

    ranks: list[dict[str, Any]] = []
    for path in paths:
        events = read_jsonl(path)
        bench = next(e for e in events if e.get("kind") == "bench")
        spans = [e for e in events if e.get("kind") == "span"]
        stage_spans = {e["name"]: e for e in spans if e["name"] in TIMELINE}
        t0 = bench["process_start"] * 1e6
        first = stage_spans["first_step"]["ts"]

        comm = [e for e in events if e.get("kind") in ("c10d", "store", "group")]
        startup = [e for e in comm if e["ts"] < first]
        by_stage: dict[str, list[dict[str, Any]]] = {}
        for e in startup:
            by_stage.setdefault(_stage_of(e, stage_spans), []).append(e)
        warm = by_stage.get("pre_train", [])
        setup = [e for e in startup if e not in warm]
        durations = {name: s["dur"] / 1e6 for name, s in stage_spans.items()}
        crit_s, chain = critical_path(durations, FASTINIT_DEPS)
        fixed = durations.get("launch", 0.0) + durations.get("first_step", 0.0)
        ranks.append(
            {
                "rank": bench["rank"],
                "ttfb_s": bench["ttfb_s"],
                "stages_s": durations,
                "stage_start_s": {n: (s["ts"] - t0) / 1e6 for n, s in stage_spans.items()},
                "threads": {n: s.get("thread", "") for n, s in stage_spans.items()},
                "setup": _counts(summarize(setup)),
                "setup_by_op": _by_op(setup),
                "warmup": _counts(summarize(warm)),
                "per_stage_c10d": {k: summarize(v)["c10d_total"] for k, v in by_stage.items() if v},
                "critical_path_s": crit_s + fixed,
                "critical_chain": ["launch", *chain, "first_step"],
                "peak_rss_mb": bench["peak_rss_mb"],
                "info": {
                    k: bench[k]
                    for k in (
                        "compile_cache",
                        "warmup_graphs",
                        "first_step_graphs",
                        "graphs_total",
                        "loss",
                        "master_addr",
                    )
                    if k in bench
                },
                "versions": bench["versions"],
            }
        )
    ranks.sort(key=lambda r: r["rank"])
    worst = max(ranks, key=lambda r: r["ttfb_s"])
    return {
        "ttfb_s": worst["ttfb_s"],
        "stages_s": {s: max(r["stages_s"].get(s, 0.0) for r in ranks) for s in TIMELINE},
        "critical_path_s": max(r["critical_path_s"] for r in ranks),
        "critical_chain": max(ranks, key=lambda r: r["critical_path_s"])["critical_chain"],
        "setup": {k: max(r["setup"][k] for r in ranks) for k in ranks[0]["setup"]},
        "warmup": {k: max(r["warmup"][k] for r in ranks) for k in ranks[0]["warmup"]},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "setup_by_op": max(ranks, key=lambda r: r["setup"]["c10d_ops"])["setup_by_op"],
        "ranks": ranks,
        "paths": list(paths),
    }


def _stage_of(event: dict[str, Any], stage_spans: dict[str, dict[str, Any]]) -> str:
    """The stage an event happened in: the span on its thread that contains it, else any."""
    for name, s in stage_spans.items():
        if s.get("tid") == event.get("tid") and s["ts"] <= event["ts"] <= s["ts"] + s["dur"]:
            return name
    for name, s in stage_spans.items():
        if name != "launch" and s["ts"] <= event["ts"] <= s["ts"] + s["dur"]:
            return name
    return "other"


def _by_op(events: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("kind") == "c10d":
            slot = out.setdefault(e["name"], {"count": 0, "bytes": 0})
            slot["count"] += 1
            slot["bytes"] += int(e.get("bytes", 0))
    return out


def _counts(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "c10d_ops": s["c10d_total"],
        "c10d_bytes": s["c10d_bytes"],
        "barriers": s["barriers"],
        "new_groups": s["new_groups"],
        "store_ops": s["store_total"],
        "store_bytes": s["store_bytes"],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of one (model, scenario, mode)."""
    med = statistics.median
    chains = [tuple(r["critical_chain"]) for r in runs]
    return {
        "repeats": len(runs),
        "ttfb_s": med(r["ttfb_s"] for r in runs),
        "ttfb_all_s": [r["ttfb_s"] for r in runs],
        "stages_s": {s: med(r["stages_s"][s] for r in runs) for s in TIMELINE},
        "critical_path_s": med(r["critical_path_s"] for r in runs),
        "critical_chain": list(max(set(chains), key=chains.count)),
        "setup": {k: med(r["setup"][k] for r in runs) for k in runs[0]["setup"]},
        "warmup": {k: med(r["warmup"][k] for r in runs) for k in runs[0]["warmup"]},
        "peak_rss_mb": med(r["peak_rss_mb"] for r in runs),
        "setup_by_op": runs[0]["setup_by_op"],
        "info": runs[0]["ranks"][0]["info"],
    }


# -- the scenarios -----------------------------------------------------------------------------


def _fresh(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _wipe_host_local(cache_dir: str) -> None:
    """What a new host lacks: the Inductor directories inside fastinit's compile cache."""
    compile_root = os.path.join(cache_dir, "compile")
    if os.path.isdir(compile_root):
        for entry in os.listdir(compile_root):
            shutil.rmtree(os.path.join(compile_root, entry, "inductor"), ignore_errors=True)


def _say(msg: str) -> None:
    print(msg, flush=True)


def bench_model(model: str, config: BenchConfig) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """All runs of one model: ``{scenario: {mode: [run, ...]}}``."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {m: [] for m in MODES} for s in config.scenarios
    }
    scratch = os.path.join(config.out, "caches", model)
    for r in range(config.repeats):
        stock_ind = _fresh(scratch, f"r{r}-stock-inductor")
        fi_cache = _fresh(scratch, f"r{r}-fastinit")

        def launch(
            mode: str, scenario: str, inductor: str, r: int = r, fi_cache: str = fi_cache
        ) -> dict[str, Any]:
            spec = RunSpec(
                mode=mode,
                model=model,
                cache=scenario,
                out=os.path.join(config.out, "runs", model, scenario, mode, f"r{r}"),
                inductor_dir=inductor,
                cache_dir=fi_cache if mode == "fastinit" else None,
            )
            t = time.monotonic()
            result = analyse_run(run_one(spec, config))
            _say(
                f"  {model:<7}{scenario:<11}{mode:<9}r{r}  first batch {result['ttfb_s']:6.1f} s"
                f"  (run {time.monotonic() - t:5.1f} s)"
            )
            return result

        need_cold = any(s in config.scenarios for s in SCENARIOS)
        # cold: nothing cached anywhere.
        if need_cold:
            stock_cold = launch("stock", "cold", stock_ind)
            fi_cold = launch("fastinit", "cold", _fresh(scratch, f"r{r}-ind-a"))
            if "cold" in config.scenarios:
                runs["cold"]["stock"].append(stock_cold)
                runs["cold"]["fastinit"].append(fi_cold)
        if "new-hosts" in config.scenarios:
            if config.reuse_stock_cold:
                runs["new-hosts"]["stock"].append(stock_cold)
            else:
                runs["new-hosts"]["stock"].append(
                    launch("stock", "new-hosts", _fresh(scratch, f"r{r}-ind-b"))
                )
            if config.megacache_only:
                _wipe_host_local(fi_cache)
            runs["new-hosts"]["fastinit"].append(
                launch("fastinit", "new-hosts", _fresh(scratch, f"r{r}-ind-c"))
            )
        if "same-hosts" in config.scenarios:
            runs["same-hosts"]["stock"].append(launch("stock", "same-hosts", stock_ind))
            runs["same-hosts"]["fastinit"].append(
                launch("fastinit", "same-hosts", _fresh(scratch, f"r{r}-ind-a-kept"))
            )
    return runs


# -- outputs -----------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "load_avg_at_start": list(load),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, scenario): stock and fastinit side by side."""
    rows = []
    for model, per_scenario in summary["results"].items():
        for scenario, modes in per_scenario.items():
            s, f = modes["stock"], modes["fastinit"]
            rows.append(
                {
                    "model": model,
                    "scenario": scenario,
                    "stock_s": s["ttfb_s"],
                    "fastinit_s": f["ttfb_s"],
                    "ratio": _ratio(f["ttfb_s"], s["ttfb_s"]),
                    "critical_s": f["critical_path_s"],
                    "vs_critical": _ratio(f["ttfb_s"], f["critical_path_s"]),
                    "bound": _bound(f),
                    "stock_ops": s["setup"]["c10d_ops"],
                    "fastinit_ops": f["setup"]["c10d_ops"],
                    "stock_bytes": s["setup"]["c10d_bytes"],
                    "fastinit_bytes": f["setup"]["c10d_bytes"],
                    "stock_groups": s["setup"]["new_groups"],
                    "fastinit_groups": f["setup"]["new_groups"],
                    "stock_store": s["setup"]["store_ops"],
                    "fastinit_store": f["setup"]["store_ops"],
                    "warmup_ops": f["warmup"]["c10d_ops"],
                    "stock_rss": s["peak_rss_mb"],
                    "fastinit_rss": f["peak_rss_mb"],
                }
            )
    return rows


def _bound(result: dict[str, Any]) -> str:
    """The longest stage on the critical chain (what bounds fastinit's time)."""
    chain = [s for s in result["critical_chain"] if s != "launch"]
    return max(chain, key=lambda s: result["stages_s"].get(s, 0.0)) if chain else ""


def format_table(rows: list[dict[str, Any]]) -> str:
    """The headline table, as Markdown."""
    head = (
        "| model | scenario | stock s | fastinit s | fastinit/stock | critical path s "
        "| fastinit/critical | bounded by | setup c10d ops (stock → fastinit) "
        "| bytes | new groups | store ops | peak RSS MB |\n"
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['model']} | {r['scenario']} | {r['stock_s']:.1f} | {r['fastinit_s']:.1f} "
        f"| **{r['ratio']:.2f}** | {r['critical_s']:.1f} | {r['vs_critical']:.2f} | {r['bound']} "
        f"| {r['stock_ops']:.0f} → {r['fastinit_ops']:.0f} "
        f"| {r['stock_bytes']:.0f} → {r['fastinit_bytes']:.0f} "
        f"| {r['stock_groups']:.0f} → {r['fastinit_groups']:.0f} "
        f"| {r['stock_store']:.0f} → {r['fastinit_store']:.0f} "
        f"| {r['stock_rss']:.0f} / {r['fastinit_rss']:.0f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def format_stages(summary: dict[str, Any]) -> str:
    """Per-stage medians (max over ranks), seconds."""
    head = "| model | scenario | mode | " + " | ".join(TIMELINE) + " | ttfb |\n"
    head += "|---|---|---|" + "---:|" * (len(TIMELINE) + 1) + "\n"
    lines = []
    for model, per_scenario in summary["results"].items():
        for scenario, modes in per_scenario.items():
            for mode, res in modes.items():
                cells = " | ".join(f"{res['stages_s'][s]:.2f}" for s in TIMELINE)
                lines.append(f"| {model} | {scenario} | {mode} | {cells} | {res['ttfb_s']:.2f} |")
    return head + "\n".join(lines) + "\n"


def write_timeline(summary: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    """A Gantt chart per rank (stages coloured, overlapping stages on sub-lanes), stock above
    fastinit, one panel per (model, scenario), for the median repeat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(m, s) for m, per in raw.items() for s in per]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 1.0 + 1.2 * len(panels) * 2), squeeze=False
    )
    for ax, (model, scenario) in zip(axes[:, 0], panels, strict=True):
        labels: list[str] = []
        row = 0
        for mode in MODES:
            runs = raw[model][scenario][mode]
            run = sorted(runs, key=lambda r: r["ttfb_s"])[len(runs) // 2]
            for rank in run["ranks"]:
                lanes = sorted(set(rank["threads"].values()))
                lane_of = {t: i for i, t in enumerate(lanes)}
                h = 0.8 / max(1, len(lanes))
                for stage in TIMELINE:
                    if stage not in rank["stages_s"]:
                        continue
                    y = row - 0.4 + lane_of[rank["threads"][stage]] * h
                    ax.broken_barh(
                        [(rank["stage_start_s"][stage], rank["stages_s"][stage])],
                        (y, h * 0.95),
                        facecolors=COLORS[stage],
                    )
                ax.plot([rank["ttfb_s"]] * 2, [row - 0.45, row + 0.45], color="k", lw=1.5)
                labels.append(f"{mode} r{rank['rank']}")
                row += 1
        ax.set_yticks(range(row), labels)
        ax.invert_yaxis()
        res = summary["results"][model][scenario]
        ax.set_title(
            f"{model}, {scenario}: stock {res['stock']['ttfb_s']:.1f} s, "
            f"fastinit {res['fastinit']['ttfb_s']:.1f} s (median; bars: median repeat)",
            fontsize=9,
        )
        ax.set_xlabel("seconds since process start (black line: first batch consumed)")
        ax.grid(axis="x", alpha=0.3)
    fig.legend(
        handles=[Patch(color=c, label=n) for n, c in COLORS.items()],
        loc="upper center",
        ncol=5,
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_chrome_trace(raw: dict[str, Any], path: str) -> None:
    """Every run's ranks in one Chrome/Perfetto trace (one process per run and rank)."""
    from fastinit.trace import to_chrome_trace

    events: list[dict[str, Any]] = []
    index = 0
    seen: set[int] = set()
    for model, per in raw.items():
        for scenario, modes in per.items():
            for mode, runs in modes.items():
                for r, run in enumerate(runs):
                    if id(run) in seen:  # stock's cold runs standing for new-hosts
                        continue
                    seen.add(id(run))
                    label = f"{model} {scenario} {mode} r{r}"
                    trace = to_chrome_trace(
                        run["paths"], label=lambda k, lb=label: f"{lb} rank {k}"
                    )
                    for e in trace["traceEvents"]:
                        e["pid"] = index * 1000 + int(e["pid"])
                    events.extend(trace["traceEvents"])
                    index += 1
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def write_report(summary: dict[str, Any], rows: list[dict[str, Any]], path: str) -> None:
    """``report.md``: the headline table, per-stage medians, what was run."""
    cfg = summary["config"]
    v = summary["versions"]
    m = summary["machine"]
    text = [
        "# Time to first batch: stock TorchRec vs fastinit\n",
        f"{summary['date']}; {cfg['nproc']} ranks on one host ({m['cpus']} CPUs, "
        f"{m['processor']}, load average at start {m['load_avg_at_start'][0]:.1f}); "
        f"torch {v.get('torch')}, torchrec {v.get('torchrec')}, fbgemm_gpu {v.get('fbgemm_gpu')}, "
        f"torchx {v.get('torchx')}, Python {v.get('python')}; launched with "
        f"{summary['launcher']}; median of {cfg['repeats']} repeat(s), each the max over ranks.\n",
        "Time to first batch is measured on every rank from its process start to the return of "
        "the first `TrainPipelineSparseDist.progress`. Ratios from the same run are the result; "
        "absolute seconds on a shared machine are noise. *Critical path*: the longest chain of "
        "fastinit's stage graph (launch → stages → first step) with the stage durations measured "
        "in the same fastinit run; *bounded by*: the longest stage on it. Setup ops: c10d ops, "
        "bytes sent, process groups created and store operations per rank before the first step, "
        "excluding fastinit's warm-up step on the fast batch (whose all-to-alls and all-reduces "
        "are training collectives moved earlier: "
        + ", ".join(f"{r['model']}/{r['scenario']} {r['warmup_ops']:.0f}" for r in rows)
        + ").\n",
        format_table(rows),
        "\n## Stages (seconds, median over repeats of the max over ranks)\n",
        "Stock runs the stages one after the other; fastinit overlaps `preproc_creation` + "
        "`get_first_batch_data` with `train_module_creation` and `pre_train` (compilation on a "
        "fast batch), so its stage times add up to more than its time to first batch. Stock "
        "compiles lazily inside `first_step`.\n",
        format_stages(summary),
        "\n## Scenarios\n",
        "- **cold**: fresh Inductor directory, empty fastinit cache directory.\n"
        "- **new-hosts**: fastinit's cache directory kept (plan cache and compile-cache entries, "
        "as on shared storage), host-local caches wiped (a fresh default Inductor directory"
        + (
            "; also the Inductor directory inside the compile-cache entry: only the MegaCache "
            "file travels)"
            if cfg["megacache_only"]
            else ")"
        )
        + ". Stock keeps nothing across hosts"
        + (", so its cold runs stand for it." if cfg["reuse_stock_cold"] else ".")
        + "\n- **same-hosts**: all local caches kept (stock: the Inductor directory of its cold "
        "run).\n",
        "\n`timeline.png`: Gantt chart per rank (median repeat); `trace.json`: every run in "
        "Perfetto / chrome://tracing.\n",
    ]
    extra = [ett_section(rows)]
    with open(path, "w") as f:
        f.write("\n".join([*text, *extra]))


def ett_section(rows: list[dict[str, Any]]) -> str:
    """What the measured restart saving is worth in ETT points, for a stated job profile."""
    from benchmarks.ett import JobProfile, ett, ett_points_saved

    restarts = [r for r in rows if r["scenario"] == "new-hosts"] or rows
    if not restarts:
        return ""
    row = restarts[-1]
    profile = JobProfile(
        time_to_start_s=row["stock_s"],
        time_to_recover_s=120.0,
        failures_per_day=3.0,
        checkpoint_blocking_s=30.0,
    )
    stock = ett(profile)
    fast = ett(JobProfile(**{**_profile_dict(profile), "time_to_start_s": row["fastinit_s"]}))
    points = ett_points_saved(profile, row["stock_s"], row["fastinit_s"])
    return (
        "\n## What it is worth (ETT)\n\n"
        f"Job profile: restarts on new hosts taking the measured {row['model']} / "
        f"{row['scenario']} times to first batch (stock {row['stock_s']:.1f} s, fastinit "
        f"{row['fastinit_s']:.1f} s), 3 failures a day (the order of the 7.9 h mean time to "
        "failure reported for 1,024-GPU jobs by Kokolis et al., *Revisiting Reliability in "
        "Large-Scale Machine Learning Research Clusters*, 2024), 120 s to recover (checkpoint "
        "load) per restart, checkpoints blocking 30 s, each at its optimal (Young) interval "
        f"(stock {stock.interval_s / 60:.1f} min, fastinit {fast.interval_s / 60:.1f} min). "
        f"ETT {stock.ett_pct:.3f}% → {fast.ett_pct:.3f}%: **{points:+.3f} ETT points** "
        f"({points / 100 * 86400:.0f} s of training a day). The model (`benchmarks/ett.py`): "
        "unsaved work = failures × interval / 2, checkpoint blocking = loop time / interval × "
        "blocking per checkpoint, restarts = failures × (start + recover). At production scale "
        "the saving per restart is the projected one (below), not this machine's seconds.\n"
    )


def _profile_dict(profile: Any) -> dict[str, Any]:
    return {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}


def _versions(raw: dict[str, Any]) -> dict[str, str]:
    for per in raw.values():
        for modes in per.values():
            for runs in modes.values():
                if runs:
                    return dict(runs[0]["ranks"][0]["versions"])
    return {}


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run everything, write the outputs, return the summary."""
    from benchmarks.data import DatasetConfig, ensure_dataset
    from benchmarks.trainer import model_spec

    os.makedirs(config.out, exist_ok=True)
    t0 = time.monotonic()
    machine = _machine()
    for model in config.models:  # generated once, not timed
        ensure_dataset(DatasetConfig(spec=model_spec(model)), os.path.join(config.out, "data"))
    raw: dict[str, Any] = {}
    for model in config.models:
        raw[model] = bench_model(model, config)
    results = {
        model: {
            scenario: {mode: summarize(runs) for mode, runs in modes.items()}
            for scenario, modes in per.items()
        }
        for model, per in raw.items()
    }
    summary: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": dataclasses.asdict(config),
        "launcher": config.launcher
        + (" (local_cwd scheduler)" if config.launcher == "torchx" else ""),
        "machine": machine,
        "versions": _versions(raw),
        "wall_s": time.monotonic() - t0,
        "results": results,
    }
    rows = table_rows(summary)
    summary["table"] = rows
    with open(os.path.join(config.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    write_report(summary, rows, os.path.join(config.out, "report.md"))
    write_timeline(summary, raw, os.path.join(config.out, "timeline.png"))
    write_chrome_trace(raw, os.path.join(config.out, "trace.json"))
    print(format_table(rows))
    print(f"wall time {summary['wall_s']:.0f} s; outputs in {config.out}/")
    return summary


def run_single(
    mode: str, model: str, cache: str, nproc: int, config: BenchConfig
) -> dict[str, Any]:
    """One run (``make ttfb``), with the caches its scenario needs primed by an untimed run."""
    from benchmarks.data import DatasetConfig, ensure_dataset
    from benchmarks.trainer import model_spec

    ensure_dataset(DatasetConfig(spec=model_spec(model)), os.path.join(config.out, "data"))
    config.nproc = nproc
    scratch = os.path.join(config.out, "caches", f"one-{model}")
    fi_cache = _fresh(scratch, "fastinit")
    inductor = _fresh(scratch, "inductor")

    def spec(label: str, ind: str) -> RunSpec:
        return RunSpec(
            mode=mode,
            model=model,
            cache=cache,
            out=os.path.join(config.out, "one", f"{mode}-{model}-{label}"),
            inductor_dir=ind,
            cache_dir=fi_cache if mode == "fastinit" else None,
        )

    if cache != "cold" and not (mode == "stock" and cache == "new-hosts"):
        _say(f"priming the caches for {cache} (untimed run)")
        run_one(spec("prime", inductor), config)
        if cache == "new-hosts":
            if config.megacache_only:
                _wipe_host_local(fi_cache)
            inductor = _fresh(scratch, "inductor-new-host")
    result = analyse_run(run_one(spec(cache, inductor), config))
    _say(f"{mode} {model} {cache}, {nproc} ranks: first batch {result['ttfb_s']:.2f} s")
    for stage in TIMELINE:
        _say(f"  {stage:<24}{result['stages_s'][stage]:8.2f} s")
    _say(f"  setup: {json.dumps(result['setup'])}")
    _say(
        f"  critical path {result['critical_path_s']:.2f} s: {' > '.join(result['critical_chain'])}"
    )
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="small,medium", help="comma-separated")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--launcher", choices=("torchx", "torchrun"), default="torchx")
    parser.add_argument("--no-reuse", action="store_true", help="run stock new-hosts separately")
    parser.add_argument("--no-compile", action="store_true", help="eager dense arch (tests)")
    parser.add_argument(
        "--megacache-only",
        action="store_true",
        help="new-hosts: ship only the MegaCache file, not the compile entry's Inductor directory",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="per run, seconds")
    parser.add_argument(
        "--one",
        nargs=4,
        metavar=("MODE", "MODEL", "CACHE", "NPROC"),
        help="one run that exits right after the first batch",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    config = BenchConfig(
        models=tuple(m for m in args.models.split(",") if m),
        scenarios=tuple(s for s in args.scenarios.split(",") if s),
        nproc=args.nproc,
        repeats=args.repeats,
        out=args.out,
        launcher=args.launcher,
        reuse_stock_cold=not args.no_reuse,
        megacache_only=args.megacache_only,
        compile=not args.no_compile,
        timeout_s=args.timeout,
    )
    if args.one:
        mode, model, cache, nproc = args.one
        return run_single(mode, model, cache, int(nproc), config)
    return run_bench(config)


if __name__ == "__main__":
    main()
