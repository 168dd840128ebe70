"""``make gpu-check``'s runner (benchmarks/gpu_check/__main__.py), on a host without a GPU: every
step names a module that exists, a step's time limit and kept output hold, and without CUDA the
run stops before any step with a non-zero exit status."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest

from benchmarks.gpu_check import __main__ as gpu_check


def test_every_step_is_a_module_that_exists() -> None:
    modules = [step[0] for _, _, step in gpu_check.STEPS]
    assert modules == [
        "benchmarks.gpu_check.startup",
        "benchmarks.gpu_check.warmup",
        "benchmarks.gpu_check.ttfb",
        "benchmarks.checkpoint_blocking",
        "benchmarks.gpu_check.dense",
    ]
    assert {"benchmarks.gpu_check.dense"} == gpu_check.WITHOUT_TORCHREC
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    assert set(gpu_check.KEEP_STDOUT) <= set(modules)


def test_a_step_is_stopped_at_its_time_limit() -> None:
    start = time.monotonic()
    code = gpu_check._run(["timeit", "-n", "1", "import time; time.sleep(60)"], 1, None)
    assert code == 124
    assert time.monotonic() - start < 30


def test_a_kept_output_is_written(tmp_path: pathlib.Path) -> None:
    keep = tmp_path / "out.json"
    assert gpu_check._run(["json.tool", "--help"], 60, keep) == 0
    assert "json.tool" in keep.read_text()


def test_without_cuda_no_step_runs(tmp_path: pathlib.Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert done.returncode != 0
    assert "no CUDA device" in done.stderr
    assert "gpu-check 1/" not in done.stdout


@pytest.mark.timeout(600)
def test_the_checkpoint_step_runs_on_cpu(tmp_path: pathlib.Path) -> None:
    """make gpu-check's checkpoint step with ``--device cpu`` (and a small state, and a loose
    bound: a few-MB copy is all noise): every other flag as gpu-check passes it, its CPU parts
    run, and the loads are bit-equal."""
    (step,) = [
        step for _, _, step in gpu_check.STEPS if step[0] == "benchmarks.checkpoint_blocking"
    ]
    args = ["cpu" if a == "cuda" else a for a in step[1:]]
    assert "--device" in args and "--check" in args
    args += ["--rows", "2000", "--tables", "2", "--dim", "16", "--max-vs-warm", "1000"]
    done = subprocess.run(
        [sys.executable, "-m", step[0], *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and len(out["fastinit"]) == 3  # gpu-check's --saves 3
    assert all(r["mismatched"] == [] for r in out["load"].values())


@pytest.mark.timeout(300)
def test_the_dense_step_runs_on_cpu() -> None:
    """The step that needs no TorchRec, with ``--device cpu`` (a small model, a loose bound): it
    saves through the writer process, and both loads are bit-equal."""
    (step,) = [step for _, _, step in gpu_check.STEPS if step[0] == "benchmarks.gpu_check.dense"]
    done = subprocess.run(
        [sys.executable, "-m", *step, "--device", "cpu", "--mb", "16", "--max-vs-warm", "1000"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = json.loads(done.stdout)
    assert out["memory_load_equal"] and out["storage_load_equal"], out
    assert out["memory_load"]["bytes_read"] == 0 and out["storage_load"]["memory_bytes"] == 0
    assert len(out["blocking_s"]) == 3 and out["bytes"] > 16 * 2**20, out
