"""Kill-and-restart cycles: how often a torchrun restart comes back, stock-best against fastinit.

    python -m benchmarks.restarts                       # 20 cycles per mode at 2 and 4 ranks
    python -m benchmarks.restarts --cycles 2 --nproc 2  # a smoke run

Each cycle is one run of the benchmark's recover scenario (:func:`benchmarks.ttfb.main.run_recover`,
:data:`benchmarks.ttfb.scenarios.RECOVER`): the trainer under ``torchrun --max-restarts 1`` (as users
write it), a checkpoint after step 2, the last rank SIGKILLed after step 4, torchrun restarting
every worker, which resume from the checkpoint. A cycle *recovered* when the job finished its
steps after the restart; *failed* when torchrun gave up (the restart failed); *hung* when it
outlived ``--timeout`` (then torchrun and every worker are killed). Time to recover: from the kill
to the first batch after the resume. stock-best makes its process group as
``init_process_group`` does on ``env://``; fastinit with :func:`fastinit.init_process_group`.

Per rank count: one untimed cold run per mode leaves the caches (as ``make prime``), then the
cycles alternate the two modes (the order flips every cycle, so drift in the machine's load
favours neither). The machine is used as it is: the load average is recorded at every cycle.
Writes ``summary.json`` and ``report.md`` to ``--out`` (default
``benchmarks/results/restarts``); the runs' traces stay in ``--work``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["run_cycles", "summarize", "format_report", "main"]

MODES: tuple[str, ...] = ("stock-best", "fastinit")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _cycle_record(res: Mapping[str, Any], mode: str, nproc: int, cycle: int) -> dict[str, Any]:
    keep = ("recover_s", "restart_s", "startup_s", "resume_s", "losses_equal", "losses_compared")
    rec: dict[str, Any] = {
        "mode": mode,
        "nproc": nproc,
        "cycle": cycle,
        "outcome": res.get("outcome", "recovered"),
    }
    if res.get("recovered", True):
        rec.update({k: res[k] for k in keep})
        rec["versions"] = res["ranks"][0].get("versions", {})
    else:
        rec["detail"] = res.get("detail", "")
    return rec


def run_cycles(
    cycles: int,
    nprocs: Sequence[int],
    model: str,
    work: str,
    timeout_s: float,
    compile: bool,
    modes: Sequence[str] = MODES,
) -> list[dict[str, Any]]:
    """Run the cycles; one record per cycle (mode, rank count, outcome, times, load)."""
    from benchmarks.ttfb.main import BenchConfig, prime, run_recover
    from benchmarks.ttfb.scenarios import Layout

    records: list[dict[str, Any]] = []
    for nproc in nprocs:
        config = BenchConfig(
            models=(model,),
            modes=tuple(modes),
            nproc=nproc,
            out=work,
            launcher="torchrun",
            compile=compile,
            timeout_s=timeout_s,
            steps=3,
        )
        layouts = {}
        for mode in modes:
            prime(mode, model, "recover", config)
            layouts[mode] = Layout(
                root=os.path.join(work, "one", f"{mode}-{model}-{nproc}"), mode=mode
            )
        for cycle in range(cycles):
            for mode in modes if cycle % 2 == 0 else tuple(reversed(modes)):
                out = os.path.join(work, "cycles", f"{mode}-{nproc}", f"c{cycle}")
                shutil.rmtree(out, ignore_errors=True)
                load = _load()
                t0 = time.monotonic()
                res = run_recover(config, layouts[mode], model, out, f"c{cycle}")
                rec = _cycle_record(res, mode, nproc, cycle)
                rec.update(load_avg=load, wall_s=round(time.monotonic() - t0, 1))
                records.append(rec)
                with open(os.path.join(work, "cycles.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
    return records


def summarize(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rank count, mode): recoveries, failures, hangs, time to recover."""
    rows = []
    keys = sorted({(int(r["nproc"]), str(r["mode"])) for r in records})
    for nproc, mode in keys:
        mine = [r for r in records if r["nproc"] == nproc and r["mode"] == mode]
        ok = [r for r in mine if r["outcome"] == "recovered"]
        times = [float(r["recover_s"]) for r in ok]
        nan = float("nan")
        rows.append(
            {
                "nproc": nproc,
                "mode": mode,
                "cycles": len(mine),
                "recovered": len(ok),
                "failed": sum(1 for r in mine if r["outcome"] == "failed"),
                "hung": sum(1 for r in mine if r["outcome"] == "hang"),
                "recover_median_s": statistics.median(times) if times else nan,
                "recover_min_s": min(times) if times else nan,
                "recover_max_s": max(times) if times else nan,
                "losses_equal": all(r["losses_equal"] for r in ok),
                "load_avg_1m": [r["load_avg"][0] for r in mine if r.get("load_avg")],
            }
        )
    return rows


