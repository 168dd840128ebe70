"""A checkpoint written on one supported stack loads on the other: torch 2.13 (TorchRec 1.8)
and torch 2.14.1 (TorchRec 1.9), both ways, with the same plan and resharded, and
``fastinit publish`` reads both.

Runs where both stacks' environments exist (the 1.9 lane of ``make test`` runs after the default
lane has built ``.venv``): the other stack runs in a subprocess of its own interpreter.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Any

import pytest
from test_checkpoint import PLAN_A, PLAN_B, _build, _diff, _local, _train

from fastinit.testing.dist import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _other_python() -> str | None:
    import torch

    venv = ".venv-1.9" if torch.__version__.startswith("2.13") else ".venv"
    path = ROOT / venv / "bin" / "python"
    return str(path) if path.exists() else None


def _save_rank(root: str, tag: str) -> str:
    import torch

    from fastinit import checkpoint

    model, opts = _build(PLAN_A, seed=4)
    _train(model, opts, seed=40)
    torch.save(_local(model, opts), f"{root}/{tag}-saved-rank{_rank()}.pt")
    checkpoint.save(f"{root}/{tag}", model, opts, blocking=True)
    return torch.__version__


def _load_rank(root: str, tag: str, resharded: bool, out: str) -> str:
    import torch

    from fastinit import checkpoint, knobs

    model, opts = _build(PLAN_B if resharded else PLAN_A, seed=99)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="off"):  # read the files the other stack wrote
        report = checkpoint.load(f"{root}/{tag}", model, opts)
    torch.save(_local(model, opts), f"{root}/{out}-rank{_rank()}.pt")
    return report.mode


def _publish(root: str, tag: str, out: str) -> None:
    """The unsharded model from the checkpoint (publish's loader), on a world of one."""
    import torch
    from test_checkpoint import SPEC

    from fastinit.checkpoint import load_unsharded
    from fastinit.testing.models import ModelSpec, build_model

    model = build_model(ModelSpec(**SPEC), device="cpu", seed=123)
    load_unsharded(f"{root}/{tag}", model)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{root}/{out}.pt")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _in_other_stack(python: str, fn: str, *args: Any) -> Any:
    code = (
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests' / 'checkpoint')!r}]\n"
        "import test_checkpoint_stacks as m\n"
        "from fastinit.testing.dist import run_ranks\n"
        f"fn, args = m.{fn}, {args!r}\n"
        "print(repr(fn(*args) if fn is m._publish else run_ranks(fn, 2, args=args, timeout=500)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=700, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return done.stdout.strip().splitlines()[-1]


def _same(root: str, a: str, b: str) -> list[str]:
    import torch

    bad = []
    for rank in range(2):
        x = torch.load(f"{root}/{a}-rank{rank}.pt", weights_only=False)
        y = torch.load(f"{root}/{b}-rank{rank}.pt", weights_only=False)
        bad += [f"rank {rank}: {k}" for k in _diff(x, y)]
    return bad


@pytest.mark.timeout(1500)
def test_a_checkpoint_crosses_the_two_stacks_both_ways(tmp_path: Any) -> None:
    import torch

    other = _other_python()
    if other is None:
        pytest.skip("the other stack's environment is not built (make env STACK=...)")
    root = str(tmp_path)
    # The other stack writes; it also loads its own checkpoint resharded (the reference).
    theirs = _in_other_stack(other, "_save_rank", root, "theirs")
    assert theirs.strip("[]'\" ").split("'")[0] != torch.__version__
    _in_other_stack(other, "_load_rank", root, "theirs", True, "theirs-b-there")
    modes = run_ranks(_load_rank, 2, args=(root, "theirs", False, "theirs-here"), timeout=500)
    assert modes == ["same-plan", "same-plan"]
    run_ranks(_load_rank, 2, args=(root, "theirs", True, "theirs-b-here"), timeout=500)
    assert _same(root, "theirs-saved", "theirs-here") == []
    assert _same(root, "theirs-b-there", "theirs-b-here") == []
    # This stack writes; the other loads it, same plan and resharded.
    run_ranks(_save_rank, 2, args=(root, "ours"), timeout=500)
    run_ranks(_load_rank, 2, args=(root, "ours", True, "ours-b-here"), timeout=500)
    _in_other_stack(other, "_load_rank", root, "ours", False, "ours-there")
    _in_other_stack(other, "_load_rank", root, "ours", True, "ours-b-there")
    assert _same(root, "ours-saved", "ours-there") == []
    assert _same(root, "ours-b-here", "ours-b-there") == []
    # fastinit publish's loader reads both checkpoints in both stacks, to the same model.
    for tag in ("theirs", "ours"):
        _publish(root, tag, f"{tag}-published-here")
        _in_other_stack(other, "_publish", root, tag, f"{tag}-published-there")
        here = torch.load(f"{root}/{tag}-published-here.pt", weights_only=False)
        there = torch.load(f"{root}/{tag}-published-there.pt", weights_only=False)
        assert sorted(here) == sorted(there)
        assert all(torch.equal(here[k], there[k]) for k in here), tag
