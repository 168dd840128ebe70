"""Time to first batch: stock, stock-best and fastinit against the floor, per scenario.

    python -m benchmarks.ttfb                       # 2 ranks, small + medium, 3 repeats
    python -m benchmarks.ttfb --models large --nproc 4 --repeats 1
    python -m benchmarks.ttfb --prime fastinit small new-hosts 2   # make prime
    python -m benchmarks.ttfb --one fastinit small new-hosts 2     # make ttfb: exactly one run
    python -m benchmarks.ttfb --one fastinit small recover 2       # time to recover, one run

Each run launches :mod:`benchmarks.ttfb.trainer` on ``--nproc`` ranks through the torchx component
:func:`benchmarks.ttfb.components.ttfb` (``--launcher torchrun``: torchrun directly); the floor is
:mod:`benchmarks.ttfb.floor` under torchrun. Per repeat and model: for each scenario (cold, then the
restarts, :mod:`benchmarks.ttfb.scenarios`) every mode runs once in the scenario's state, then the
floor with that scenario's caches. The modes' order rotates with the repeat, so drift in the
machine's load does not favour one mode. The ``recover`` scenario (stock-best and fastinit, no
floor) kills a rank mid-job and measures the time from the kill to the first batch after the
resume (:data:`benchmarks.ttfb.scenarios.RECOVER`).

Modules: :mod:`benchmarks.ttfb.launch` (launching), :mod:`benchmarks.ttfb.scenarios` (caches and rules),
:mod:`benchmarks.ttfb.analysis` (traces to numbers, pure), :mod:`benchmarks.ttfb.report` (tables,
targets, pictures). Writes to ``--out`` (default ``bench-out/``): ``summary.json``,
``report.md``, ``timeline.png``, ``trace.json``; prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import time
from typing import Any

from benchmarks.ttfb.analysis import (
    NTH_BATCH,
    TIMELINE,
    analyse_floor,
    analyse_recover,
    analyse_run,
    recover_rows,
    summarize,
    summarize_floor,
    summarize_recover,
    table_rows,
)
from benchmarks.ttfb.launch import RunSpec, run_floor, run_trainer
from benchmarks.ttfb.scenarios import (
    RECOVER,
    RECOVER_MODES,
    SCENARIOS,
    Layout,
    is_primed,
    prepare,
    snapshot_primed,
)
from benchmarks.ttfb.trainer import MODES

#: Where stock's restarted workers find their store (:attr:`BenchConfig.stock_restart`).
STOCK_RESTARTS: tuple[str, ...] = ("store-per-round", "shared-store")

__all__ = [
    "STOCK_RESTARTS",
    "BenchConfig",
    "run_bench",
    "run_recover",
    "prime",
    "run_single",
    "main",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
    """What the driver runs."""

    models: tuple[str, ...] = ("small", "medium")
    """Reference models (keys of :data:`benchmarks.ttfb.trainer.MODELS`)."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Scenarios (a restart scenario always follows a cold run of the same mode)."""
    modes: tuple[str, ...] = MODES
    """Trainer modes."""
    nproc: int = 2
    """Ranks (one host)."""
    repeats: int = 3
    """Repeats per (model, scenario, mode); medians are reported."""
    out: str = "bench-out"
    """Output directory."""
    launcher: str = "torchx"
    """"torchx" (the component, local_cwd scheduler) or "torchrun"."""
    reuse_stock_cold: bool = True
    """Stock's new-hosts runs are its cold runs (it keeps nothing on shared storage)."""
    floor: bool = True
    """Measure the floor per scenario."""
    compile: bool = True
    """Compile the dense arch (off only for tests)."""
    batch_size: int = 256
    """Samples per batch and rank."""
    steps: int = NTH_BATCH
    """Training steps per run: the first gives the time to first batch, the 20th the time to the
    20th batch (the restart target), the ones between a steady-state step to set the first one
    against."""
    timeout_s: float = 1200.0
    """Per-run timeout."""
    recover_timeout_s: float | None = None
    """Timeout of a recover run (None: ``timeout_s``). A run lasts about 20 s; a restart that
    hangs (stock-best's, reading the dead attempt's keys) waits this long to be counted."""
    heavy_repeats: int = 0
    """Runs of the checkpoint-heavy scenario per checkpointer (0: none; ``make bench`` runs it
    once: :mod:`benchmarks.ttfb.heavy`)."""
    stock_restart: str = "store-per-round"
    """Where stock's restarted workers (recover, checkpoint-heavy) find their store:
    "store-per-round" (torch's own workaround, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: worker
    rank 0 hosts a new store every rendezvous round, so a restart reads nothing the dead attempt
    left; what a careful user who met the failure sets) or "shared-store" (torchrun's default:
    the agent's one store for every round, whose stale keys make a restart fail or hang,
    docs/restarts.md; ``python -m benchmarks.restarts`` measures that). fastinit mode runs on
    ``fastinit.init_process_group`` either way."""

    def __post_init__(self) -> None:
        for s in self.scenarios:
            if s not in SCENARIOS:
                raise ValueError(f"unknown scenario {s!r}; one of {SCENARIOS}")
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; one of {MODES}")
        if self.nproc < 1 or self.repeats < 1 or self.heavy_repeats < 0:
            raise ValueError("nproc and repeats must be >= 1, heavy_repeats >= 0")
        if self.launcher not in ("torchx", "torchrun"):
            raise ValueError(f"launcher must be torchx or torchrun, got {self.launcher!r}")
        if self.stock_restart not in STOCK_RESTARTS:
            raise ValueError(
                f"stock_restart must be one of {STOCK_RESTARTS}, got {self.stock_restart!r}"
            )

    def store_per_round(self, mode: str) -> bool:
        """Whether ``mode``'s restarts run with a store per rendezvous round."""
        return mode != "fastinit" and self.stock_restart == "store-per-round"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _spec(config: BenchConfig, layout: Layout, model: str, scenario: str, out: str) -> RunSpec:
    return RunSpec.in_layout(
        layout,
        data_root=config.out,
        mode=layout.mode,
        model=model,
        cache=scenario,
        out=out,
        nproc=config.nproc,
        batch_size=config.batch_size,
        compile=config.compile,
        launcher=config.launcher,
        timeout_s=config.timeout_s,
        steps=config.steps,
    )


