"""make resume-scale: the harness's pure parts (analysis, report, the ranks a resharded load
needs) fast; one small end-to-end run (real saves and loads on the fake backend) slow."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.resume_scale import main as rs


def _row(n: int, seconds: float, stock: float | None = None) -> dict[str, Any]:
    load = {
        "seconds": seconds,
        "bytes_read": 1000,
        "metadata_bytes": 200,
        "own_bytes": 1000,
        "files_read": 2,
        "rss_growth_mb": 1.0,
        "source_ranks": [n // 2 - 1],
    }
    row: dict[str, Any] = {"world_size": n, "same_plan": dict(load), "resharded": dict(load)}
    if stock is not None:
        row["stock"] = {
            "seconds": stock,
            "metadata_bytes": 2**20 * n / 64,
            "rss_growth_mb": 10.0,
            "built": {"chunks": 10 * n},
        }
    return row


def test_analysis_targets_and_report() -> None:
    rows = [_row(n, 0.2 * (n / 512) ** 0.1, stock=n / 100) for n in (512, 1024, 4096, 8192)]
    result = rs.analyse(rows, rs.ResumeScaleConfig())
    t = result["targets"]
    assert t["same_plan_s_at_4096"] == pytest.approx(0.2 * 8**0.1)
    assert t["same_plan_exponent_512_8192"] == pytest.approx(0.1)
    assert t["stock_exponent_512_8192"] == pytest.approx(1.0)
    assert t["met"] == {"fastinit_le_1s_at_4096": True, "exponent_le_0.3": True}
    assert result["extra_bytes"]["same_plan"] == [(n, 200) for n in (512, 1024, 4096, 8192)]
    table = rs.format_table(result)
    assert "| 4096 |" in table and "target ≤ 1 s: met" in table
    slow = rs.analyse([_row(n, n / 1000) for n in (512, 4096, 8192)], rs.ResumeScaleConfig())
    assert slow["targets"]["met"] == {"fastinit_le_1s_at_4096": False, "exponent_le_0.3": False}
    assert "not met" in rs.format_table(slow)


def test_errors_are_reported_not_raised() -> None:
    rows = [{"world_size": 64, "save_error": ["boom"]}]
    result = rs.analyse(rows, rs.ResumeScaleConfig())
    assert "boom" in rs.format_table(result)


def test_factory_reference() -> None:
    assert rs._factory("benchmarks.resume_scale.main:analyse") is rs.analyse
    with pytest.raises(ValueError, match="module:function"):
        rs._factory("no-colon")


def test_needed_ranks_from_the_two_plans(tmp_path: Any) -> None:
    pytest.importorskip("torchrec")
    cfg = rs.ResumeScaleConfig(model="small").to_json()
    new, old = str(tmp_path / "16.bin"), str(tmp_path / "8.bin")
    rs.write_plans(cfg, [16, 8], [new, old])
    ranks = rs.needed_ranks(new, 16, old)
    # Rank 15 of 16 holds the last rows of each row-wise table: rank 7 of 8 stored them; rank 0
    # holds the index and replicated values and shard 0 of every row-wise table.
    assert 0 in ranks and 7 in ranks
    assert len(ranks) < 8  # not every rank's files
    # The measured rank by default holds sharded tables (row-wise among them), not only
    # replicated state; its resharded load reads another rank's files than its own and rank 0's.
    measured = rs.measured_rank(cfg, 16, new)
    assert measured["holds"].get("row_wise", 0) > 0, measured
    assert measured["rank"] == rs.default_rank(new, 16)
    mine = rs.needed_ranks(new, 16, old, measured["rank"])
    assert set(mine) - {0, measured["rank"]}, mine
    assert rs.measured_rank({**cfg, "rank": -1}, 16, new)["rank"] == 15
    with pytest.raises(ValueError, match="not a rank of 16"):
        rs.measured_rank({**cfg, "rank": 16}, 16, new)


@pytest.mark.slow
def test_end_to_end_small(tmp_path: Any) -> None:
    config = rs.ResumeScaleConfig(model="small", ranks=(16,), out=str(tmp_path / "out"))
    result = rs.run(config)
    row = result["rows"][0]
    assert row["same_plan"]["mode"] == "same-plan", row
    assert row["same_plan"]["source_ranks"] == [row["rank"]]
    assert row["rank_holds"].get("row_wise", 0) > 0, row
    assert row["resharded"]["mode"] == "resharded", row
    assert set(row["resharded"]["source_ranks"]) - {0, row["rank"]}, row
    assert row["same_plan"]["own_sharded_bytes"] > 0
    assert row["stock"]["built"]["chunks"] > 0 and row["stock"]["read_items"] > 0
    assert (tmp_path / "out" / "resume-scale.md").exists()


def test_projection_time_to_recover_rows(tmp_path: Any) -> None:
    import json

    from benchmarks.ttfb import projection

    rows = [_row(n, 0.1 + n / 1e5, stock=n / 200) for n in (512, 1024, 2048)]
    for r in rows:
        r["same_plan"]["own_bytes"] = 10**8  # 100 MB per rank, 800 MB per host
    path = tmp_path / "resume-scale.json"
    path.write_text(json.dumps(rs.analyse(rows, rs.ResumeScaleConfig())))
    resume = projection.read_resume_json(str(path))
    ttfb = [
        {"scenario": "new-hosts", "mode": m, "ranks": n, "ttfb_s": t}
        for m, t in (("stock-best", 50.0), ("fastinit", 7.0))
        for n in (1024, 4096)
    ]
    got = projection.recover_rows(ttfb, resume, read_gbps=2.0, local_world_size=8)
    by = {(r["mode"], r["ranks"]): r for r in got}
    fast = by[("fastinit", 1024)]
    assert fast["floor_s"] == pytest.approx(0.4) and fast["measured"]
    assert fast["recover_s"] == pytest.approx(7.0 + 0.4 + 0.1 + 1024 / 1e5)
    assert fast["beyond_floor_s"] == pytest.approx(fast["recover_s"] - 0.4)
    stock = by[("stock-best", 4096)]
    assert not stock["measured"]  # past stock's measured world sizes: the power-law fit
    assert stock["load_work_s"] == pytest.approx(4096 / 200, rel=1e-6)
    text = projection.format_recover(
        {"model": "medium", "read_gbps": 2.0, "local_world_size": 8, "recover_rows": got}
    )
    assert "Time to recover" in text and "goal: under 20 s: met" in text
