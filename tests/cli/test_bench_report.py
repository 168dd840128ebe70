"""fastinit.report on recorded traces (benchmarks/ttfb/testdata): pure analysis and the three files.

The fixture is a real run of the benchmark trainer (tiny model, 2 ranks, eager dense arch, cold),
stock and fastinit, recorded with ``python -m benchmarks.ttfb --models tiny --scenarios cold
--repeats 1 --no-compile --launcher torchrun``.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

from benchmarks.ttfb.trainer import STAGES
from fastinit import report

FIXTURE = (
    pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "ttfb" / "testdata" / "tiny-cold"
)


def test_import_is_light() -> None:
    import subprocess

    code = "import fastinit.report, sys; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_load_and_spans() -> None:
    traces = report.load(FIXTURE / "fastinit")
    assert [t.rank for t in traces] == [0, 1]
    for t in traces:
        assert t.process_start_us is not None and t.bench is not None
        spans = report.spans_of(t)
        names = {s.name for s in spans}
        assert set(STAGES) | {"launch", "first_step", "fastinit.setup"} <= names
        by = {s.name: s for s in spans}
        # Measured from the rank's own process start: launch starts at 0.
        assert by["launch"].start_s == pytest.approx(0.0, abs=1e-6)
        # Nesting on one thread: setup inside train_module_creation, its phases inside setup.
        assert by["train_module_creation"].depth == 0
        assert by["fastinit.setup"].depth == 1 and by["fastinit.dmp"].depth == 2
        outer = by["train_module_creation"]
        assert outer.start_s <= by["fastinit.setup"].start_s <= outer.end_s
        # The first batch comes after every stage ended.
        assert t.bench["ttfb_s"] >= max(by[s].end_s for s in STAGES) - 0.05
    with pytest.raises(FileNotFoundError):
        report.load(FIXTURE)  # no trace files directly in it


def test_span_stats_and_comm() -> None:
    stock = {s.name: s for s in report.span_stats(report.load(FIXTURE / "stock"))}
    fast = {s.name: s for s in report.span_stats(report.load(FIXTURE / "fastinit"))}
    for stats in (stock, fast):
        assert all(stats[s].ranks == 2 and stats[s].calls == 2 for s in STAGES)
        assert all(s.min_s <= s.median_s <= s.max_s for s in stats.values())
    # Stock's DMP issues the per-table metadata gathers; fastinit's whole setup at most 2 ops.
    assert stock["dmp"].comm["c10d_ops"] > 2 and stock["plan"].comm["c10d_ops"] >= 1
    setup_ops = sum(s.comm["c10d_ops"] for n, s in fast.items() if n.startswith("fastinit."))
    assert 1 <= setup_ops <= 2
    assert fast["process_group_init"].comm["store_ops"] > 0
    # Ordered by start.
    starts = [s.start_s for s in report.span_stats(report.load(FIXTURE / "stock"))]
    assert starts == sorted(starts)


def test_stage_of_innermost_and_cross_thread() -> None:
    spans = [
        {"name": "outer", "ts": 0.0, "dur": 100.0, "tid": 1},
        {"name": "inner", "ts": 10.0, "dur": 10.0, "tid": 1},
        {"name": "launch", "ts": 0.0, "dur": 500.0, "tid": 0},
        {"name": "other_thread", "ts": 200.0, "dur": 50.0, "tid": 2},
    ]
    assert report.stage_of({"ts": 15.0, "tid": 1}, spans) == "inner"
    assert report.stage_of({"ts": 50.0, "tid": 1}, spans) == "outer"
    assert report.stage_of({"ts": 210.0, "tid": 9}, spans) == "other_thread"
    assert report.stage_of({"ts": 400.0, "tid": 9}, spans) == "other"


def test_critical_path() -> None:
    deps = {"a": (), "b": ("a",), "c": (), "d": ("b", "c")}
    assert report.critical_path({"a": 1, "b": 2, "c": 5, "d": 1}, deps) == (6, ["c", "d"])
    assert report.critical_path({"a": 3, "b": 3, "c": 5, "d": 1}, deps) == (7, ["a", "b", "d"])
    assert report.critical_path({}, {}) == (0.0, [])
    with pytest.raises(ValueError, match="cycle"):
        report.critical_path({"a": 1}, {"a": ("b",), "b": ("a",)})


def test_render_writes_three_files(tmp_path: pathlib.Path) -> None:
    paths = report.render(FIXTURE / "stock", tmp_path / "out", title="tiny, stock")
    assert set(paths) == {"timeline", "stages", "trace"}
    assert all(p.parent == tmp_path / "out" and p.stat().st_size > 0 for p in paths.values())
    assert paths["timeline"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = paths["stages"].read_text()
    assert table.startswith("# tiny, stock")
    assert all(f"| {s} | 2 | 2 |" in table for s in STAGES)
    assert "| 0 | 17.740 |" in table  # rank 0's recorded time to first batch
    trace = json.loads(paths["trace"].read_text())
    named = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    assert named == {"rank 0", "rank 1"}
    assert STAGES[0] in {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}


def test_render_without_bench_record(tmp_path: pathlib.Path) -> None:
    """A FASTINIT_TRACE_DIR trace: setup spans and comm only, no process start."""
    src = tmp_path / "traces"
    src.mkdir()
    for rank in (0, 1):
        lines = (FIXTURE / "fastinit" / f"trace-rank{rank}.jsonl").read_text().splitlines()
        kept = [
            ln
            for ln in lines
            if json.loads(ln).get("kind") not in ("bench", "mark")
            and not (
                json.loads(ln).get("kind") == "span"
                and not json.loads(ln)["name"].startswith("fastinit.")
            )
        ]
        (src / f"trace-rank{rank}.jsonl").write_text("\n".join(kept) + "\n")
    (src / "unrelated.jsonl").write_text("not json\n")
    paths = report.render(src, tmp_path / "r")
    table = paths["stages"].read_text()
    assert "first event" in table and "| fastinit.setup | 2 | 2 |" in table
    assert "| launch |" not in table
    assert "| 0 | – |" in table
    assert os.path.getsize(paths["timeline"]) > 0


def _user_trace(trace_dir: pathlib.Path, *, mark: bool = False) -> float:
    """A user's own trace, as docs/usage.md writes it: spans of their stages and a
    ``first_batch`` span (or mark); no benchmark record, no process start. Returns the first
    batch's time (µs)."""
    from fastinit import trace

    tracer = trace.Tracer(rank=0, out_dir=str(trace_dir), comm=False).start()
    try:
        with trace.span("build_model"):
            time.sleep(0.02)
        if mark:
            tracer.mark("first_batch")
        else:
            with trace.span("first_batch"):
                pass
        with trace.span("step"):
            pass
    finally:
        tracer.stop()
    events = trace.read_jsonl(str(trace_dir / "trace-rank0.jsonl"))
    if mark:
        return next(float(e["ts"]) for e in events if e.get("kind") == "mark")
    span = next(e for e in events if e.get("name") == "first_batch")
    return float(span["ts"]) + float(span["dur"])


