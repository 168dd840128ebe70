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
Every cycle's record is appended to ``--work``/``cycles.jsonl`` as it ends; ``summary.json`` and
``report.md`` are built from that file and written to ``--out`` (default
``benchmarks/results/restarts``); the runs' traces stay in ``--work``.

    python -m benchmarks.restarts --resume   # run only the cycles missing from cycles.jsonl
    python -m benchmarks.restarts --render   # only build summary.json + report.md from it

A resumed run reuses the primed caches of ``--work`` (it primes only a layout that has none) and
must be given the settings the interrupted run had (``--timeout``, ``--model``, ``--no-compile``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "run_cycles",
    "read_cycles",
    "missing_cycles",
    "failure_cause",
    "summarize",
    "format_report",
    "main",
]

MODES: tuple[str, ...] = ("stock-best", "fastinit")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


#: What a worker's failure in the restart looks like in the launcher's log, most telling first.
_CAUSES: tuple[str, ...] = ("connectFullMesh failed", "Connection refused", "Error:", "error:")


def failure_cause(log: str, outcome: str) -> str:
    """The first line of ``log`` (a cycle's ``launch.log``) that says why its restart did not
    come back, without the logger's prefix; a hang's log says nothing after the restart."""
    for pattern in _CAUSES:
        for line in log.splitlines():
            if pattern in line:
                line = re.sub(r"^\[?[EWI]\d{4} [\d:.]+ +\d*\s*[^\]]*\] ?", "", line)
                return re.sub(r"\[/[^\]]*\] ", "", line).strip()  # gloo's source paths
    return "no worker error in the log: it outlived the timeout" if outcome == "hang" else ""


def _cycle_record(
    res: Mapping[str, Any], mode: str, nproc: int, cycle: int, settings: Mapping[str, Any]
) -> dict[str, Any]:
    keep = ("recover_s", "restart_s", "startup_s", "resume_s", "losses_equal", "losses_compared")
    rec: dict[str, Any] = {
        "mode": mode,
        "nproc": nproc,
        "cycle": cycle,
        "outcome": res.get("outcome", "recovered"),
        **settings,
    }
    if res.get("recovered", True):
        rec.update({k: res[k] for k in keep})
        rec["versions"] = res["ranks"][0].get("versions", {})
    else:
        rec["detail"] = res.get("detail", "")
    return rec


def _add_cause(rec: dict[str, Any], work: str) -> None:
    """A cycle that did not come back: its ``cause`` from the run's ``launch.log`` (kept in
    ``work``), unless the record has one."""
    log = os.path.join(
        work, "cycles", f"{rec['mode']}-{rec['nproc']}", f"c{rec['cycle']}", "launch.log"
    )
    if rec["outcome"] != "recovered" and not rec.get("cause") and os.path.exists(log):
        with open(log, errors="replace") as f:
            rec["cause"] = failure_cause(f.read(), rec["outcome"])


