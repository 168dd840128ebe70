"""The time-to-first-batch benchmark, end to end and small, so it cannot rot.

Two ranks (gloo, 127.0.0.1), the tiny model with an eager dense arch, one repeat, cold caches,
both modes, launched through the torchx component exactly as ``make bench`` does.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from benchmarks.trainer import STAGES


@pytest.mark.timeout(240)
def test_bench_end_to_end(tmp_path: Any) -> None:
    from benchmarks import bench

    out = str(tmp_path / "bench-out")
    summary = bench.main(
        [
            "--models", "tiny",
            "--scenarios", "cold",
            "--repeats", "1",
            "--nproc", "2",
            "--no-compile",
            "--out", out,
        ]
    )  # fmt: skip
    for name in ("summary.json", "report.md", "timeline.png", "trace.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "summary.json")) as f:
        on_disk = json.load(f)
    assert on_disk["results"].keys() == summary["results"].keys() == {"tiny"}
    cold = on_disk["results"]["tiny"]["cold"]
    for mode in ("stock", "fastinit"):
        res = cold[mode]
        assert res["ttfb_s"] > 0
        assert all(res["stages_s"][s] >= 0 for s in STAGES)
        assert res["critical_path_s"] > 0
        assert res["peak_rss_mb"] > 0
    # The exact counts: fastinit's sharding set-up sends no more than stock's, in every way.
    s, f = cold["stock"]["setup"], cold["fastinit"]["setup"]
    assert 1 <= f["c10d_ops"] <= 2 < s["c10d_ops"]
    assert f["c10d_bytes"] < s["c10d_bytes"]
    assert f["new_groups"] <= s["new_groups"] and f["barriers"] == 0
    assert on_disk["versions"]["torchrec"] == "1.8.0"

    # Every rank of every run traced all seven stages, from process start to first batch.
    runs = os.path.join(out, "runs", "tiny", "cold")
    for mode in ("stock", "fastinit"):
        paths = [os.path.join(runs, mode, "r0", f"trace-rank{r}.jsonl") for r in (0, 1)]
        result = bench.analyse_run(paths)
        for rank in result["ranks"]:
            assert set(STAGES) <= set(rank["stages_s"]), rank["stages_s"].keys()
            assert (
                rank["ttfb_s"]
                >= max(rank["stage_start_s"][s] + rank["stages_s"][s] for s in STAGES) - 0.05
            )
            assert rank["info"]["master_addr"] == "127.0.0.1"

    with open(os.path.join(out, "trace.json")) as f:
        trace = json.load(f)
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert set(STAGES) <= names
    with open(os.path.join(out, "report.md")) as f:
        report = f.read()
    assert "fastinit/stock" in report and "| tiny | cold |" in report


def test_critical_path() -> None:
    from benchmarks.bench import critical_path

    deps = {"a": (), "b": ("a",), "c": (), "d": ("b", "c")}
    assert critical_path({"a": 1, "b": 2, "c": 5, "d": 1}, deps) == (6, ["c", "d"])
    assert critical_path({"a": 3, "b": 3, "c": 5, "d": 1}, deps) == (7, ["a", "b", "d"])
