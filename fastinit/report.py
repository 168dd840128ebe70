"""Pictures and tables from the per-rank traces :mod:`fastinit.trace` writes.

A trace directory holds one ``trace-rank<N>.jsonl`` per rank (written by a :class:`~fastinit.trace.Tracer`,
for example the one ``fastinit.setup`` starts when ``FASTINIT_TRACE_DIR`` is set, or the benchmark
trainer's). :func:`render` turns it into three files:

* ``timeline.png``: one row per rank, one lane per thread, every span a bar (nested spans drawn
  thinner inside their parent), every c10d op a tick, the first batch a black line; one colour
  per span name, however many, all in the legend (needs matplotlib, the ``report`` extra:
  without it the other two files are written and one warning says so);
* ``stages.md``: per span name, its start and duration over ranks and the c10d ops, bytes, store
  operations and process groups issued inside it, then the per-rank totals;
* ``trace.json``: the Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev).

Everything but the drawing is pure (events in, numbers out) so it is tested on recorded traces;
matplotlib is imported only when a picture is drawn, torch never.

The first batch of a rank is, in this order: the benchmark trainer's ``bench`` record, a
``first_batch`` mark (:meth:`fastinit.trace.Tracer.mark`), or the end of the first span named
``first_batch`` (``with trace.span("first_batch"): batch = next(data)``, docs/usage.md).

Example::

    from fastinit.report import render

    paths = render("bench-out/trace", "bench-out/report", title="small model, 2 ranks")
    print(paths["stages"].read_text())
"""

from __future__ import annotations

import colorsys
import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastinit.trace import read_jsonl, summarize, to_chrome_trace

logger = logging.getLogger(__name__)

__all__ = [
    "RankTrace",
    "Span",
    "SpanStats",
    "TimelineRow",
    "load",
    "trace_paths",
    "spans_of",
    "stage_of",
    "comm_counts",
    "span_stats",
    "critical_path",
    "format_span_table",
    "first_batch_us",
    "timeline_rows",
    "span_colors",
    "draw_timelines",
    "plot_timelines",
    "write_chrome_trace",
    "render",
    "STAGE_COLORS",
]

_TRACE_FILE = re.compile(r"^trace-rank(\d+)\.jsonl$")

#: The span a user's trace marks its first batch with (docs/usage.md).
FIRST_BATCH = "first_batch"

#: Colours of the names the benchmark trainer uses; any other span gets one from a palette, then
#: generated ones (:func:`span_colors`: distinct for any number of names).
STAGE_COLORS: dict[str, str] = {
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
_PALETTE: tuple[str, ...] = (
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#7f7f7f",
    "#bcbd22",
    "#393b79",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One timed interval of one rank, in seconds from the trace's origin."""

    name: str
    start_s: float
    dur_s: float
    thread: str
    tid: int
    depth: int = 0
    """How many spans of the same thread contain it (0: outermost)."""
    error: str | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclasses.dataclass(frozen=True, slots=True)
class RankTrace:
    """The events of one rank's ``trace-rank<N>.jsonl``."""

    rank: int
    events: tuple[dict[str, Any], ...]
    path: str

    @property
    def process_start_us(self) -> float | None:
        """When the process started (µs, wall clock), where the trace says: the benchmark's
        ``bench`` record or a ``process_start`` mark with an ``at`` attribute."""
        for e in self.events:
            if e.get("kind") == "bench" and "process_start" in e:
                return float(e["process_start"]) * 1e6
        for e in self.events:
            if e.get("kind") == "mark" and e.get("name") == "process_start":
                at = (e.get("attrs") or {}).get("at")
                if at is not None:
                    return float(at) * 1e6
        return None

    @property
    def first_us(self) -> float | None:
        """The earliest timestamp of any timed event (µs), or None for an empty trace."""
        stamps = [float(e["ts"]) for e in self.events if "ts" in e]
        return min(stamps) if stamps else None

    @property
    def bench(self) -> dict[str, Any] | None:
        """The benchmark trainer's per-rank summary record, if this trace has one."""
        return next((e for e in self.events if e.get("kind") == "bench"), None)


def first_batch_us(trace: RankTrace) -> float | None:
    """When the rank had its first batch (µs, wall clock): the benchmark's ``bench`` record, else
    a ``first_batch`` mark, else the end of the earliest ``first_batch`` span; None without any."""
    bench = trace.bench
    if bench and "first_batch" in bench:
        return float(bench["first_batch"]) * 1e6
    for e in trace.events:
        if e.get("kind") == "mark" and e.get("name") == FIRST_BATCH:
            return float(e["ts"])
    spans = [e for e in trace.events if e.get("kind") == "span" and e.get("name") == FIRST_BATCH]
    if spans:
        first = min(spans, key=lambda e: float(e["ts"]))
        return float(first["ts"]) + float(first["dur"])
    return None


def _ttfb_s(trace: RankTrace) -> float | None:
    """Seconds from the rank's process start (else its first event) to its first batch."""
    bench = trace.bench
    if bench and "ttfb_s" in bench:
        return float(bench["ttfb_s"])
    at = first_batch_us(trace)
    origin = trace.process_start_us or trace.first_us
    return None if at is None or origin is None else (at - origin) / 1e6


def trace_paths(trace_dir: str | os.PathLike[str]) -> list[str]:
    """The ``trace-rank<N>.jsonl`` files of a directory, ordered by rank."""
    found = []
    for name in os.listdir(trace_dir):
        m = _TRACE_FILE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(os.fspath(trace_dir), name)))
    return [p for _, p in sorted(found)]


