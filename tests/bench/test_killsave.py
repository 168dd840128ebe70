"""benchmarks.ttfb.killsave: a try's verdict (pure) and the report."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from benchmarks.ttfb import killsave


def _try(**over: Any) -> dict[str, Any]:
    ref = {0: {4: 0.5, 5: 0.25, 6: 0.125}, 1: {4: 0.5, 5: 0.25, 6: 0.125}}
    args: dict[str, Any] = {
        "nproc": 2,
        "save_step": 3,
        "steps": 6,
        "reference": ref,
        "resumed": {r: dict(v) for r, v in ref.items()},
        "resumed_from": [3, 3],
        "saved": {0: 10.0, 1: 10.5},
        "killed_at": {0: 10.1, 1: 10.6},
    }
    args.update(over)
    return killsave.check_try(**args)


def test_check_try() -> None:
    ok = _try()
    assert ok["passed"] and ok["bit_equal"] and ok["losses_compared"] == 6
    assert not _try(resumed_from=[None, None])["passed"]  # not committed: started afresh
    assert not _try(resumed_from=[3])["passed"]  # a rank's trace missing
    off = _try(resumed={0: {4: 0.5, 5: 0.25, 6: 0.125}, 1: {4: 0.5, 5: 0.25, 6: 0.1250001}})
    assert not off["bit_equal"] and not off["passed"]
    short = _try(resumed={0: {4: 0.5}, 1: {4: 0.5}})
    assert short["losses_compared"] == 2 and not short["passed"]  # steps missing
    late = _try(saved={0: 10.0, 1: 12.0})  # a save returned after its rank's kill
    assert not late["saves_returned_before_kill"] and not late["passed"]
    assert not _try(saved={0: 10.0})["passed"]  # a rank's save never returned
    assert not _try(killed_at={0: 10.1})["passed"]  # a rank not killed
    with pytest.raises(ValueError):
        killsave.KillSave(out="/x", save_step=6, steps=6)


def test_write(tmp_path: pathlib.Path) -> None:
    summary = {
        "config": {"tries": 2, "nproc": 2, "model": "tiny", "mode": "fastinit",
                   "save_step": 3, "steps": 6},
        "tries": [{**_try(), "try_": 0, "run_s": 30.0,
                   "committed_after_kill_s": 1.5}, {"try": 1, "passed": False,
                                                          "error": "run failed"}],
        "passed": 1,
    }  # fmt: skip
    killsave.write(summary, str(tmp_path), "python -m benchmarks.ttfb.killsave --tries 2")
    text = (tmp_path / "report.md").read_text()
    assert "**1 of 2 tries passed.**" in text
    assert "| 0 | yes | 1.5 | yes ([3, 3]) | yes (6/6) | yes | 30 |" in text
    assert "**no**: run failed" in text
    assert json.loads((tmp_path / "summary.json").read_text())["passed"] == 1