def bench_model(model: str, config: BenchConfig) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """All runs of one model: ``{scenario: {mode or "floor": [run, ...]}}``."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {m: [] for m in (*config.modes, "floor")} for s in config.scenarios
    }
    caches = os.path.join(config.out, "caches", model)
    layouts = {m: Layout(root=os.path.join(caches, m), mode=m) for m in (*config.modes, "floor")}
    restarts = [s for s in SCENARIOS if s != "cold" and s in config.scenarios]
    for r in range(config.repeats):
        order = list(config.modes[r % len(config.modes) :] + config.modes[: r % len(config.modes)])
        cold: dict[str, dict[str, Any]] = {}
        for scenario in ("cold", *restarts):
            for mode in order:
                if scenario == "recover":
                    if mode in RECOVER_MODES:
                        out = os.path.join(config.out, "runs", model, scenario, mode, f"r{r}")
                        runs[scenario][mode].append(
                            run_recover(config, layouts[mode], model, out, f"r{r}")
                        )
                    continue
                if scenario == "new-hosts" and mode == "stock" and config.reuse_stock_cold:
                    runs[scenario][mode].append(cold[mode])
                    continue
                layout = layouts[mode]
                prepare(layout, scenario)
                out = os.path.join(config.out, "runs", model, scenario, mode, f"r{r}")
                t = time.monotonic()
                result = analyse_run(run_trainer(_spec(config, layout, model, scenario, out)))
                _say(
                    f"  {model:<7}{scenario:<11}{mode:<11}r{r}  first batch "
                    f"{result['ttfb_s']:6.1f} s  (run {time.monotonic() - t:5.1f} s)"
                )
                if scenario == "cold":
                    cold[mode] = result
                    snapshot_primed(layout)
                if scenario in config.scenarios:
                    runs[scenario][mode].append(result)
            if config.floor and scenario != "recover":  # the cold floor also fills the
                # Inductor directory restarts use
                floor = _floor(config, layouts, model, scenario, r)
                if scenario in config.scenarios:
                    runs[scenario]["floor"].append(floor)
    return runs


def _heavy(config: BenchConfig) -> dict[str, Any]:
    """The checkpoint-heavy scenario (:mod:`benchmarks.ttfb.heavy`), if asked for."""
    if not config.heavy_repeats:
        return {}
    from benchmarks.ttfb import heavy
    from benchmarks.ttfb.data import DatasetConfig, ensure_dataset
    from benchmarks.ttfb.trainer import model_spec

    ensure_dataset(DatasetConfig(spec=model_spec(heavy.MODEL)), os.path.join(config.out, "data"))
    return heavy.run(config)


def run_recover(
    config: BenchConfig, layout: Layout, model: str, out: str, label: str
) -> dict[str, Any]:
    """One recover run (:data:`benchmarks.ttfb.scenarios.RECOVER`): the job under torchrun with
    restarts, a checkpoint, a rank killed, every worker restarted and resumed. A restart that did
    not come back (the job failed, or outlived ``config.timeout_s``: a hang) returns
    ``{"recovered": False, "outcome": "failed" | "hang", "detail": ...}`` instead of raising."""
    from benchmarks.ttfb.faults import KillAt, read_kill

    prepare(layout, "recover")
    kill_file = os.path.abspath(os.path.join(out, "kill.json"))
    kill = KillAt(rank=RECOVER.kill_rank(config.nproc), step=RECOVER.kill_step, record=kill_file)
    spec = dataclasses.replace(
        _spec(config, layout, model, "recover", out),
        steps=RECOVER.steps,
        checkpoint_dir=layout.checkpoint_dir,
        checkpoint_step=RECOVER.checkpoint_step,
        max_restarts=RECOVER.max_restarts,
        store_per_round=config.store_per_round(layout.mode),
        env=kill.env(),
        timeout_s=config.recover_timeout_s or config.timeout_s,
    )
    t = time.monotonic()
    try:
        paths = run_trainer(spec)
    except RuntimeError as e:  # the restart did not come back: counted, not fatal
        outcome = "hang" if "timed out" in str(e) else "failed"
        _say(
            f"  {model:<7}{'recover':<11}{layout.mode:<11}{label}  NOT RECOVERED ({outcome}; "
            f"run {time.monotonic() - t:5.1f} s): {e}"
        )
        return {"recovered": False, "outcome": outcome, "detail": str(e)}
    if not os.path.exists(kill_file):
        raise RuntimeError(f"recover {layout.mode}/{model}: no rank was killed ({kill_file})")
    saves, before = [], {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name.startswith("save-rank") and name.endswith(".json"):
            with open(path) as f:
                saves.append(json.load(f))
        elif name.startswith("losses-a0-rank") and name.endswith(".json"):
            with open(path) as f:
                rank = int(name[len("losses-a0-rank") : -len(".json")])
                before[rank] = {int(k): float(v) for k, v in json.load(f).items()}
    result = analyse_recover(paths, read_kill(kill_file), saves, before)
    result.update(recovered=True, outcome="recovered")
    _say(
        f"  {model:<7}{'recover':<11}{layout.mode:<11}{label}  recovered "
        f"{result['recover_s']:6.1f} s  (kill -> restart {result['restart_s']:.1f} s, "
        f"resume {result['resume_s']:.2f} s; run {time.monotonic() - t:5.1f} s)"
    )
    return result


def _floor(
    config: BenchConfig, layouts: dict[str, Layout], model: str, scenario: str, r: int
) -> dict[str, Any]:
    """The floor with the scenario's caches: an empty Inductor directory when cold, the one the
    floor's own cold run filled when restarting (the best any mode can have on new hosts is a
    warm Inductor directory on shared storage)."""
    layout = layouts["floor"]
    prepare(layout, "cold" if scenario == "cold" else "same-hosts")
    plan = _plan_for_floor(config, layouts, model)
    out = os.path.join(config.out, "runs", model, scenario, "floor", f"r{r}")
    t = time.monotonic()
    result = analyse_floor(run_floor(_spec(config, layout, model, scenario, out), plan))
    _say(
        f"  {model:<7}{scenario:<11}{'floor':<11}r{r}  floor       {result['floor_s']:6.1f} s"
        f"  (run {time.monotonic() - t:5.1f} s)  {result['pieces_s']}"
    )
    return result


def _plan_for_floor(config: BenchConfig, layouts: dict[str, Layout], model: str) -> str:
    """The plan the floor builds from: stock-best's saved plan, else one made here (untimed)."""
    if "stock-best" in layouts and os.path.exists(layouts["stock-best"].plan_file):
        return layouts["stock-best"].plan_file
    path = os.path.join(config.out, "caches", model, f"plan-{config.nproc}.pt")
    if not os.path.exists(path):
        _make_plan(model, config.nproc, path)
    return path