def _f(x: float) -> str:
    return "–" if x != x else f"{x:.1f}"


def format_report(summary: Mapping[str, Any]) -> str:
    """``report.md``: the table, the conditions, the failures' first lines."""
    cfg = summary["config"]
    rows = summary["rows"]
    loads = [x for r in rows for x in r["load_avg_1m"]]
    lines = [
        "# Kill-and-restart cycles: does the restart come back?\n",
        f"{summary['date']}, {summary['machine']['cpus']} CPUs ({summary['machine']['platform']}), "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
        + ".\n",
        f"Each cycle: the `{cfg['model']}` reference trainer under `torchrun --max-restarts 1`, "
        "a checkpoint after step 2, the last rank SIGKILLed after step 4, every worker restarted "
        "and resumed (`benchmarks/ttfb/main.py` `run_recover`). A cycle that outlives "
        f"{cfg['timeout_s']:.0f} s is a hang. Dense arch "
        + ("compiled" if cfg["compile"] else "eager (`--no-compile`)")
        + f"; the machine as it was (1-minute load average {min(loads, default=0):.1f}-"
        f"{max(loads, default=0):.1f} across the cycles, shared with other work).\n",
        "| ranks | mode | came back | failed | hung | time to recover median s | min | max "
        "| losses after the resume |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nproc']} | {r['mode']} | **{r['recovered']}/{r['cycles']}** | {r['failed']} "
            f"| {r['hung']} | {_f(r['recover_median_s'])} | {_f(r['recover_min_s'])} "
            f"| {_f(r['recover_max_s'])} | "
            + ("bit-equal to before the kill" if r["losses_equal"] else "**differ**")
            + " |"
        )
    fails = [c for c in summary["cycles"] if c["outcome"] != "recovered"]
    if fails:
        lines.append("\nCycles that did not come back (first line of the launcher's verdict):\n")
        lines += [
            f"- {c['mode']}, {c['nproc']} ranks, cycle {c['cycle']}: {c['outcome']} "
            f"({str(c.get('detail', '')).splitlines()[0][:160]})"
            for c in fails
        ]
    lines.append(
        f"\nCommand: `{summary['command']}` (wall time {summary['wall_s'] / 3600:.1f} h). "
        "stock-best makes its process group as `init_process_group` does on `env://`; "
        "fastinit with `fastinit.init_process_group` (docs/restarts.md)."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--nproc", default="2,4", help="comma-separated rank counts")
    p.add_argument("--model", default="small")
    p.add_argument("--timeout", type=float, default=600.0, help="per cycle, seconds: a hang")
    p.add_argument("--no-compile", action="store_true", help="eager dense arch")
    p.add_argument("--out", default="benchmarks/results/restarts")
    p.add_argument("--work", default="bench-out/restarts")
    args = p.parse_args(argv)
    nprocs = [int(n) for n in args.nproc.split(",") if n]
    t0 = time.monotonic()
    start = _load()
    records = run_cycles(
        args.cycles, nprocs, args.model, args.work, args.timeout, not args.no_compile
    )
    versions = next((r["versions"] for r in records if r.get("versions")), {})
    summary: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.restarts "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "config": {
            "cycles": args.cycles,
            "nproc": nprocs,
            "model": args.model,
            "timeout_s": args.timeout,
            "compile": not args.no_compile,
            "max_restarts": 1,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_start": start,
            "load_avg_at_end": _load(),
        },
        "versions": versions,
        "wall_s": time.monotonic() - t0,
        "rows": summarize(records),
        "cycles": records,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    text = format_report(summary)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return summary
