"""Trace analysis of the time-to-first-batch benchmark: pure functions, traces in, numbers out.

The per-rank traces come from :mod:`benchmarks.ttfb.trainer` (``bench`` record, stage spans, c10d /
store / group events) and :mod:`benchmarks.ttfb.floor` (``floor`` record, one span per piece); the
generic parts (loading, spans, which span an event fell in, counts, longest chain) are
:mod:`fastinit.report`'s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.ttfb.floor import FLOOR_DEPS, FLOOR_PIECES
from benchmarks.ttfb.trainer import STAGES
from fastinit.report import comm_counts, critical_path, load, stage_of

__all__ = [
    "TIMELINE",
    "NTH_BATCH",
    "step_of",
    "analyse_run",
    "analyse_floor",
    "floor_of",
    "summarize",
    "summarize_floor",
    "table_rows",
    "ratio",
    "analyse_recover",
    "summarize_recover",
    "recover_rows",
]

#: Spans drawn and tabulated: interpreter start + imports, the seven stages, the first step.
TIMELINE: tuple[str, ...] = ("launch", *STAGES, "first_step")

#: The batch whose time from process start the restart target is set on (issue 32 item 5: the
#: pipeline fill and the first compiled steps are first-batch work; the 20th batch counts them).
NTH_BATCH = 20

_INFO_KEYS = (
    "compile_cache",
    "compile_artifacts",
    "saved_plan",
    "warmup",
    "warmup_graphs",
    "first_step_graphs",
    "graphs_total",
    "precompiled_found",
    "precompiled_served",
    "compile_prefetch",
    "compile_prefetch_s",
    "loss",
    "master_addr",
    "device",
    "backend",
)


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0."""
    return a / b if b else float("nan")


def analyse_run(paths: Sequence[str]) -> dict[str, Any]:
    """Numbers of one trainer run from its per-rank trace files: time to first batch (max over
    ranks), stage durations (max over ranks), start-up communication (max over ranks, before the
    first step, fastinit's warm-up step on the fast batch counted apart), peak RSS."""
    ranks: list[dict[str, Any]] = []
    for trace in load(paths):
        bench = trace.bench
        if bench is None:
            raise ValueError(f"{trace.path}: no 'bench' record (not a trainer trace)")
        spans = [e for e in trace.events if e.get("kind") == "span" and e["name"] in TIMELINE]
        by_name = {e["name"]: e for e in spans}
        t0 = float(bench["process_start"]) * 1e6
        first = float(by_name["first_step"]["ts"]) if "first_step" in by_name else float("inf")
        startup = [
            e
            for e in trace.events
            if e.get("kind") in ("c10d", "store", "group") and float(e["ts"]) < first
        ]
        by_stage: dict[str, list[dict[str, Any]]] = {}
        for e in startup:
            by_stage.setdefault(stage_of(e, spans), []).append(e)
        warm = by_stage.get("pre_train", [])
        setup = [e for stage, evs in by_stage.items() if stage != "pre_train" for e in evs]
        durations = {name: float(s["dur"]) / 1e6 for name, s in by_name.items()}
        step_spans = sorted(
            (e for e in trace.events if e.get("kind") == "span" and e["name"] == "step"),
            key=lambda e: float(e["ts"]),
        )
        steps = {step_of(e): float(e["dur"]) / 1e6 for e in step_spans}
        # The n-th batch this process trained ends with its (n - 1)-th step after the first.
        nth = step_spans[NTH_BATCH - 2] if len(step_spans) >= NTH_BATCH - 1 else None
        ranks.append(
            {
                "rank": trace.rank,
                "ttfb_s": float(bench["ttfb_s"]),
                "stages_s": durations,
                "stage_start_s": {n: (float(s["ts"]) - t0) / 1e6 for n, s in by_name.items()},
                "threads": {n: str(s.get("thread", "")) for n, s in by_name.items()},
                "setup": comm_counts(setup),
                "setup_by_op": _by_op(setup),
                "warmup": comm_counts(warm),
                "per_stage_c10d": {k: comm_counts(v)["c10d_ops"] for k, v in by_stage.items() if v},
                "peak_rss_mb": float(bench["peak_rss_mb"]),
                "steps_s": steps,
                "nth_batch_s": (float(nth["ts"]) + float(nth["dur"]) - t0) / 1e6
                if nth is not None
                else float("nan"),
                "info": {k: bench[k] for k in _INFO_KEYS if k in bench},
                "versions": dict(bench.get("versions", {})),
            }
        )
    worst = max(ranks, key=lambda r: r["ttfb_s"])
    keys = ranks[0]["setup"].keys()
    # A step ends when its slowest rank ends: per step the max over ranks, then the median.
    later = sorted(set.intersection(*(set(r["steps_s"]) for r in ranks)))
    steady = [max(r["steps_s"][k] for r in ranks) for k in later]
    # The first step once every rank is in it: a rank that enters it early (a shorter pre_train)
    # waits in its first collective for the others; that wait is start-up skew (it is in the
    # time to first batch already), not the step.
    entered = [r for r in ranks if "first_step" in r["stage_start_s"]]
    first_synced = (
        max(r["stage_start_s"]["first_step"] + r["stages_s"]["first_step"] for r in entered)
        - max(r["stage_start_s"]["first_step"] for r in entered)
        if entered
        else float("nan")
    )
    return {
        "steady_step_s": statistics.median(steady) if steady else float("nan"),
        "first_step_synced_s": first_synced,
        "ttfb_s": worst["ttfb_s"],
        "nth_batch_s": _slowest(r["nth_batch_s"] for r in ranks),
        "stages_s": {s: max(r["stages_s"].get(s, 0.0) for r in ranks) for s in TIMELINE},
        "setup": {k: max(r["setup"][k] for r in ranks) for k in keys},
        "warmup": {k: max(r["warmup"][k] for r in ranks) for k in keys},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "setup_by_op": max(ranks, key=lambda r: r["setup"]["c10d_ops"])["setup_by_op"],
        "ranks": ranks,
        "paths": list(paths),
    }


