"""The example trainer (examples/dlrm_trainer.py): TorchRec's DLRM started with fastinit."""

from __future__ import annotations

import time
from typing import Any

from fastinit.testing.dist import run_ranks


def _runs(cache_dir: str) -> dict[str, Any]:
    from examples.dlrm_trainer import TrainerConfig, train

    common: dict[str, Any] = {"steps": 4, "backend": "aot_eager", "compile_cache": cache_dir}
    start = time.perf_counter()
    plain = train(TrainerConfig(warmup=False, **common))
    middle = time.perf_counter()
    warmed = train(TrainerConfig(warmup=True, **common))
    seconds = (middle - start, time.perf_counter() - middle)
    return {"plain": plain, "warmed": warmed, "seconds": seconds}


def test_example_trainer_warm_up_leaves_training_unchanged(tmp_path: Any) -> None:
    # The pipeline's features come in the reverse of the model's table order; the fast batch in
    # the model's order. Warm-up (a full TrainPipelineSparseDist step with the fused
    # EXACT_ROWWISE_ADAGRAD) must not change a single loss.
    for out in run_ranks(_runs, 2, args=(str(tmp_path),), timeout=420):
        plain, warmed = out["plain"], out["warmed"]
        print("seconds (plain, warmed):", out["seconds"], "warm-up:", warmed["warmup_s"])
        assert warmed["losses"] == plain["losses"], (plain["losses"], warmed["losses"])
        assert len(set(plain["losses"])) > 1  # it trains
        assert warmed["snapshot_bytes"] > 0
        assert warmed["compile_cache"] in ("miss", "hit")
        # The fast batch (model order) differs from the pipeline's: named, not silent.
        assert "expected 'f0', got 'f3'" in warmed["schema_check"], warmed["schema_check"]


def _precompiled_runs(cache_dir: str) -> dict[str, Any]:
    from examples.dlrm_trainer import TrainerConfig, train

    common: dict[str, Any] = {"steps": 4, "backend": "aot_eager", "compile_cache": cache_dir}
    plain = train(TrainerConfig(warmup=False, **common))
    first = train(TrainerConfig(precompile=True, **common))  # compiles ahead of time, saves
    restart = train(TrainerConfig(precompile=True, **common))  # loads: no Dynamo trace
    return {"plain": plain, "first": first, "restart": restart}


def test_example_trainer_precompiled_restart_trains_the_same(tmp_path: Any) -> None:
    # The run that wrote the precompiled targets and the restart that loads them train the
    # same losses, bit for bit, and the same as a run that compiles nothing ahead.
    for out in run_ranks(_precompiled_runs, 2, args=(str(tmp_path),), timeout=420):
        plain, first, restart = out["plain"], out["first"], out["restart"]
        assert first["losses"] == plain["losses"], (plain["losses"], first["losses"])
        assert restart["losses"] == first["losses"], (first["losses"], restart["losses"])
        assert set(first["precompiled"].values()) <= {"compiled", "unsupported"}, first
        assert "compiled" in first["precompiled"].values(), first
        served = [p for p, s in restart["precompiled"].items() if s == "hit"]
        assert served == [p for p, s in first["precompiled"].items() if s == "compiled"], restart
        assert restart["compile_cache"] == "hit"
