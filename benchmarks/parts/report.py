"""What each part of fastinit gives: the numbers of :mod:`benchmarks.parts`, pure.

Runs in, medians, ratios, a projection at 1,024 and 4,096 ranks and Markdown out; nothing here
launches anything (unit-tested on recorded numbers, ``tests/test_bench.py``).

A *variant* is one way of setting a trainer up (:data:`VARIANTS`): stock TorchRec, stock-best,
and fastinit part by part — ``fastinit.setup`` alone (the one-line change: no plan cache, no
warm-up, no compile cache), plus its plan cache, plus the stage graph, warm-up and compile cache
(everything: the benchmark's ``fastinit`` mode). The first four run a trainer without
``torch.compile`` (the eager dense arch); the last two compile it, stock-best with its own caches.
Each is compared with the stock-best of the same trainer.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Variant", "VARIANTS", "variant", "parts_rows", "project_parts", "format_parts"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Variant:
    """One way of setting up the benchmark trainer."""

    name: str
    """Short name (directories, JSON keys)."""
    label: str
    """What the table says."""
    mode: str
    """``benchmarks.ttfb.trainer --mode``."""
    compile: bool
    """The dense arch compiled (False: ``--no-compile``)."""
    parts: str = "all"
    """``--fastinit-parts`` (fastinit only)."""
    baseline: str = ""
    """The variant it is compared with (the stock-best of the same trainer); "" for none."""
    plans_at_start: bool = False
    """It plans at every start (stock's ``collective_plan``, or ``fastinit.setup`` without a
    plan cache): the projection adds planning at N ranks."""

    @property
    def trainer_args(self) -> tuple[str, ...]:
        """Arguments of ``benchmarks.ttfb.trainer`` beyond the mode and ``--no-compile``."""
        return ("--fastinit-parts", self.parts) if self.mode == "fastinit" else ()

    @property
    def is_fastinit(self) -> bool:
        return self.mode == "fastinit"


VARIANTS: tuple[Variant, ...] = (
    Variant(
        name="stock-eager",
        label="stock TorchRec (plans at every start)",
        mode="stock",
        compile=False,
        baseline="stock-best-eager",
        plans_at_start=True,
    ),
    Variant(
        name="stock-best-eager",
        label="stock-best: the previous run's plan passed in",
        mode="stock-best",
        compile=False,
    ),
    Variant(
        name="setup",
        label="fastinit: the one-line change alone (`fastinit.setup`, no plan cache)",
        mode="fastinit",
        compile=False,
        parts="setup",
        baseline="stock-best-eager",
        plans_at_start=True,
    ),
    Variant(
        name="plan-cache",
        label="fastinit: + plan cache",
        mode="fastinit",
        compile=False,
        parts="plan-cache",
        baseline="stock-best-eager",
    ),
    Variant(
        name="stock-best",
        label="stock-best, compiled: + shared Inductor directory and compile artifacts",
        mode="stock-best",
        compile=True,
    ),
    Variant(
        name="all",
        label="fastinit, compiled: + stage graph, warm-up and compile cache (all of it)",
        mode="fastinit",
        compile=True,
        parts="all",
        baseline="stock-best",
    ),
)


def variant(name: str) -> Variant:
    """The variant called ``name``.

    Raises:
        ValueError: no such variant.
    """
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; one of {[v.name for v in VARIANTS]}")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _paired(runs: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]]) -> float:
    """The median over repeats of the ratio within each repeat (the two ran minutes apart, at
    about the same load), NaN without a common repeat."""
    ratios = [float(a["ttfb_s"]) / float(b["ttfb_s"]) for a, b in zip(runs, base)]
    return statistics.median(ratios) if ratios else float("nan")


def parts_rows(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant measured: the median time to first batch over its restarts, its
    single runs and their load averages, the median of its ``launch`` + ``device_init`` stages
    (interpreter start and the imports of torch and TorchRec, the same code in every variant;
    stock-best's also loads its compile artifacts there), the median start-up c10d ops, and two
    ratios to its baseline (NaN without one): of the medians, and the median of the ratios
    within each repeat (robust to the machine's load drifting between repeats).

    Args:
        runs: variant name -> its restart runs in repeat order, each with ``ttfb_s``, ``setup``
            (``c10d_ops``), ``load_avg`` and (optional) ``stages_s``; a variant without runs is
            left out.
    """
    medians = {
        name: statistics.median(float(r["ttfb_s"]) for r in rs) for name, rs in runs.items() if rs
    }
    rows = []
    for v in VARIANTS:
        rs = runs.get(v.name) or []
        if not rs:
            continue
        base = medians.get(v.baseline) if v.baseline else None
        imports = [
            float(r["stages_s"].get("launch", 0.0)) + float(r["stages_s"].get("device_init", 0.0))
            for r in rs
            if "stages_s" in r
        ]
        rows.append(
            {
                "variant": v.name,
                "label": v.label,
                "compile": v.compile,
                "ttfb_s": medians[v.name],
                "ttfb_all_s": [float(r["ttfb_s"]) for r in rs],
                "load_avg": [float(r["load_avg"]) for r in rs],
                "c10d_ops": statistics.median(int(r["setup"]["c10d_ops"]) for r in rs),
                "imports_s": statistics.median(imports) if imports else float("nan"),
                "baseline": v.baseline,
                "vs_baseline": _ratio(medians[v.name], base) if base is not None else float("nan"),
                "vs_baseline_paired": _paired(rs, runs[v.baseline])
                if base is not None
                else float("nan"),
            }
        )
    return rows