def _make_plan(model: str, nproc: int, path: str) -> None:
    """TorchRec's planner's plan for ``nproc`` CPU ranks on one host, saved with torch.save."""
    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from benchmarks.ttfb.trainer import _sharders, model_spec
    from fastinit.testing.models import build_model

    planner = EmbeddingShardingPlanner(
        topology=Topology(local_world_size=nproc, world_size=nproc, compute_device="cpu")
    )
    plan = planner.plan(build_model(model_spec(model), device="meta"), _sharders())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(plan, path)


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "load_avg_at_start": list(load),
    }


def _versions(raw: dict[str, Any]) -> dict[str, str]:
    for per in raw.values():
        for modes in per.values():
            for mode, runs in modes.items():
                if runs and mode != "floor":
                    return dict(runs[0]["ranks"][0]["versions"])
    return {}


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run everything, write the outputs, return the summary."""
    from benchmarks.ttfb import report
    from benchmarks.ttfb.data import DatasetConfig, ensure_dataset
    from benchmarks.ttfb.trainer import model_spec

    missing = {"stock", "stock-best", "fastinit"} - set(config.modes)
    if missing:
        raise ValueError(f"the report needs every mode; missing {sorted(missing)}")
    os.makedirs(config.out, exist_ok=True)
    t0 = time.monotonic()
    machine = _machine()
    for model in config.models:  # generated once, not timed
        ensure_dataset(DatasetConfig(spec=model_spec(model)), os.path.join(config.out, "data"))
    raw = {model: bench_model(model, config) for model in config.models}
    heavy_summary = _heavy(config)
    machine["load_avg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else []
    results = {
        model: {
            scenario: {mode: summarize(modes[mode]) for mode in config.modes}
            for scenario, modes in per.items()
            if scenario != "recover"
        }
        for model, per in raw.items()
    }
    floors = {
        model: {
            scenario: summarize_floor(modes["floor"])
            for scenario, modes in per.items()
            if modes.get("floor")
        }
        for model, per in raw.items()
    }
    recover = {
        model: {mode: summarize_recover(per["recover"][mode]) for mode in RECOVER_MODES}
        for model, per in raw.items()
        if "recover" in per
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
        "floors": floors,
        "recover": recover,
        "recover_plan": dataclasses.asdict(RECOVER),
        "heavy": heavy_summary,
    }
    summary["table"] = table_rows(results, floors)
    summary["recover_table"] = recover_rows(recover, results)
    summary["targets"] = [dataclasses.asdict(t) for t in report.all_targets(summary)]
    with open(os.path.join(config.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    report.write_report(summary, os.path.join(config.out, "report.md"))
    if raw:
        report.write_timeline(summary, raw, os.path.join(config.out, "timeline.png"))
        report.write_chrome_trace(raw, os.path.join(config.out, "trace.json"))
    print(report.format_table(summary["table"]))
    if summary["recover_table"]:
        print(report.format_recover(summary["recover_table"]))
    print(report.format_targets(report.all_targets(summary)))
    print(f"wall time {summary['wall_s']:.0f} s; outputs in {config.out}/")
    return summary


# -- make prime / make ttfb --------------------------------------------------------------------


def _single_layout(config: BenchConfig, mode: str, model: str) -> Layout:
    return Layout(root=os.path.join(config.out, "one", f"{mode}-{model}-{config.nproc}"), mode=mode)


def _ensure_data(config: BenchConfig, model: str) -> None:
    from benchmarks.ttfb.data import DatasetConfig, ensure_dataset
    from benchmarks.ttfb.trainer import model_spec

    ensure_dataset(DatasetConfig(spec=model_spec(model)), os.path.join(config.out, "data"))


def prime(mode: str, model: str, cache: str, config: BenchConfig) -> None:
    """``make prime``: leave the caches of ``cache`` for (mode, model, nproc) in place: the data
    set, and for a restart scenario one cold run (untimed) whose caches stay."""
    if cache not in SCENARIOS:
        raise ValueError(f"unknown scenario {cache!r}; one of {SCENARIOS}")
    _ensure_data(config, model)
    layout = _single_layout(config, mode, model)
    shutil.rmtree(layout.root, ignore_errors=True)
    prepare(layout, "cold")
    if cache != "cold":
        out = os.path.join(layout.root, "prime-run")
        result = analyse_run(run_trainer(_spec(config, layout, model, "cold", out)))
        _say(
            f"primed {mode} {model} {cache}, {config.nproc} ranks (cold run {result['ttfb_s']:.1f} s)"
        )
    snapshot_primed(layout)
    _say(f"caches in {layout.root}; now `make ttfb` with the same MODE/MODEL/CACHE/NPROC")


def run_single(mode: str, model: str, cache: str, config: BenchConfig) -> dict[str, Any]:
    """``make ttfb``: exactly one run, starting in the scenario's state (after ``make prime``; the
    cold scenario has nothing to prime: its run makes the data set if missing and starts empty)."""
    if cache not in SCENARIOS:
        raise ValueError(f"unknown scenario {cache!r}; one of {SCENARIOS}")
    layout = _single_layout(config, mode, model)
    if cache == "cold":
        _ensure_data(config, model)
    elif not is_primed(layout):
        raise SystemExit(
            f"no primed caches for {mode}/{model}/{config.nproc} ranks in {layout.root}: run "
            f"`make prime MODE={mode} MODEL={model} CACHE={cache} NPROC={config.nproc}` first"
        )
    if cache != "cold" and not os.listdir(layout.primed):
        _say(f"note: {mode} keeps nothing on shared storage; {cache} primed empty")
    if cache == "recover":
        if mode == "stock":
            raise SystemExit(f"the recover scenario runs {' and '.join(RECOVER_MODES)}, not stock")
        res = run_recover(config, layout, model, os.path.join(layout.root, "run-recover"), "")
        if not res.get("recovered", True):
            raise SystemExit(f"{mode} {model} recover: the restart did not come back")
        _say(
            f"{mode} {model} recover, {config.nproc} ranks: time to recover {res['recover_s']:.2f} s"
            f" (kill -> restarted processes {res['restart_s']:.2f} s, their start-up to the first "
            f"batch {res['startup_s']:.2f} s, of which the load {res['resume_s']:.2f} s); the "
            f"save blocked {res['save_blocking_s']:.3f} s, committed in {res['save_commit_s']:.2f} s"
        )
        _say(
            f"  losses after the resume (rank 0): {res['losses'][0]}; the {res['losses_compared']}"
            " trained before the kill too: "
            + ("equal, bit for bit" if res["losses_equal"] else "NOT EQUAL")
        )
        _say(f"  traces: {os.path.dirname(res['paths'][0])}")
        return res
    prepare(layout, cache)
    out = os.path.join(layout.root, f"run-{cache}")
    result = analyse_run(run_trainer(_spec(config, layout, model, cache, out)))
    _say(f"{mode} {model} {cache}, {config.nproc} ranks: first batch {result['ttfb_s']:.2f} s")
    for stage in TIMELINE:
        _say(f"  {stage:<24}{result['stages_s'][stage]:8.2f} s")
    _say(f"  setup: {json.dumps(result['setup'])}")
    _say(f"  traces: {out}")
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="small,medium", help="comma-separated")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--launcher", choices=("torchx", "torchrun"), default="torchx")
    parser.add_argument("--no-reuse", action="store_true", help="run stock new-hosts separately")
    parser.add_argument("--no-floor", action="store_true", help="skip the floor runs")
    parser.add_argument("--no-compile", action="store_true", help="eager dense arch (tests)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per run, seconds")
    parser.add_argument(
        "--recover-timeout",
        type=float,
        default=None,
        help="per recover run, seconds (default: --timeout); a restart not back by then hung",
    )
    parser.add_argument(
        "--stock-restart",
        choices=STOCK_RESTARTS,
        default="store-per-round",
        help="stock's restarts: a store per rendezvous round (torch's workaround, default) or "
        "torchrun's shared store",
    )
    parser.add_argument(
        "--heavy-repeats",
        type=int,
        default=0,
        help="runs of the checkpoint-heavy scenario per checkpointer (0: none; make bench: 1)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=NTH_BATCH,
        help=f"steps per run (the {NTH_BATCH}th: the time to the {NTH_BATCH}th batch)",
    )
    single = parser.add_mutually_exclusive_group()
    single.add_argument(
        "--one",
        nargs=4,
        metavar=("MODE", "MODEL", "CACHE", "NPROC"),
        help="exactly one run, in the scenario's state left by --prime (make ttfb)",
    )
    single.add_argument(
        "--prime",
        nargs=4,
        metavar=("MODE", "MODEL", "CACHE", "NPROC"),
        help="leave the scenario's caches in place for --one (make prime)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    single = args.one or args.prime
    nproc = int(single[3]) if single else args.nproc
    config = BenchConfig(
        models=tuple(m for m in args.models.split(",") if m),
        scenarios=tuple(s for s in args.scenarios.split(",") if s),
        modes=tuple(m for m in args.modes.split(",") if m),
        nproc=nproc,
        repeats=args.repeats,
        out=args.out,
        launcher=args.launcher,
        reuse_stock_cold=not args.no_reuse,
        floor=not args.no_floor,
        compile=not args.no_compile,
        timeout_s=args.timeout,
        recover_timeout_s=args.recover_timeout,
        stock_restart=args.stock_restart,
        steps=args.steps,
        heavy_repeats=args.heavy_repeats,
    )
    if single:
        mode, model, cache, _ = single
        if mode not in MODES:
            raise SystemExit(f"MODE must be one of {', '.join(MODES)}, got {mode!r}")
        if args.prime:
            prime(mode, model, cache, config)
            return {}
        return run_single(mode, model, cache, config)
    return run_bench(config)


if __name__ == "__main__":
    main()
