"""The kill-and-restart driver's analysis and report (``benchmarks/restarts/``), on records."""

from __future__ import annotations

import math

from benchmarks.restarts import main as restarts


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


def test_a_timed_out_run_takes_its_workers_with_it(tmp_path) -> None:
    """torchrun starts workers in sessions of their own; a run killed on timeout must not leave
    them behind (a hung restart's workers otherwise wait for hours)."""
    import os
    import sys
    import time

    from benchmarks.ttfb.launch import RunSpec, _run

    pidfile = tmp_path / "worker.pid"
    launcher = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(300)\n"
    )
    spec = RunSpec(
        mode="fastinit", model="tiny", cache="cold", out=str(tmp_path), inductor_dir="", timeout_s=5
    )
    ok, detail = _run([sys.executable, "-c", launcher], dict(os.environ), spec)
    assert not ok and "timed out" in detail
    worker = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{worker}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie of init's: gone
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"worker {worker} outlived its run")