def project_parts(
    measured: Mapping[str, Mapping[str, Any]],
    *,
    measurements: Mapping[str, Any],
    local_fits: Mapping[str, tuple[float, float]],
    ranks: Sequence[int] = (1024, 4096),
    fabric: str = "ib",
) -> list[dict[str, Any]]:
    """Each variant's restart projected to ``ranks`` with :func:`benchmarks.ttfb.projection.ttfb_components`.

    What scales is the set-up: the rendezvous, planning (only a variant that plans at every
    start), the start-up collectives, and the per-rank local work of building the sharded model
    (stock's fit for stock and stock-best, fastinit's for fastinit). The rest of the measured
    time (launch and imports, the data pipeline, compilation and its caches) is per host and
    kept as measured.

    Args:
        measured: variant name -> :func:`benchmarks.ttfb.analysis.summarize` of its restarts.
        measurements: ``projection-measurements.json`` (``make projection``): ``store_op_s``,
            ``sizes`` (plan bytes per N, pickle and codec) and ``planning`` (seconds per N,
            stock's planner and FastPlanner).
        local_fits: ``{"stock": (c, k), "fastinit": (c, k)}``: per-rank local set-up seconds
            ``c × N^k`` (``make scale``'s fits).
        ranks: world sizes.
        fabric: a key of :data:`benchmarks.ttfb.projection.FABRICS`.
    """
    from benchmarks.ttfb.projection import FABRICS, fit_power, ttfb_components

    planning = {
        who: {int(n): float(t) for n, t in points.items()}
        for who, points in measurements["planning"].items()
    }
    fits = {who: fit_power(list(p), list(p.values())) for who, p in planning.items()}
    sizes = {int(n): v for n, v in measurements["sizes"].items()}
    rows = []
    for v in VARIANTS:
        if v.name not in measured:
            continue
        who = "fastinit" if v.is_fastinit else "stock"
        for n in ranks:
            c, k = local_fits[who]
            parts = ttfb_components(
                measured[v.name],
                mode="fastinit" if v.is_fastinit else v.mode,
                scenario="new-hosts",
                n=n,
                fabric=FABRICS[fabric],
                store_op_s=float(measurements["store_op_s"]),
                plan_fit=fits[who] if v.plans_at_start else None,
                plan_bytes=sizes[n]["codec" if v.is_fastinit else "pickle"]
                if v.plans_at_start
                else None,
                local_s=c * n**k,
            )
            rows.append({"variant": v.name, "ranks": n, **parts})
    return rows


def format_parts(
    rows: Sequence[Mapping[str, Any]],
    projected: Sequence[Mapping[str, Any]] = (),
    *,
    title: str = "",
) -> str:
    """The measured table (and the projected one, when given) as Markdown. A projected cell is
    its scale-dependent seconds (rendezvous, planning, collectives, local work: what differs
    between the set-ups at N ranks) and the total with the measured per-host part."""

    def num(x: float, fmt: str = ".2f") -> str:
        return "–" if x != x else format(x, fmt)

    by_name = {r["variant"]: r for r in rows}
    lines = [f"### {title}", ""] if title else []
    lines += [
        "| set-up | restart s (median) | runs s | load avg | launch + device_init s "
        "| c10d ops | vs stock-best: medians | per repeat |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['ttfb_s']:.1f} "
            f"| {' / '.join(f'{t:.1f}' for t in r['ttfb_all_s'])} "
            f"| {' / '.join(f'{x:.1f}' for x in r['load_avg'])} "
            f"| {num(r.get('imports_s', float('nan')), '.1f')} | {r['c10d_ops']:g} "
            f"| {num(r['vs_baseline'])} | {num(r.get('vs_baseline_paired', float('nan')))} |"
        )
    if projected:
        ns = sorted({int(p["ranks"]) for p in projected})
        at = {(p["variant"], int(p["ranks"])): p for p in projected}
        head = " | ".join(f"at {n:,} ranks: scale-dependent s | projected s" for n in ns)
        lines += ["", f"| set-up | {head} |", "|---|" + "---:|---:|" * len(ns)]
        for name, r in by_name.items():
            cells = [at[(name, n)] for n in ns if (name, n) in at]
            if len(cells) != len(ns):
                continue
            text = []
            for c in cells:
                scaled = c["ttfb_s"] - c["single_host_fixed_s"]
                planning = f" (planning {c['planning_s']:.1f})" if c["planning_s"] else ""
                text.append(f"{scaled:.1f}{planning} | {c['ttfb_s']:.1f}")
            lines.append(f"| {r['label']} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"
