"""The checkpoint interval: Young's optimum, its costs, and ``fastinit checkpoint interval``."""

from __future__ import annotations

import json
import math

import pytest

from fastinit import cli
from fastinit.checkpoint.interval import (
    FORMULA,
    choose_interval,
    daly_interval,
    interval_cost,
    young_interval,
)

pytestmark = pytest.mark.usefixtures("fastinit_logger_restored")


@pytest.mark.parametrize(("blocking", "mtbf"), [(2.5, 7.9 * 3600), (30.0, 3600.0), (0.1, 1e6)])
def test_young_is_the_minimum_of_unsaved_plus_blocking(blocking: float, mtbf: float) -> None:
    best = young_interval(blocking, mtbf)
    assert best == pytest.approx(math.sqrt(2 * blocking * mtbf))

    def total(i: float) -> float:
        return sum(interval_cost(i, blocking, mtbf))

    # A scan around the optimum finds nothing cheaper, and at the optimum the two costs are equal.
    for factor in (0.5, 0.8, 0.95, 0.99, 1.01, 1.05, 1.25, 2.0):
        assert total(best) <= total(best * factor)
    unsaved, blocked = interval_cost(best, blocking, mtbf)
    assert unsaved == pytest.approx(blocked)


def test_costs_over_the_loop() -> None:
    c = choose_interval(blocking_s=2.0, mtbf_s=3600.0, loop_s=7200.0, step_s=0.5)
    assert c.failures == pytest.approx(2.0)
    assert c.interval_s == pytest.approx(120.0)
    assert c.unsaved_s == pytest.approx(2.0 * 120.0 / 2)
    assert c.blocking_total_s == pytest.approx(7200.0 / 120.0 * 2.0)
    assert c.overhead_pct == pytest.approx(100 * 240.0 / 7200.0)
    assert c.interval_steps == 240


def test_daly_agrees_with_young_when_blocking_is_small() -> None:
    assert daly_interval(1.0, 1e6) == pytest.approx(young_interval(1.0, 1e6), rel=1e-3)
    assert daly_interval(5000.0, 1000.0) == 1000.0  # B >= 2M: checkpoint once per MTBF


def test_edge_cases_and_bad_input() -> None:
    assert choose_interval(0.0, 3600.0).interval_s == 0.0
    assert math.isinf(choose_interval(1.0, math.inf).interval_s)
    for blocking, mtbf in ((-1.0, 10.0), (1.0, 0.0), (math.nan, 10.0)):
        with pytest.raises(ValueError):
            choose_interval(blocking, mtbf)
    with pytest.raises(ValueError):
        choose_interval(1.0, 10.0, loop_s=0.0)


def test_agrees_with_the_benchmarks_ett_model() -> None:
    from benchmarks.ttfb.ett import JobProfile, _loop_s, optimal_interval

    p = JobProfile(time_to_start_s=60.0, failures_per_day=3.0, checkpoint_blocking_s=30.0)
    mtbf = _loop_s(p) / p.failures_per_day
    assert optimal_interval(p) == pytest.approx(young_interval(30.0, mtbf))


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["checkpoint", "interval", "--blocking-s", "2.5", "--mtbf-h", "7.9"]) == 0
    out = capsys.readouterr().out
    assert FORMULA in out and "377 s" in out and "Daly" in out
    # It says which blocking to enter: save()'s return plus the loop's handle.wait(), measured.
    assert "save() takes to return" in out and "handle.wait() holds the loop" in out
    assert "time.perf_counter()" in out
    with pytest.raises(SystemExit):
        cli.main(["checkpoint", "interval", "--help"])
    assert "handle.wait()" in " ".join(capsys.readouterr().out.split())
    argv = ["checkpoint", "interval", "--blocking-s", "2", "--mtbf-h", "1", "--step-s", "0.5"]
    assert cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["interval_s"] == pytest.approx(120.0) and data["interval_steps"] == 240
    assert cli.main(["checkpoint", "interval", "--blocking-s", "1", "--mtbf-h", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fastinit.checkpoint, fastinit.checkpoint.interval\n"
        "print(','.join(m for m in ('torch', 'torchrec') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
