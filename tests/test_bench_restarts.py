"""The kill-and-restart driver's analysis and report (``benchmarks/restarts.py``), on records."""

from __future__ import annotations

import math

from benchmarks import restarts


def _rec(mode: str, nproc: int, cycle: int, outcome: str, recover_s: float = 0.0) -> dict:
    rec = {"mode": mode, "nproc": nproc, "cycle": cycle, "outcome": outcome, "load_avg": [3.0]}
    if outcome == "recovered":
        rec.update(recover_s=recover_s, losses_equal=True)
    else:
        rec["detail"] = "run fastinit/small/recover failed (exit code 1; log x)\nmore"
    return rec


def test_summarize_and_report() -> None:
    records = [
        _rec("stock-best", 2, 0, "recovered", 9.0),
        _rec("stock-best", 2, 1, "failed"),
        _rec("stock-best", 2, 2, "hang"),
        _rec("fastinit", 2, 0, "recovered", 7.0),
        _rec("fastinit", 2, 1, "recovered", 8.0),
        _rec("fastinit", 2, 2, "recovered", 6.0),
        _rec("fastinit", 4, 0, "failed"),
    ]
    rows = {(r["nproc"], r["mode"]): r for r in restarts.summarize(records)}
    best = rows[(2, "stock-best")]
    assert (best["cycles"], best["recovered"], best["failed"], best["hung"]) == (3, 1, 1, 1)
    assert best["recover_median_s"] == 9.0
    fast = rows[(2, "fastinit")]
    assert fast["recovered"] == 3 and fast["recover_median_s"] == 7.0
    assert (fast["recover_min_s"], fast["recover_max_s"]) == (6.0, 8.0)
    assert rows[(4, "fastinit")]["recovered"] == 0
    assert math.isnan(rows[(4, "fastinit")]["recover_median_s"])
    summary = {
        "date": "2026-12-03",
        "machine": {"cpus": 2, "platform": "linux"},
        "versions": {"torch": "2.13.0"},
        "config": {"model": "small", "timeout_s": 600.0, "compile": True},
        "rows": restarts.summarize(records),
        "cycles": records,
        "command": "python -m benchmarks.restarts",
        "wall_s": 3600.0,
    }
    text = restarts.format_report(summary)
    assert "| 2 | stock-best | **1/3** | 1 | 1 | 9.0 | 9.0 | 9.0 |" in text
    assert "| 4 | fastinit | **0/1** | 1 | 0 | – |" in text
    assert "stock-best, 2 ranks, cycle 2: hang (run fastinit/small/recover failed" in text