def load(paths: str | os.PathLike[str] | Iterable[str]) -> list[RankTrace]:
    """Read a trace directory (or a list of trace files) into one :class:`RankTrace` per rank.

    Raises:
        FileNotFoundError: a directory without any ``trace-rank<N>.jsonl``.
    """
    if isinstance(paths, (str, os.PathLike)):
        directory = os.fspath(paths)
        files = trace_paths(directory)
        if not files:
            raise FileNotFoundError(f"no trace-rank<N>.jsonl in {directory}")
    else:
        files = list(paths)
    out: list[RankTrace] = []
    for path in files:
        events = read_jsonl(path)
        meta = next((e for e in events if e.get("kind") == "meta"), None)
        m = _TRACE_FILE.match(os.path.basename(path))
        rank = int(meta["rank"]) if meta else int(m.group(1)) if m else len(out)
        out.append(RankTrace(rank=rank, events=tuple(events), path=path))
    out.sort(key=lambda t: t.rank)
    return out


def origin_us(traces: Sequence[RankTrace]) -> float:
    """A common time origin: the earliest process start, else the earliest event."""
    starts = [t.process_start_us for t in traces]
    known = [s for s in starts if s is not None]
    if known:
        return min(known)
    firsts = [f for f in (t.first_us for t in traces) if f is not None]
    return min(firsts) if firsts else 0.0


def spans_of(trace: RankTrace, origin: float | None = None) -> list[Span]:
    """The spans of one rank, in start order, with seconds from ``origin`` (µs; default: the
    rank's own process start, else its first event) and their nesting depth per thread."""
    if origin is None:
        origin = trace.process_start_us or trace.first_us or 0.0
    raw = sorted(
        (e for e in trace.events if e.get("kind") == "span"),
        key=lambda e: (float(e["ts"]), -float(e["dur"])),
    )
    open_by_tid: dict[int, list[float]] = {}
    out = []
    for e in raw:
        tid = int(e.get("tid", 0))
        ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        stack = open_by_tid.setdefault(tid, [])
        while stack and stack[-1] <= ts:
            stack.pop()
        out.append(
            Span(
                name=str(e["name"]),
                start_s=(ts - origin) / 1e6,
                dur_s=float(e["dur"]) / 1e6,
                thread=str(e.get("thread", tid)),
                tid=tid,
                depth=len(stack),
                error=e.get("error"),
            )
        )
        stack.append(end)
    return out


def stage_of(event: Mapping[str, Any], spans: Sequence[Mapping[str, Any]]) -> str:
    """The innermost span an event happened in: on its own thread first, else on any thread
    (``launch`` excepted); ``"other"`` when none contains it. ``spans`` are raw span events."""
    ts = float(event["ts"])
    best: Mapping[str, Any] | None = None
    for same_thread in (True, False):
        for s in spans:
            if same_thread and s.get("tid") != event.get("tid"):
                continue
            if not same_thread and s["name"] == "launch":
                continue
            inside = float(s["ts"]) <= ts <= float(s["ts"]) + float(s["dur"])
            if inside and (best is None or float(s["dur"]) < float(best["dur"])):
                best = s
        if best is not None:
            return str(best["name"])
    return "other"