def _slowest(values: Any) -> float:
    """The max, NaN if any is NaN (a rank that did not get there)."""
    vals = [float(v) for v in values]
    return float("nan") if not vals or any(math.isnan(v) for v in vals) else max(vals)


def step_of(event: Mapping[str, Any]) -> int:
    """The training step a ``step`` span covers (the tracer keeps span keywords under
    ``attrs``)."""
    attrs = event.get("attrs") or {}
    return int(attrs.get("step", event.get("step", 0)))


def _by_op(events: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("kind") == "c10d":
            slot = out.setdefault(str(e["name"]), {"count": 0, "bytes": 0})
            slot["count"] += 1
            slot["bytes"] += int(e.get("bytes", 0))
    return out


def floor_of(seconds: Mapping[str, float]) -> tuple[float, list[str]]:
    """The floor of one rank: launch + the longest chain through the other pieces."""
    crit, chain = critical_path(seconds, FLOOR_DEPS)
    return float(seconds.get("launch", 0.0)) + crit, ["launch", *chain]


def analyse_floor(paths: Sequence[str]) -> dict[str, Any]:
    """One floor run: per piece the max over ranks, and the floor (max over ranks of each rank's
    floor)."""
    ranks = []
    for trace in load(paths):
        rec = next((e for e in trace.events if e.get("kind") == "floor"), None)
        if rec is None:
            raise ValueError(f"{trace.path}: no 'floor' record (not a floor trace)")
        seconds = {k: float(v) for k, v in rec["seconds"].items()}
        floor_s, chain = floor_of(seconds)
        ranks.append({"rank": trace.rank, "seconds": seconds, "floor_s": floor_s, "chain": chain})
    worst = max(ranks, key=lambda r: r["floor_s"])
    pieces = ("launch", *FLOOR_PIECES)
    return {
        "floor_s": worst["floor_s"],
        "chain": worst["chain"],
        "pieces_s": {p: max(r["seconds"].get(p, 0.0) for r in ranks) for p in pieces},
        "ranks": ranks,
        "paths": list(paths),
    }


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one (model, scenario, mode)."""
    med = statistics.median
    first = runs[0]
    return {
        "repeats": len(runs),
        "ttfb_s": med(r["ttfb_s"] for r in runs),
        "ttfb_all_s": [r["ttfb_s"] for r in runs],
        "stages_s": {s: med(r["stages_s"][s] for r in runs) for s in TIMELINE},
        "setup": {k: med(r["setup"][k] for r in runs) for k in first["setup"]},
        "warmup": {k: med(r["warmup"][k] for r in runs) for k in first["warmup"]},
        "peak_rss_mb": med(r["peak_rss_mb"] for r in runs),
        "steady_step_s": med(r.get("steady_step_s", float("nan")) for r in runs),
        "first_step_synced_s": med(r.get("first_step_synced_s", float("nan")) for r in runs),
        "nth_batch_s": med(r.get("nth_batch_s", float("nan")) for r in runs),
        "setup_by_op": first["setup_by_op"],
        "info": first["ranks"][0]["info"],
    }


def summarize_floor(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one (model, scenario) floor."""
    med = statistics.median
    chains = [tuple(r["chain"]) for r in runs]
    return {
        "repeats": len(runs),
        "floor_s": med(r["floor_s"] for r in runs),
        "floor_all_s": [r["floor_s"] for r in runs],
        "pieces_s": {p: med(r["pieces_s"][p] for r in runs) for p in runs[0]["pieces_s"]},
        "chain": list(max(set(chains), key=chains.count)),
    }


def table_rows(results: Mapping[str, Any], floors: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, scenario): stock, stock-best, fastinit and the floor side by side.

    ``results``: ``{model: {scenario: {mode: summarize(...)}}}``; ``floors``:
    ``{model: {scenario: summarize_floor(...)}}`` (a missing floor is NaN).
    """
    rows = []
    nan = float("nan")
    for model, per_scenario in results.items():
        for scenario, modes in per_scenario.items():
            s, b, f = modes["stock"], modes["stock-best"], modes["fastinit"]
            floor = floors.get(model, {}).get(scenario)
            floor_s = floor["floor_s"] if floor else nan
            rows.append(
                {
                    "model": model,
                    "scenario": scenario,
                    "stock_s": s["ttfb_s"],
                    "best_s": b["ttfb_s"],
                    "fastinit_s": f["ttfb_s"],
                    "floor_s": floor_s,
                    "vs_stock": ratio(f["ttfb_s"], s["ttfb_s"]),
                    "vs_best": ratio(f["ttfb_s"], b["ttfb_s"]),
                    "vs_floor": ratio(f["ttfb_s"], floor_s),
                    "best_vs_floor": ratio(b["ttfb_s"], floor_s),
                    "floor_chain": floor["chain"] if floor else [],
                    "stock_ops": s["setup"]["c10d_ops"],
                    "best_ops": b["setup"]["c10d_ops"],
                    "fastinit_ops": f["setup"]["c10d_ops"],
                    "stock_bytes": s["setup"]["c10d_bytes"],
                    "best_bytes": b["setup"]["c10d_bytes"],
                    "fastinit_bytes": f["setup"]["c10d_bytes"],
                    "stock_groups": s["setup"]["new_groups"],
                    "fastinit_groups": f["setup"]["new_groups"],
                    "stock_store": s["setup"]["store_ops"],
                    "fastinit_store": f["setup"]["store_ops"],
                    "warmup_ops": f["warmup"]["c10d_ops"],
                    "stock_rss": s["peak_rss_mb"],
                    "best_rss": b["peak_rss_mb"],
                    "fastinit_rss": f["peak_rss_mb"],
                    "fastinit_first_step_s": f["stages_s"].get("first_step", nan),
                    "fastinit_steady_step_s": f.get("steady_step_s", nan),
                    "best_first_step_s": b["stages_s"].get("first_step", nan),
                    "best_steady_step_s": b.get("steady_step_s", nan),
                    "first_vs_steady": ratio(
                        f["stages_s"].get("first_step", nan), f.get("steady_step_s", nan)
                    ),
                    "fastinit_first_synced_s": f.get("first_step_synced_s", nan),
                    "synced_vs_steady": ratio(
                        f.get("first_step_synced_s", nan), f.get("steady_step_s", nan)
                    ),
                    "precompiled_served": f.get("info", {}).get("precompiled_served", 0),
                    "fastinit_nth_batch_s": f.get("nth_batch_s", nan),
                    "best_nth_batch_s": b.get("nth_batch_s", nan),
                    "stock_nth_batch_s": s.get("nth_batch_s", nan),
                    "nth_vs_best": ratio(f.get("nth_batch_s", nan), b.get("nth_batch_s", nan)),
                }
            )
    return rows


# -- the recover scenario ----------------------------------------------------------------------


def analyse_recover(
    paths: Sequence[str],
    kill: Mapping[str, Any],
    saves: Sequence[Mapping[str, Any]],
    before: Mapping[int, Mapping[int, float]] | None = None,
) -> dict[str, Any]:
    """One recover run: the restarted workers' traces (``paths``), the kill's record
    (:func:`benchmarks.ttfb.faults.read_kill`), the first attempt's ``save-rank<N>.json`` records and
    its losses per rank and step (``before``, from ``losses-a0-rank<N>.json``).

    ``recover_s``: from the kill to the first batch after the resume (the last rank's);
    ``restart_s``: from the kill to the first restarted process's start (the agent noticing,
    stopping the survivors, the rendezvous, the spawn); ``startup_s``: the rest, the restarted
    job's own start-up with the checkpoint load in it; ``resume_s``: the load (max over ranks);
    ``losses_equal``: every step trained both before the kill and after the resume (those after
    the checkpoint) has the same loss, bit for bit, on every rank (``losses_compared`` of them).
    """
    run = analyse_run(paths)
    t_kill = float(kill["time"])
    starts, firsts, resumes, losses, resumed = [], [], [], {}, set()
    for trace in load(paths):
        bench = trace.bench or {}
        starts.append(float(bench["process_start"]))
        firsts.append(float(bench["first_batch"]))
        spans = [e for e in trace.events if e.get("kind") == "span" and e["name"] == "resume"]
        resumes.append(max((float(e["dur"]) / 1e6 for e in spans), default=0.0))
        losses[trace.rank] = {int(k): float(v) for k, v in bench.get("losses", {}).items()}
        resumed.add(bench.get("resumed_from_step"))
    if len(resumed) != 1 or None in resumed:
        raise ValueError(f"the restarted ranks resumed from steps {sorted(map(str, resumed))}")
    step0 = resumed.pop()
    compared, equal = 0, True
    for rank, after in losses.items():
        for step, value in (before or {}).get(rank, {}).items():
            if step > step0 and step in after:
                compared += 1
                equal = equal and after[step] == value
    blocking = [float(s["blocking_s"]) for s in saves]
    commit = [float(s["commit_s"]) for s in saves]
    nbytes = [int(s["bytes"]) for s in saves if "bytes" in s]
    return {
        **run,
        "recover_s": max(firsts) - t_kill,
        "restart_s": min(starts) - t_kill,
        "startup_s": max(firsts) - min(starts),
        "resume_s": max(resumes),
        "resumed_from_step": step0,
        "killed": dict(kill),
        "save_blocking_s": max(blocking, default=float("nan")),
        "save_commit_s": max(commit, default=float("nan")),
        "save_how": saves[0].get("how", "") if saves else "",
        "checkpoint_bytes": max(nbytes, default=0),
        "losses": losses,
        "losses_before": {r: dict(v) for r, v in (before or {}).items()},
        "losses_compared": compared,
        "losses_equal": equal and compared > 0,
    }


_RECOVER_KEYS = (
    "recover_s",
    "restart_s",
    "startup_s",
    "resume_s",
    "save_blocking_s",
    "save_commit_s",
    "checkpoint_bytes",
)


def summarize_recover(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one (model, mode) in the recover scenario that came back
    (NaN where none did); ``recovered`` of ``repeats`` came back, ``hangs`` ran out of time.

    A repeat that did not come back is ``{"recovered": False, "outcome": "failed" | "hang",
    "detail": ...}`` (:func:`benchmarks.ttfb.main.run_recover`)."""
    med = statistics.median
    ok = [r for r in runs if r.get("recovered", True)]
    nan = float("nan")
    out: dict[str, Any] = {k: med(float(r[k]) for r in ok) if ok else nan for k in _RECOVER_KEYS}
    out.update(
        repeats=len(runs),
        recovered=len(ok),
        hangs=sum(1 for r in runs if r.get("outcome") == "hang"),
        not_recovered=[str(r.get("detail", "")) for r in runs if not r.get("recovered", True)],
        recover_all_s=[r["recover_s"] for r in ok],
        stages_s={s: med(r["stages_s"][s] for r in ok) if ok else nan for s in TIMELINE},
        save_how=ok[0]["save_how"] if ok else "",
        resumed_from_step=ok[0]["resumed_from_step"] if ok else None,
        losses_equal=all(r["losses_equal"] for r in ok),
        losses_compared=sum(r["losses_compared"] for r in ok),
        info=ok[0]["ranks"][0]["info"] if ok else {},
    )
    return out


def recover_rows(
    recover: Mapping[str, Mapping[str, Any]], results: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """One row per model: time to recover of stock-best and fastinit beside their time to start
    on the same hosts (``results``' same-hosts medians, NaN where that scenario did not run)."""
    nan = float("nan")
    rows = []
    for model, modes in recover.items():
        b, f = modes["stock-best"], modes["fastinit"]
        start = results.get(model, {}).get("same-hosts", {})
        rows.append(
            {
                "model": model,
                "best_recover_s": b["recover_s"],
                "fastinit_recover_s": f["recover_s"],
                "vs_best": ratio(f["recover_s"], b["recover_s"]),
                "best_start_s": start.get("stock-best", {}).get("ttfb_s", nan),
                "fastinit_start_s": start.get("fastinit", {}).get("ttfb_s", nan),
                "losses_equal": b["losses_equal"] and f["losses_equal"],
                "losses_compared": b["losses_compared"] + f["losses_compared"],
                **{
                    f"{key}_{k}": m.get(k, m.get("repeats", 1) if k == "recovered" else 0)
                    for key, m in (("best", b), ("fastinit", f))
                    for k in ("recovered", "repeats", "hangs")
                },
                **{f"best_{k}": b[k] for k in _RECOVER_KEYS if k != "recover_s"},
                **{f"fastinit_{k}": f[k] for k in _RECOVER_KEYS if k != "recover_s"},
            }
        )
    return rows
