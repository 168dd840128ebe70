"""The ETT model and the projection's formulas (benchmarks/ttfb/ett.py, benchmarks/ttfb/projection.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from benchmarks.ttfb.ett import JobProfile, ett, ett_points_saved, optimal_interval
from benchmarks.ttfb.projection import (
    FABRICS,
    Fabric,
    collective_time,
    fit_power,
    group_creation_time,
    ops_time,
)


def test_ett_breakdown_by_hand() -> None:
    p = JobProfile(
        time_to_start_s=300,
        time_to_recover_s=100,
        failures_per_day=4,
        checkpoint_interval_s=3600,
        checkpoint_blocking_s=20,
        day_s=86_400,
    )
    b = ett(p)
    loop = 86_400 - 4 * 400
    assert b.restart_s == pytest.approx(1_600)
    assert b.unsaved_s == pytest.approx(4 * 3600 / 2)
    assert b.blocking_s == pytest.approx(loop / 3600 * 20)
    assert b.productive_s == pytest.approx(loop - 7_200 - loop / 3600 * 20)
    assert b.ett_pct == pytest.approx(100 * b.productive_s / 86_400)


def test_optimal_interval_is_youngs_and_minimises_loss() -> None:
    p = JobProfile(time_to_start_s=120, failures_per_day=3, checkpoint_blocking_s=30)
    loop = 86_400 - 3 * 120
    best = optimal_interval(p)
    assert best == pytest.approx(math.sqrt(2 * loop * 30 / 3))
    at_best = ett(p).ett_pct
    for factor in (0.5, 0.8, 1.25, 2.0):
        other = JobProfile(
            time_to_start_s=120,
            failures_per_day=3,
            checkpoint_blocking_s=30,
            checkpoint_interval_s=best * factor,
        )
        assert ett(other).ett_pct < at_best


def test_edge_cases_and_savings() -> None:
    no_failures = JobProfile(time_to_start_s=600, failures_per_day=0, checkpoint_blocking_s=30)
    assert math.isinf(optimal_interval(no_failures))
    assert ett(no_failures).ett_pct == pytest.approx(100.0)
    p = JobProfile(time_to_start_s=0, failures_per_day=10, checkpoint_blocking_s=30)
    # 10 restarts a day, 200 s faster each: about 2000 s of 86400 (the interval shifts a little).
    gained = ett_points_saved(p, stock_start_s=260, fastinit_start_s=60)
    assert 2.0 < gained < 2.5
    assert ett_points_saved(p, 60, 60) == 0.0
    with pytest.raises(ValueError):
        JobProfile(time_to_start_s=-1)


def test_collective_formulas() -> None:
    f = Fabric(name="t", alpha_s=1e-5, beta_s_per_byte=1e-9, op_overhead_s=0.0, source="test")
    assert collective_time("broadcast_", 1000, 1024, f) == pytest.approx(10 * (1e-5 + 1e-6))
    assert collective_time("allgather_", 100, 1024, f) == pytest.approx(1023 * (1e-5 + 1e-7))
    assert collective_time("allreduce_", 1024, 4, f) == pytest.approx(6e-5 + 1.5 * 1024e-9)
    assert collective_time("alltoall_base_", 800, 8, f) == pytest.approx(7e-5 + 700e-9)
    assert collective_time("barrier", 0, 4096, f) == pytest.approx(12e-5)
    assert collective_time("allgather_", 100, 1, f) == 0.0
    ops = {"allgather_": {"count": 4, "bytes": 400}, "broadcast_": {"count": 2, "bytes": 20}}
    expected = 4 * collective_time("allgather_", 100, 64, f) + 2 * collective_time(
        "broadcast_", 10, 64, f
    )
    assert ops_time(ops, 64, f) == pytest.approx(expected)
    # The stock per-table all_gathers grow linearly in ranks; fastinit's one exchange too, but once.
    assert ops_time(ops, 4096, FABRICS["ib"]) > 50 * ops_time(ops, 64, FABRICS["ib"]) / 2


def test_group_creation_and_fit() -> None:
    f = FABRICS["ib"]
    t_stock, g_stock = group_creation_time(4096, 8, "stock", f, store_op_s=1e-5)
    t_fast, g_fast = group_creation_time(4096, 8, "fastinit", f, store_op_s=1e-5)
    assert g_stock == 512 + 8 and g_fast == 2
    assert t_stock == pytest.approx(520 * 4096 * 1e-5 + 2 * collective_time("barrier", 0, 4096, f))
    assert t_fast == pytest.approx((8 + 512) * 1e-5)
    c, k = fit_power([2, 4, 8, 16], [3 * x**1.5 for x in (2, 4, 8, 16)])
    assert c == pytest.approx(3.0) and k == pytest.approx(1.5)


def test_ttfb_components_by_hand() -> None:
    from benchmarks.ttfb.projection import ttfb_components

    fab = Fabric(name="t", alpha_s=1e-5, beta_s_per_byte=1e-9, op_overhead_s=0.0, source="")
    measured = {
        "ttfb_s": 10.0,
        "stages_s": {"process_group_init": 0.5, "train_module_creation": 2.5},
        "setup": {"store_ops": 4},
        "setup_by_op": {"broadcast_": {"count": 2, "bytes": 200}},
    }
    n = 1024
    restart = ttfb_components(
        measured, mode="stock-best", scenario="new-hosts", n=n, fabric=fab,
        store_op_s=1e-4, plan_fit=None, plan_bytes=None, local_s=1.5,
    )  # fmt: skip
    assert restart["single_host_fixed_s"] == pytest.approx(7.0)
    assert restart["rendezvous_s"] == pytest.approx(4 * n * 1e-4)
    assert restart["planning_s"] == 0.0 and restart["local_s"] == 1.5
    assert restart["collectives_s"] == pytest.approx(2 * collective_time("broadcast_", 100, n, fab))
    stock_groups, _ = group_creation_time(n, 8, "stock", fab, 1e-4)
    assert restart["groups_s"] == pytest.approx(stock_groups)
    parts = [v for k, v in restart.items() if not k.startswith("ttfb")]
    assert restart["ttfb_twrw_s"] == pytest.approx(sum(parts))
    assert restart["ttfb_s"] == pytest.approx(sum(parts) - restart["groups_s"])
    cold = ttfb_components(
        measured, mode="fastinit", scenario="cold", n=n, fabric=fab,
        store_op_s=1e-4, plan_fit=(0.01, 1.0), plan_bytes=10_000, local_s=1.5,
    )  # fmt: skip
    assert cold["planning_s"] == pytest.approx(0.01 * n)
    # The plan message (the larger broadcast) grows to the plan's size at n; the other keeps its.
    assert cold["collectives_s"] > restart["collectives_s"]
    assert cold["groups_s"] < restart["groups_s"]


def test_read_scale_json(tmp_path: Any) -> None:
    from benchmarks.ttfb.projection import read_scale_json

    good = tmp_path / "scale.json"
    good.write_text(
        json.dumps(
            {
                "model": "large",
                "rows": [
                    {"world_size": 64, "mode": "stock", "setup_s": 3.0, "peak_rss_mb": 1.0},
                    {"world_size": 64, "mode": "fastinit", "setup_s": 1.0, "peak_rss_mb": 1.0},
                    {"world_size": 4096, "mode": "fastinit", "setup_s": 1.2, "peak_rss_mb": 1.0},
                ],
            }
        )
    )
    assert read_scale_json(str(good)) == {"stock": {64: 3.0}, "fastinit": {64: 1.0, 4096: 1.2}}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"world_size": 8, "mode": "other", "setup_s": 1}]}))
    with pytest.raises(ValueError, match="mode must be"):
        read_scale_json(str(bad))
    bad.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="rows"):
        read_scale_json(str(bad))