def comm_counts(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """c10d ops, bytes, barriers, new process groups and store operations among ``events``."""
    s = summarize(events)  # type: ignore[arg-type]
    return {
        "c10d_ops": s["c10d_total"],
        "c10d_bytes": s["c10d_bytes"],
        "barriers": s["barriers"],
        "new_groups": s["new_groups"],
        "store_ops": s["store_total"],
        "store_bytes": s["store_bytes"],
    }


@dataclasses.dataclass(frozen=True, slots=True)
class SpanStats:
    """One span name over the ranks of a run (durations summed per rank when it repeats)."""

    name: str
    ranks: int
    """Ranks that recorded it."""
    calls: int
    """Times it ran, over all ranks."""
    start_s: float
    """Median over ranks of its first start, from each rank's origin."""
    min_s: float
    median_s: float
    max_s: float
    comm: dict[str, int]
    """Max over ranks of the communication issued inside it (innermost span)."""


def span_stats(traces: Sequence[RankTrace]) -> list[SpanStats]:
    """Per span name: start, duration over ranks, communication inside; in order of start."""
    per_name: dict[str, dict[int, list[Span]]] = {}
    comm: dict[str, dict[int, dict[str, int]]] = {}
    for t in traces:
        for sp in spans_of(t):
            per_name.setdefault(sp.name, {}).setdefault(t.rank, []).append(sp)
        raw_spans = [e for e in t.events if e.get("kind") == "span"]
        by_stage: dict[str, list[Mapping[str, Any]]] = {}
        for e in t.events:
            if e.get("kind") in ("c10d", "store", "group"):
                by_stage.setdefault(stage_of(e, raw_spans), []).append(e)
        for name, evs in by_stage.items():
            comm.setdefault(name, {})[t.rank] = comm_counts(evs)
    out = []
    for name, by_rank in per_name.items():
        totals = [sum(s.dur_s for s in spans) for spans in by_rank.values()]
        starts = [min(s.start_s for s in spans) for spans in by_rank.values()]
        per_rank_comm = comm.get(name, {})
        keys = ("c10d_ops", "c10d_bytes", "barriers", "new_groups", "store_ops", "store_bytes")
        out.append(
            SpanStats(
                name=name,
                ranks=len(by_rank),
                calls=sum(len(s) for s in by_rank.values()),
                start_s=statistics.median(starts),
                min_s=min(totals),
                median_s=statistics.median(totals),
                max_s=max(totals),
                comm={k: max((c[k] for c in per_rank_comm.values()), default=0) for k in keys},
            )
        )
    out.sort(key=lambda s: (s.start_s, -s.max_s))
    return out


def critical_path(
    durations: Mapping[str, float], deps: Mapping[str, Sequence[str]]
) -> tuple[float, list[str]]:
    """Longest chain through the stage DAG ``deps`` weighted by ``durations``: (seconds, chain).

    ``deps`` maps every stage to the stages it waits for; a stage missing from ``durations``
    weighs nothing.
    """
    best: dict[str, tuple[float, list[str]]] = {}

    def longest(stage: str, seen: tuple[str, ...] = ()) -> tuple[float, list[str]]:
        if stage in seen:
            raise ValueError(f"cycle in the stage graph through {stage!r}")
        if stage not in best:
            prev = max((longest(d, (*seen, stage)) for d in deps.get(stage, ())), default=(0.0, []))
            best[stage] = (prev[0] + float(durations.get(stage, 0.0)), [*prev[1], stage])
        return best[stage]

    return max((longest(s) for s in deps), default=(0.0, []))


def format_span_table(traces: Sequence[RankTrace], title: str | None = None) -> str:
    """``stages.md``: the per-span table and per-rank totals, as Markdown."""
    stats = span_stats(traces)
    lines = [f"# {title or 'Start-up trace'}", ""]
    lines.append(
        f"{len(traces)} rank(s); seconds from each rank's "
        + ("process start" if all(t.process_start_us for t in traces) else "first event")
        + "; a span that ran several times is summed per rank. Communication: inside the "
        "innermost span containing it, max over ranks."
    )
    lines.append("")
    lines.append(
        "| span | ranks | calls | start s (median) | min s | median s | max s "
        "| c10d ops | c10d bytes | barriers | new groups | store ops |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in stats:
        c = s.comm
        lines.append(
            f"| {s.name} | {s.ranks} | {s.calls} | {s.start_s:.3f} | {s.min_s:.3f} "
            f"| {s.median_s:.3f} | {s.max_s:.3f} | {c['c10d_ops']} | {c['c10d_bytes']} "
            f"| {c['barriers']} | {c['new_groups']} | {c['store_ops']} |"
        )
    lines += ["", "## Per rank", ""]
    lines.append(
        "| rank | time to first batch s | c10d ops | c10d bytes | barriers | new groups "
        "| store ops | store bytes |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in traces:
        c = comm_counts(t.events)
        seconds = _ttfb_s(t)
        ttfb = "–" if seconds is None else f"{seconds:.3f}"
        lines.append(
            f"| {t.rank} | {ttfb} | {c['c10d_ops']} | {c['c10d_bytes']} | {c['barriers']} "
            f"| {c['new_groups']} | {c['store_ops']} | {c['store_bytes']} |"
        )
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True, slots=True)
class TimelineRow:
    """One rank's row of a timeline panel."""

    label: str
    spans: tuple[Span, ...]
    ticks: tuple[float, ...] = ()
    """c10d ops, seconds from the origin."""
    end_s: float | None = None
    """A line drawn across the row (the first batch)."""


def timeline_rows(
    traces: Sequence[RankTrace],
    *,
    names: Sequence[str] | None = None,
    prefix: str = "",
    origin: float | None = None,
) -> list[TimelineRow]:
    """One :class:`TimelineRow` per rank, on a common origin (µs; default :func:`origin_us`).

    ``names``: keep only these spans (all when None).
    """
    if origin is None:
        origin = origin_us(traces)
    rows = []
    for t in traces:
        spans = [s for s in spans_of(t, origin) if names is None or s.name in names]
        ticks = tuple((float(e["ts"]) - origin) / 1e6 for e in t.events if e.get("kind") == "c10d")
        at = first_batch_us(t)
        end = None if at is None else (at - origin) / 1e6
        rows.append(
            TimelineRow(label=f"{prefix}r{t.rank}", spans=tuple(spans), ticks=ticks, end_s=end)
        )
    return rows


def _generated(i: int) -> str:
    """The ``i``-th generated colour: hues a golden angle apart, three lightness levels."""
    hue = (i * 0.6180339887498949) % 1.0
    light = (0.42, 0.58, 0.72)[(i // 7) % 3]
    r, g, b = colorsys.hls_to_rgb(hue, light, 0.65)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def span_colors(names: Iterable[str]) -> dict[str, str]:
    """A colour per span name, distinct for distinct names however many there are: the
    benchmark's stages keep :data:`STAGE_COLORS`, the others take the palette, then generated
    colours, each skipping any colour already taken."""
    out: dict[str, str] = {}
    taken = set(STAGE_COLORS.values())
    palette = iter(c for c in _PALETTE if c not in taken)
    i = 0
    for name in dict.fromkeys(names):
        if name in STAGE_COLORS:
            out[name] = STAGE_COLORS[name]
            continue
        color = next(palette, None)
        while color is None or color in taken:
            color, i = _generated(i), i + 1
        out[name] = color
        taken.add(color)
    return out


def draw_timelines(
    panels: Sequence[tuple[str, Sequence[TimelineRow]]],
    *,
    title: str | None = None,
    xlabel: str = "seconds",
) -> Any:
    """The figure :func:`plot_timelines` saves (a ``matplotlib.figure.Figure``): one Gantt panel
    per ``(panel title, rows)``, then the legend in a panel of its own below them, as many rows
    of names as it needs, so that any number of spans fits without clipping."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [s.name for _, rows in panels for row in rows for s in row.spans]
    colors = span_colors(names)
    used = list(colors)
    width_in = 14.0
    # Columns by the longest name (7-point text: about 0.065 in a character, plus the swatch).
    longest = max((len(n) for n in used), default=1)
    ncol = max(1, min(len(used), int(width_in // (0.065 * longest + 0.45))))
    legend_rows = math.ceil(len(used) / ncol) if used else 0
    legend_in = 0.3 + 0.17 * legend_rows
    heights = [0.45 * max(1, len(rows)) + 0.7 for _, rows in panels] or [1.0]
    fig, axes = plt.subplots(
        len(heights) + 1,
        1,
        figsize=(width_in, 0.6 + sum(heights) + legend_in),
        squeeze=False,
        gridspec_kw={"height_ratios": [*heights, legend_in]},
    )
    for ax, (panel_title, rows) in zip(axes[:-1, 0], panels, strict=True):
        for y, row in enumerate(rows):
            first: dict[str, float] = {}
            for s in row.spans:
                first[s.thread] = min(first.get(s.thread, s.start_s), s.start_s)
            lane = {name: i for i, name in enumerate(sorted(first, key=first.__getitem__))}
            h = 0.8 / max(1, len(lane))
            for s in row.spans:
                shrink = 0.75**s.depth
                y0 = y - 0.4 + lane[s.thread] * h + h * (1 - shrink) / 2
                ax.broken_barh(
                    [(s.start_s, max(s.dur_s, 1e-4))],
                    (y0, h * 0.95 * shrink),
                    facecolors=colors[s.name],
                    edgecolors="none" if s.error is None else "red",
                )
            if row.ticks:
                ax.plot(
                    row.ticks,
                    [y + 0.42] * len(row.ticks),
                    linestyle="none",
                    marker="|",
                    color="k",
                    markersize=4,
                )
            if row.end_s is not None:
                ax.plot([row.end_s] * 2, [y - 0.45, y + 0.45], color="k", lw=1.5)
        ax.set_yticks(range(len(rows)), [r.label for r in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(panel_title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-2, 0].set_xlabel(xlabel)
    legend_ax = axes[-1, 0]
    legend_ax.axis("off")
    if used:
        legend_ax.legend(
            handles=[Patch(color=colors[n], label=n) for n in used],
            loc="upper left",
            ncol=ncol,
            fontsize=7,
            frameon=False,
            borderaxespad=0.0,
            mode="expand",
        )
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_timelines(
    panels: Sequence[tuple[str, Sequence[TimelineRow]]],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    xlabel: str = "seconds",
) -> None:
    """Draw one Gantt panel per ``(panel title, rows)`` into a PNG: per row one lane per thread,
    nested spans thinner inside their parent, c10d ops as ticks, ``end_s`` as a black line, and
    every span name in the legend below (:func:`draw_timelines`)."""
    import matplotlib.pyplot as plt

    fig = draw_timelines(panels, title=title, xlabel=xlabel)
    # "tight": the saved image grows to whatever the figure holds, so nothing is cut off.
    fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_chrome_trace(
    runs: Sequence[tuple[str, Sequence[str]]], path: str | os.PathLike[str]
) -> None:
    """Several runs' trace files as one Chrome/Perfetto trace: ``runs`` is ``(label, paths)``;
    every (run, rank) becomes its own process."""
    events: list[dict[str, Any]] = []
    for index, (label, paths) in enumerate(runs):

        def name(k: int, lb: str = label) -> str:
            return f"{lb} rank {k}".strip()

        trace = to_chrome_trace(paths, label=name)
        for e in trace["traceEvents"]:
            e["pid"] = index * 100_000 + int(e["pid"])
        events.extend(trace["traceEvents"])
    with open(os.fspath(path), "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def render(
    trace_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> dict[str, pathlib.Path]:
    """Write ``timeline.png``, ``stages.md`` and ``trace.json`` for the traces in ``trace_dir``.

    Args:
        trace_dir: a directory with ``trace-rank<N>.jsonl`` files (``FASTINIT_TRACE_DIR``, the
            benchmark's run directories).
        out_dir: where the three files go (created if missing; existing files of those names are
            replaced).
        title: heading of the picture and the table (default: the trace directory).

    Returns:
        ``{"timeline": ..., "stages": ..., "trace": ...}``, the paths written; without matplotlib
        (the ``report`` extra) no ``"timeline"``, with one warning per process.

    Raises:
        FileNotFoundError: ``trace_dir`` has no trace files.
    """
    traces = load(trace_dir)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    heading = title or f"Trace of {os.fspath(trace_dir)}"
    paths = {
        "timeline": out / "timeline.png",
        "stages": out / "stages.md",
        "trace": out / "trace.json",
    }
    paths["stages"].write_text(format_span_table(traces, heading))
    write_chrome_trace([("", [t.path for t in traces])], paths["trace"])
    origin = origin_us(traces)
    since = "process start" if all(t.process_start_us for t in traces) else "first event"
    try:
        plot_timelines(
            [(f"{len(traces)} rank(s)", timeline_rows(traces, origin=origin))],
            paths["timeline"],
            title=heading,
            xlabel=f"seconds since the earliest {since} (ticks: c10d ops; black line: first batch)",
        )
    except ModuleNotFoundError as e:
        if not (e.name or "").split(".")[0] == "matplotlib":
            raise
        _warn_no_matplotlib()
        del paths["timeline"]
    return paths


_warned_no_matplotlib = False


def _warn_no_matplotlib() -> None:
    global _warned_no_matplotlib
    if not _warned_no_matplotlib:
        _warned_no_matplotlib = True
        logger.warning(
            "timeline.png not drawn: the picture needs matplotlib (pip install "
            "'fastinit[report]'); stages.md and trace.json are written"
        )
