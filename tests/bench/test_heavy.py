"""The checkpoint-heavy scenario (benchmarks/ttfb/heavy.py): its schedule, its analysis on
made-up records (every save, steps while a save is written, what the resume read), its targets
and report, the ETT model at 4,096 ranks, and (slow) a real run of every checkpointer on the
tiny model: killed, restarted by torchrun, resumed bit-equal."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest

from benchmarks.ttfb import heavy


def test_schedule() -> None:
    h = heavy.Heavy(every=300, saves=3, kill_before_next=10)
    assert h.kill_step == 1190 and h.steps == 1200  # after save 3 (step 900), before save 4
    assert heavy.HEAVY.every == 300
    for bad in ({"every": 1}, {"saves": 0}, {"kill_before_next": 0}, {"kill_before_next": 300}):
        with pytest.raises(ValueError):
            heavy.Heavy(**bad)
    assert set(heavy.CHECKPOINTERS) == {"stock-best", "torch_checkpointing", "fastinit"}


def _write(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _files(tmp_path: pathlib.Path) -> dict[str, Any]:
    gb = 1_000_000_000
    for rank, slow in ((0, 0.0), (1, 0.1)):
        _write(
            tmp_path / f"saves-a0-rank{rank}.jsonl",
            [
                {"event": "saved", "step": 3, "blocking_s": 0.2 + slow, "how": "x",
                 "agree_s": 0.05 - slow / 2},
                {"event": "saved", "step": 6, "blocking_s": 0.3 + slow, "how": "x"},
                {"event": "committed", "step": 3, "blocking_s": 0.2 + slow, "commit_s": 2.0,
                 "agree_s": 0.05 - slow / 2,
                 "wait_s": 0.01, "staged_bytes": gb, "stage_s": 0.19, "writer_s": 1.5,
                 "writer_cpu_s": 0.2 + slow, "digest_s": 0.1},
            ],
        )  # fmt: skip
        _write(
            tmp_path / f"saves-a1-rank{rank}.jsonl",
            [{"event": "prepared", "step": -1, "prepare_s": 1.0},
             {"event": "saved", "step": 9, "blocking_s": 0.4 + slow}],
        )  # fmt: skip
        steps = [{"step": s, "s": 0.1 if s in (4, 5) else 0.05, "saving": s in (4, 5)}
                 for s in range(2, 9)]  # fmt: skip
        steps.append({"step": 2, "s": 9.0, "saving": False})  # attempt 1's first: skipped
        _write(tmp_path / f"steps-a0-rank{rank}.jsonl", steps[:-1])
        _write(tmp_path / f"steps-a1-rank{rank}.jsonl", [{**steps[-1], "step": 7}])
        (tmp_path / f"losses-a0-rank{rank}.json").write_text(json.dumps({"7": 0.5, "8": 0.25}))
    (tmp_path / "trace-rank0.jsonl").write_text("")  # not read by read_run
    return heavy.read_run(str(tmp_path))


def _recover() -> dict[str, Any]:
    bench = {
        "warm_copy": {"bytes": 1_000_000_000, "seconds": [0.1, 0.2, 0.3]},
        "resume_read": {"storage_bytes": 0, "memory_bytes": 1_000_000_000},
        "resume_how": "fastinit.checkpoint.load (same-plan, memory)",
    }
    return {
        "recover_s": 10.0,
        "restart_s": 1.0,
        "startup_s": 9.0,
        "resume_s": 0.5,
        "resumed_from_step": 6,
        "losses_equal": True,
        "losses_compared": 4,
        "stages_s": {"resume": 0.5},
        "ranks": [{"rank": 0, "bench": bench}, {"rank": 1, "bench": bench}],
    }


def test_read_and_analyse(tmp_path: pathlib.Path) -> None:
    files = _files(tmp_path)
    assert {(s["attempt"], s["step"]) for s in files["saves"]} == {(0, 3), (0, 6), (1, 9)}
    assert files["before"] == {0: {7: 0.5, 8: 0.25}, 1: {7: 0.5, 8: 0.25}}
    out = heavy.analyse(_recover(), files, heavy.Heavy(every=3, saves=2, kill_before_next=1,
                                                       skip_steps=1))  # fmt: skip
    saves = out["saves"]
    assert [(s["attempt"], s["step"], s["rank"]) for s in saves] == [
        (0, 3, 1),
        (0, 6, 1),
        (1, 9, 1),
    ]
    first = saves[0]
    assert first["blocking_s"] == pytest.approx(0.3)  # the slowest rank's
    assert first["blocking_s_per_gb"] == pytest.approx(0.3) and first["warm_copy_s"] == 0.2
    assert first["vs_warm_copy"] == pytest.approx(1.5) and first["writer_s"] == 1.5
    assert first["writer_cpu_s"] == pytest.approx(0.3)  # the most any rank's writer took
    assert first["agree_s"] == pytest.approx(0.0)  # the slowest rank's own wait for its peers
    assert math.isnan(saves[1]["agree_s"])  # not recorded
    assert math.isnan(saves[1]["commit_s"])  # killed before its commit was seen
    # steps 3.. of attempt 0 (step 2 skipped), attempt 1's only step skipped
    assert out["writing_step_s"] == pytest.approx(0.1) and out["steady_step_s"] == 0.05
    assert out["writing_vs_steady"] == pytest.approx(2.0)
    assert out["writing_steps"] == 2 and out["steady_steps"] == 4
    assert out["storage_bytes"] == 0 and out["memory_bytes"] == 2_000_000_000
    assert out["first_save_blocking_s"] == pytest.approx(0.3)
    assert out["median_blocking_s"] == pytest.approx(0.4)


def _summary(tmp_path: pathlib.Path) -> dict[str, Any]:
    files = _files(tmp_path)
    fast = heavy.analyse(_recover(), files)
    best = {**fast, "recover_s": 40.0, "saves": [dict(s, blocking_s=2.0) for s in fast["saves"]]}
    best["storage_bytes"], best["memory_bytes"] = 2_000_000_000, 0
    results = {"fastinit": heavy.summarize([fast]), "stock-best": heavy.summarize([best])}
    return {
        "heavy": {
            "plan": {"every": 3, "saves": 2, "max_restarts": 1, "kill_step": 8, "steps": 9},
            "state_mb": 1000.0,
            "results": results,
            "ett": {lb: heavy.ett_at_scale(r["median_blocking_s"], r["recover_s"])
                    for lb, r in results.items()},
        }
    }  # fmt: skip


def test_targets_and_section(tmp_path: pathlib.Path) -> None:
    summary = _summary(tmp_path)
    got = {what: (round(measured, 3), limit) for what, measured, limit in
           heavy.targets(summary["heavy"]["results"])}  # fmt: skip
    assert got["checkpoint-heavy: time to recover, fastinit / stock-best"] == (0.25, 0.5)
    assert got["checkpoint-heavy: fastinit bytes read from storage at resume"] == (0, 0)
    assert (
        got["checkpoint-heavy: fastinit median step while a save is written / steady step"][1]
        == 1.15
    )
    per_save = [w for w in got if w.endswith("blocking / stock-best's")]
    assert len(per_save) == 3 and got[per_save[0]] == (0.15, 0.5)
    text = heavy.section(summary)
    # columns: stock-best, then fastinit
    assert "| time to recover s (kill → first batch after the resume) | 40.00 | 10.00 |" in text
    assert "| read from host memory at resume MB (both ranks) | 0 | 2000 |" in text
    assert "| fastinit | 0 | 0 | 3 | 0.300 |" in text  # every save, the slowest rank's
    assert "ETT at 4,096 ranks" in text and "ETT points" in text


def test_ett_at_scale() -> None:
    e = heavy.ett_at_scale(blocking_s=1.0, recover_s=60.0)
    assert e["mtbf_h"] == pytest.approx(7.9 / 4) and e["failures_per_day"] == pytest.approx(
        24 / (7.9 / 4)
    )
    assert e["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * 7.9 * 3600 / 4), rel=0.01)
    worse = heavy.ett_at_scale(blocking_s=10.0, recover_s=60.0)
    slower = heavy.ett_at_scale(blocking_s=1.0, recover_s=600.0)
    assert worse["ett_pct"] < e["ett_pct"] and slower["ett_pct"] < e["ett_pct"]


def test_trainer_checkpointer_config() -> None:
    from benchmarks.ttfb.trainer import TrainerConfig, _parse

    config = _parse(
        ["--mode", "stock-best", "--cache-dir", "/c", "--checkpoint-dir", "/k",
         "--checkpoint-every", "5", "--checkpointer", "torch-checkpointing"]
    )  # fmt: skip
    assert config.checkpoint_every == 5 and config.checkpointer == "torch-checkpointing"
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainerConfig(checkpoint_every=5)
    with pytest.raises(ValueError, match="fastinit mode saves"):
        TrainerConfig(checkpoint_dir="/k", checkpoint_every=5, checkpointer="torch-checkpointing")
    with pytest.raises(ValueError, match="checkpointer"):
        TrainerConfig(checkpointer="orbax")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_checkpointer_end_to_end(tmp_path: pathlib.Path) -> None:
    """The tiny model through the scenario: three saves, a rank killed, torchrun restarting
    both, every checkpointer resuming from its last save with the losses after the resume equal
    to those before the kill; fastinit reads its state back from host memory."""
    from benchmarks.checkpoint_blocking.anchors import torch_checkpointing_available
    from benchmarks.ttfb.main import BenchConfig

    labels = ["stock-best", "fastinit"]
    if torch_checkpointing_available() is None:
        labels.append("torch_checkpointing")
    config = BenchConfig(
        models=(), out=str(tmp_path), launcher="torchrun", compile=False, heavy_repeats=1
    )
    out = heavy.run(
        config,
        heavy.Heavy(every=4, saves=2, kill_before_next=1, skip_steps=1, timeout_s=300),
        labels=labels,
        model="tiny",
    )
    # Stock's restarts run with torch's workaround (a store per rendezvous round), so none reads
    # the dead attempt's keys: every checkpointer must come back (without it, a stock restart
    # fails about half the time: docs/restarts.md).
    assert not out["not_recovered"], out["not_recovered"]
    for label in labels:
        res = out["results"][label]
        assert res["losses_equal"] and res["losses_compared"] > 0, (label, res)
        assert res["resumed_from_step"] == 8, (label, res)
        assert [(s["attempt"], s["step"]) for s in res["saves"]] == [(0, 4), (0, 8), (1, 12)]
        steps = [res["steady_step_s"], res["writing_step_s"]]
        assert any(x > 0 for x in steps), (label, res)  # some step after the skipped ones timed
    fast = out["results"]["fastinit"]
    assert fast["storage_bytes"] == 0 and fast["memory_bytes"] > 0
    assert out["results"]["stock-best"]["storage_bytes"] > 0


def test_main_writes_the_report(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m benchmarks.ttfb.heavy``: the scenario's summary and report, targets first
    (the runs themselves replaced by made-up results)."""
    from benchmarks.ttfb import data

    (tmp_path / "files").mkdir()
    made_up = _summary(tmp_path / "files")["heavy"]
    monkeypatch.setattr(heavy, "run", lambda config, labels: made_up)
    monkeypatch.setattr(data, "ensure_dataset", lambda *a, **k: None)
    results = tmp_path / "results"
    heavy.main(["--out", str(tmp_path / "out"), "--results", str(results)])
    text = (results / "report.md").read_text()
    assert "Command: `python -m benchmarks.ttfb.heavy --out" in text
    assert (
        "| checkpoint-heavy: time to recover, fastinit / stock-best | 0.25 | ≤ 0.50 | yes |" in text
    )
    assert "ETT at 4,096 ranks" in text
    on_disk = json.loads((results / "summary.json").read_text())
    assert on_disk["heavy"]["results"]["fastinit"]["recover_s"] == 10.0
