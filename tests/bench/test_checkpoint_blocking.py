"""The checkpoint blocking benchmark (benchmarks/checkpoint_blocking/): its report's targets on a
made-up summary, the anchors' view of TorchRec's state, and a small run end to end (every save
reported, every load bit-equal)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _save(who: str, i: int, blocking: float, warm: float, **extra: Any) -> dict[str, Any]:
    return {
        "who": who,
        "save": i,
        "blocking_s": blocking,
        "blocking_s_per_gb": blocking / 0.4,
        "warm_copy_s": warm,
        "vs_warm_copy": blocking / warm,
        **extra,
    }


def _summary() -> dict[str, Any]:
    load = {
        "mode": "same-plan",
        "tier": "storage",
        "seconds": 2.0,
        "verify_s": 0.1,
        "verify_share": 0.05,
        "storage_bytes": 400_000_000,
        "memory_bytes": 0,
    }
    return {
        "date": "d",
        "device": "cpu",
        "config": {"rows": 1, "tables": 1, "dim": 4, "saves": 2},
        "bytes": 400_000_000,
        "machine": {"cpus": 2, "load_avg_at_start": [1.0], "load_avg_at_end": [1.0]},
        "versions": {},
        "prepare_s": 0.5,
        "staging": {"writer": "process", "allocated_bytes": 800_000_000},
        "limits": {
            "warm_copy_s": [0.1, 0.1, 0.1],
            "fresh_copy_s": [1.0, 1.0],
            "file": {
                "write_s": 2.0,
                "write_gb_s": 0.2,
                "read_device_s": 1.0,
                "read_device_gb_s": 0.4,
                "read_cache_s": 0.1,
                "read_cache_gb_s": 4.0,
            },
        },
        "fastinit": [
            _save("fastinit", 1, 0.15, 0.1, stage_s=0.14, wait_s=3.0, writer_s=2.9, digest_s=0.1),
            _save("fastinit", 2, 0.25, 0.1, stage_s=0.24, wait_s=3.0, writer_s=2.9, digest_s=0.1),
        ],
        "stock_best": [_save("stock-best", 1, 2.0, 0.1), _save("stock-best", 2, 0.2, 0.1)],
        "stock_best_info": {"how": "dcp", "dcp_stagers": {"DefaultStager()": "refused: x"}},
        "torch_checkpointing_info": {"skipped": "not installed"},
        "load": {"storage": load, "memory": {**load, "tier": "memory"}},
    }


def test_targets_and_report() -> None:
    from benchmarks.checkpoint_blocking import report

    met = {(t.what, round(t.measured, 3)): t.met for t in report.targets(_summary())}
    assert met == {
        ("fastinit save 1: blocking / warm copy", 1.5): True,
        ("fastinit save 2: blocking / warm copy", 2.5): False,
        ("fastinit save 1: blocking / stock-best's", 0.075): True,
        ("fastinit save 2: blocking / stock-best's", 1.25): False,
        ("same-plan load from storage: checksum seconds / load seconds", 0.05): True,
    }
    text = report.markdown(_summary(), "python -m benchmarks.checkpoint_blocking")
    assert "| fastinit | 2 | 0.250 | 0.625 | 0.100 | **2.50** | 0.240 |" in text
    assert "| stock-best | 1 | 2.000 |" in text and "**no**" in text
    assert "not installed" in text and "refused: x" in text
    assert "| copy into a warm buffer (median of 3) | 0.100 | 4.0 |" in text


def test_anchors_on_torchrecs_state() -> None:
    """The two things the anchors are built around: DCP's DefaultStager refuses a
    ShardedTensor, and local_tensors is a view of the live state (a load writes through)."""
    import torch

    from benchmarks.checkpoint_blocking.anchors import local_tensors, nbytes, refusal
    from fastinit.testing.dist import run_ranks

    out = run_ranks(_probe_rank, 1, timeout=300)[0]
    assert out["default"].endswith("not supported for ShardedTensor"), out
    assert out["written_through"] and out["bytes"] == 64 * 4 + 3 * 4
    assert refusal(ValueError("a\nb")) == "ValueError: a"
    assert nbytes([torch.zeros(3)]) == 12
    assert local_tensors({"a": {"b": torch.zeros(2)}})["a.b"].shape == (2,)


def _probe_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharding_spec import ShardMetadata

    from benchmarks.checkpoint_blocking.anchors import local_tensors, nbytes, probe_dcp

    shard = Shard(torch.zeros(16, 4), ShardMetadata([0, 0], [16, 4], f"rank:{dist.get_rank()}/cpu"))
    st = ShardedTensor._init_from_local_shards([shard], (16, 4))
    state = {"model": {"t": st, "dense": torch.zeros(3)}}
    said = probe_dcp(state)
    (default,) = (v for k, v in said.items() if k.startswith("DefaultStager"))
    flat = local_tensors(state)
    flat["model.t#0"].fill_(1.0)
    return {
        "default": default,
        "written_through": bool((st.local_shards()[0].tensor == 1.0).all()),
        "bytes": nbytes(flat),
    }


@pytest.mark.timeout(600)
def test_blocking_benchmark_end_to_end(tmp_path: pathlib.Path) -> None:
    """A small run: every save of every saver reported, the limits measured, the three loads
    bit-equal (--check), the summary and report written."""
    results = tmp_path / "results"
    done = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.checkpoint_blocking",
            "--rows", "2000", "--tables", "2", "--dim", "16", "--saves", "2", "--check",
            "--no-tc", "--out", str(tmp_path / "scratch"), "--results", str(results),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [s["save"] for s in out["fastinit"]] == [1, 2]
    assert [s["save"] for s in out["stock_best"]] == [1, 2]
    for s in out["fastinit"]:
        assert s["staged_bytes"] == out["bytes"] and s["blocking_s"] >= s["stage_s"] > 0
        assert s["writer_s"] > 0 and s["digest_s"] >= 0 and s["vs_warm_copy"] > 0
    assert out["stock_best_info"]["bytes"] == out["bytes"]
    assert len(out["limits"]["warm_copy_s"]) == 3 and out["limits"]["file"]["write_gb_s"] > 0
    loads = out["load"]
    assert loads["storage"]["tier"] == "storage" and loads["storage"]["memory_bytes"] == 0
    assert loads["memory"]["tier"] == "memory" and loads["memory"]["storage_bytes"] == 0
    assert loads["resharded"]["mode"] == "resharded"
    assert all(r["mismatched"] == [] for r in loads.values())
    assert (results / "report.md").read_text().startswith("# Checkpoint blocking")
    assert json.loads((results / "summary.json").read_text())["targets"]


@pytest.mark.timeout(300)
def test_a_save_over_the_limit_fails_the_run(tmp_path: pathlib.Path) -> None:
    """``--max-vs-warm`` (make gpu-check's bound on the blocking) fails the run when a save
    blocks longer than that many warm copies of the same bytes."""
    done = subprocess.run(
        [
            sys.executable, "-m", "benchmarks.checkpoint_blocking",
            "--rows", "2000", "--tables", "2", "--dim", "16", "--saves", "1",
            "--no-tc", "--no-stock", "--max-vs-warm", "0.001", "--out", str(tmp_path),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=250,
    )  # fmt: skip
    assert done.returncode != 0
    assert "warm copies (limit 0.001)" in done.stderr, done.stderr[-2000:]


def test_neighbour_runs_each_way_and_reports(tmp_path: Any) -> None:
    from benchmarks.checkpoint_blocking import neighbour

    runs = [neighbour.one(way, 8 << 20, str(tmp_path)) for way in ("cached", "direct-1")]
    for r in runs:
        assert r["writers_wall_s"] > 0 and r["writers_cpu_s"] >= 0
        assert 0 < r["file_work_ms"] <= r["file_work_p90_ms"] <= r["file_work_max_ms"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["losses.json", "steps.log"]
    text = neighbour.report({"command": "c", "started": "s", "cpus": 2, "gb": 0.008, "runs": runs})
    assert "| direct-1 |" in text and "| cached |" in text