@pytest.mark.parametrize("mark", [False, True])
def test_the_first_batch_of_a_users_trace(tmp_path: pathlib.Path, mark: bool) -> None:
    at = _user_trace(tmp_path / "t", mark=mark)
    traces = report.load(tmp_path / "t")
    table = report.format_span_table(traces)
    per_rank = table.split("## Per rank")[1]
    expected = (at - traces[0].first_us) / 1e6  # type: ignore[operator]
    assert f"| 0 | {expected:.3f} |" in per_rank, per_rank  # the column is filled
    (row,) = report.timeline_rows(traces)
    origin = report.origin_us(traces)
    assert row.end_s == pytest.approx((at - origin) / 1e6)  # the black line is drawn
    assert report.first_batch_us(traces[0]) == pytest.approx(at)


def test_report_without_matplotlib_writes_the_table_and_trace(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import logging

    from fastinit.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    monkeypatch.setattr(report, "_warned_no_matplotlib", False)
    with caplog.at_level(logging.WARNING, logger="fastinit.report"):
        paths = report.render(FIXTURE / "stock", tmp_path / "a")
        again = report.render(FIXTURE / "stock", tmp_path / "b")
    assert set(paths) == set(again) == {"stages", "trace"}
    assert (tmp_path / "a" / "stages.md").read_text().startswith("# Trace of")
    assert json.loads((tmp_path / "a" / "trace.json").read_text())["traceEvents"]
    assert not (tmp_path / "a" / "timeline.png").exists()
    warned = [r.getMessage() for r in caplog.records if r.name == "fastinit.report"]
    assert len(warned) == 1 and "fastinit[report]" in warned[0]  # once
    log = logging.getLogger("fastinit")
    saved = (list(log.handlers), log.level, log.propagate)
    try:
        assert main(["report", str(FIXTURE / "stock"), "--out", str(tmp_path / "c")]) == 0
    finally:
        log.handlers[:], log.propagate = saved[0], saved[2]
        log.setLevel(saved[1])
    out = capsys.readouterr().out
    assert "| device_init |" in out and "timeline: not drawn" in out
    assert (tmp_path / "c" / "trace.json").is_file()


def test_every_span_gets_its_own_colour_and_the_legend_fits() -> None:
    names = [f"my_trainer.a_rather_long_stage_name_{i}" for i in range(60)]
    colors = report.span_colors(["launch", "first_step", *names, *names[:5]])
    assert len(colors) == 62 and len(set(colors.values())) == 62  # distinct, however many
    assert colors["launch"] == report.STAGE_COLORS["launch"]
    assert len(set(report.span_colors(str(i) for i in range(1000)).values())) == 1000

    spans = tuple(
        report.Span(name=n, start_s=0.1 * i, dur_s=0.5, thread="MainThread", tid=1)
        for i, n in enumerate(names)
    )
    rows = [
        report.TimelineRow(label="r0", spans=spans),
        report.TimelineRow(label="r1", spans=spans),
    ]
    fig = report.draw_timelines([("2 ranks", rows)], title="user spans")
    fig.canvas.draw()
    legend = next(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)
    assert [t.get_text() for t in legend.get_texts()] == names  # none left out
    box, figure = legend.get_window_extent(), fig.bbox
    assert (
        figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1
    )
    drawn = {tuple(h.get_facecolor()) for h in legend.legend_handles}
    assert len(drawn) == len(names)