def read_cycles(path: str) -> list[dict[str, Any]]:
    """The records of ``cycles.jsonl`` (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def missing_cycles(
    done: Sequence[Mapping[str, Any]], cycles: int, nproc: int, modes: Sequence[str] = MODES
) -> list[tuple[int, str]]:
    """The (cycle, mode) pairs of one rank count that ``done`` lacks, in the order a full run
    takes them (the modes' order flips every cycle)."""
    have = {(int(r["nproc"]), str(r["mode"]), int(r["cycle"])) for r in done}
    return [
        (cycle, mode)
        for cycle in range(cycles)
        for mode in (modes if cycle % 2 == 0 else tuple(reversed(modes)))
        if (nproc, mode, cycle) not in have
    ]


def run_cycles(
    cycles: int,
    nprocs: Sequence[int],
    model: str,
    work: str,
    timeout_s: float,
    compile: bool,
    modes: Sequence[str] = MODES,
    done: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Run the cycles that ``done`` lacks, appending each record (mode, rank count, outcome,
    times, load) to ``work``/``cycles.jsonl``; returns the new records. A rank count with records
    in ``done`` keeps its primed caches (it primes only a layout that has none)."""
    from benchmarks.ttfb.main import BenchConfig, prime, run_recover
    from benchmarks.ttfb.scenarios import Layout, is_primed

    records: list[dict[str, Any]] = []
    for nproc in nprocs:
        todo = missing_cycles(done, cycles, nproc, modes)
        if not todo:
            continue
        config = BenchConfig(
            models=(model,),
            modes=tuple(modes),
            nproc=nproc,
            out=work,
            launcher="torchrun",
            compile=compile,
            timeout_s=timeout_s,
            steps=3,
            stock_restart="shared-store",  # what this benchmark measures: stock as written
        )
        resumed = any(int(r["nproc"]) == nproc for r in done)
        layouts = {}
        for mode in modes:
            layouts[mode] = Layout(
                root=os.path.join(work, "one", f"{mode}-{model}-{nproc}"), mode=mode
            )
            if not (resumed and is_primed(layouts[mode])):
                prime(mode, model, "recover", config)
        for cycle, mode in todo:
            out = os.path.join(work, "cycles", f"{mode}-{nproc}", f"c{cycle}")
            shutil.rmtree(out, ignore_errors=True)
            load = _load()
            t0 = time.monotonic()
            res = run_recover(config, layouts[mode], model, out, f"c{cycle}")
            settings = {"model": model, "timeout_s": timeout_s, "compile": compile}
            rec = _cycle_record(res, mode, nproc, cycle, settings)
            rec.update(load_avg=load, wall_s=round(time.monotonic() - t0, 1))
            _add_cause(rec, work)
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
                "losses_equal": sum(1 for r in ok if r["losses_equal"]),
                "load_avg_1m": [r["load_avg"][0] for r in mine if r.get("load_avg")],
            }
        )
    return rows


def _f(x: float) -> str:
    return "–" if x != x else f"{x:.1f}"


def _losses(row: Mapping[str, Any]) -> str:
    equal, of = int(row["losses_equal"]), int(row["recovered"])
    if not of:
        return "–"
    if equal == of:
        return "bit-equal to before the kill"
    return f"bit-equal in {equal} of {of}; **differ** in {of - equal}"


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
            f"| {_f(r['recover_max_s'])} | " + _losses(r) + " |"
        )
    fails = [c for c in summary["cycles"] if c["outcome"] != "recovered"]
    if fails:
        lines.append(
            "\nCycles that did not come back (the workers' first error in the launcher's log, "
            "else the launcher's verdict):\n"
        )
        lines += [
            f"- {c['mode']}, {c['nproc']} ranks, cycle {c['cycle']}: {c['outcome']} ("
            + (c.get("cause") or str(c.get("detail", "")).splitlines()[0])[:200]
            + ")"
            for c in fails
        ]
    differ = [c for c in summary["cycles"] if c["outcome"] == "recovered" and not c["losses_equal"]]
    if differ:
        lines.append(
            "\nCycles that came back with losses after the resume not equal to before the kill:\n"
        )
        lines += [f"- {c['mode']}, {c['nproc']} ranks, cycle {c['cycle']}" for c in differ]
    if summary.get("note"):
        lines.append(f"\nNote: {summary['note']}")
    lines.append(
        f"\nCommand: `{summary['command']}` (the cycles' wall time {summary['wall_s'] / 3600:.1f} h; "
        "a run interrupted is completed with `--resume`, which runs only the missing cycles). "
        "stock-best makes its process group as `init_process_group` does on `env://`; "
        "fastinit with `fastinit.init_process_group` (docs/restarts.md)."
    )
    return "\n".join(lines) + "\n"


def _command(argv: list[str] | None) -> str:
    """The command that runs these cycles straight through: the one given, less ``--resume``,
    ``--render`` and ``--note`` (the report's, not the run's)."""
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:
        at = given.index("--note")
        del given[at : at + 2]
    plain = [a for a in given if a not in ("--resume", "--render") and not a.startswith("--note=")]
    return " ".join(["python -m benchmarks.restarts", *plain])


_SETTINGS = ("model", "timeout_s", "compile")


def check_settings(records: Sequence[Mapping[str, Any]], config: Mapping[str, Any]) -> None:
    """Refuse records that ran with other settings than ``config`` (those that carry them)."""
    for rec in records:
        for key in _SETTINGS:
            if key in rec and rec[key] != config[key]:
                raise SystemExit(
                    f"cycle {rec['mode']}/{rec['nproc']}/{rec['cycle']} ran with {key}="
                    f"{rec[key]!r}, not {config[key]!r}: give the settings of the run"
                )


def build_summary(
    records: Sequence[Mapping[str, Any]], config: Mapping[str, Any], command: str
) -> dict[str, Any]:
    """``summary.json`` from the cycles' records (read back from ``cycles.jsonl``, so a resumed
    or re-rendered run gives the same summary as one that ran straight through)."""
    check_settings(records, config)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "config": {**config, "nproc": sorted({int(r["nproc"]) for r in records})},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": next((r["versions"] for r in records if r.get("versions")), {}),
        "wall_s": sum(float(r.get("wall_s", 0.0)) for r in records),
        "rows": summarize(records),
        "cycles": list(records),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=20, help="per mode and rank count")
    p.add_argument("--nproc", default="2,4", help="comma-separated rank counts")
    p.add_argument("--model", default="small")
    p.add_argument("--timeout", type=float, default=600.0, help="per cycle, seconds: a hang")
    p.add_argument("--no-compile", action="store_true", help="eager dense arch")
    p.add_argument("--out", default="benchmarks/results/restarts")
    p.add_argument("--work", default="bench-out/restarts")
    p.add_argument(
        "--note", default="", help="a paragraph for the report (what the records do not say)"
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--resume",
        action="store_true",
        help="run only the cycles missing from WORK/cycles.jsonl, appending (same settings)",
    )
    how.add_argument(
        "--render", action="store_true", help="run nothing: summarise WORK/cycles.jsonl"
    )
    args = p.parse_args(argv)
    nprocs = [int(n) for n in args.nproc.split(",") if n]
    config = {
        "cycles": args.cycles,
        "model": args.model,
        "timeout_s": args.timeout,
        "compile": not args.no_compile,
        "max_restarts": 1,
    }
    path = os.path.join(args.work, "cycles.jsonl")
    done = read_cycles(path)
    if not (args.resume or args.render) and done:
        os.replace(path, path + ".prev")  # a fresh run starts a fresh file
        print(f"a fresh run: the previous {len(done)} records moved to {path}.prev")
        done = []
    if args.render and not done:
        raise SystemExit(f"nothing to render: {path} has no records")
    check_settings(done, config)  # before a resumed run adds cycles of other settings
    if not args.render:
        os.makedirs(args.work, exist_ok=True)
        run_cycles(
            args.cycles,
            nprocs,
            args.model,
            args.work,
            args.timeout,
            not args.no_compile,
            done=done,
        )
    records = read_cycles(path)
    for rec in records:  # records written before the driver kept the cause
        _add_cause(rec, args.work)
    summary = build_summary(records, config, _command(argv))
    summary["note"] = args.note
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    text = format_report(summary)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return summary
