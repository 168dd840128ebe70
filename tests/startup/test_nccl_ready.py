"""nccl2-ready: every ``init_process_group`` made on CUDA passes ``device_id``.

torch 2.15's ``nccl`` backend (nccl2) needs each rank's device when the group is created. No GPU
here, so this is a source scan of everything fastinit ships (package, example, benchmarks,
scripts, docs, README) plus mock-level checks of the calls that pick the backend at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("fastinit", "examples", "benchmarks", "scripts", "docs", "README.md")
#: backends that never touch CUDA: a call with one of these as a literal needs no device.
CPU_ONLY = {"gloo", "fake", "fakestate"}
_CALL = re.compile(r"init_process_group\(")


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
        else:
            out.extend(p for p in sorted(path.rglob("*")) if p.suffix in (".py", ".md", ".sh"))
    return out


def _call_text(text: str, start: int) -> str:
    """The argument text of the call whose ``(`` is at ``start`` (balanced parentheses)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return text[start + 1 :]


def _constants(path: Path, text: str) -> dict[str, object]:
    """Module-level ``NAME = <literal>`` bindings of a .py file (a backend named by a constant)."""
    if path.suffix != ".py":
        return {}
    out: dict[str, object] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                out[target.id] = node.value.value
    return out


def _needs_device_id(args: str, constants: dict[str, object] | None = None) -> bool:
    """A call (code in a .py file, or in a docstring or Markdown example) that may create a CUDA
    group: anything but a CPU-only backend (a literal, or a module constant bound to one) or a
    bare mention ``init_process_group()``."""
    args = " ".join(args.split())
    first_name = args.split(",")[0].strip()
    if constants and constants.get(first_name) in CPU_ONLY:
        return False
    if re.fullmatch(r"(\w+=\.\.\.(, )?)*|\.\.\.", args):  # prose: "init_process_group(timeout=...)"
        return False
    first = args.split(",")[0].strip()
    try:
        backend = ast.literal_eval(first)
    except (ValueError, SyntaxError):
        return True  # a variable backend: it may be nccl
    return not (isinstance(backend, str) and backend in CPU_ONLY)


def test_every_cuda_init_process_group_passes_device_id() -> None:
    offenders: list[str] = []
    seen = 0
    for path in _files():
        text = path.read_text()
        constants = _constants(path, text)
        for m in _CALL.finditer(text):
            seen += 1
            args = _call_text(text, m.end() - 1)
            if _needs_device_id(args, constants) and "device_id" not in args:
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}: init_process_group({args})")
    assert seen > 10, "the scan found almost no calls: is it looking in the right place?"
    assert not offenders, "init_process_group on CUDA without device_id:\n" + "\n".join(offenders)


def test_scan_catches_a_call_without_device_id() -> None:
    assert _needs_device_id('"nccl"')
    assert _needs_device_id("backend, store=store")
    assert _needs_device_id('"cpu:gloo,cuda:nccl", store=s')
    assert not _needs_device_id('"gloo", store=store, rank=0, world_size=1')
    assert not _needs_device_id("")
    assert not _needs_device_id("timeout=...")
    assert _needs_device_id("store=store, rank=0, world_size=1")  # default backend: nccl on CUDA


class _Recorder:
    """Stands in for ``dist.init_process_group``: records the call, then (optionally) makes a real
    gloo world of one so the caller's follow-up (``GroupMember.WORLD``) works."""

    def __init__(self, really: bool) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._really = really
        self._init = dist.init_process_group

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))
        if self._really:
            self._init("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.mark.parametrize(
    ("device", "current", "expected"),
    [
        (torch.device("cuda", 1), 0, torch.device("cuda", 1)),
        (torch.device("cuda"), 3, torch.device("cuda", 3)),
        (torch.device("cpu"), 0, None),
    ],
)
def test_setup_world_of_one_binds_its_cuda_device(
    device: torch.device, current: int, expected: torch.device | None, monkeypatch: Any
) -> None:
    from fastinit import startup

    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    recorder = _Recorder(really=True)
    monkeypatch.setattr(dist, "init_process_group", recorder)
    try:
        startup._ensure_process_group(device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    ((args, kwargs),) = recorder.calls
    assert args[0] == ("nccl" if device.type == "cuda" else "gloo")
    assert kwargs["device_id"] == expected


def test_example_trainer_binds_its_cuda_device(monkeypatch: Any) -> None:
    from examples.dlrm_trainer import Trainer, TrainerConfig

    recorder = _Recorder(really=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", recorder)
    trainer = Trainer(TrainerConfig())
    trainer.process_group_init(torch.device("cuda", 2))
    trainer.process_group_init(torch.device("cpu"))
    (nccl_args, nccl_kwargs), (gloo_args, gloo_kwargs) = recorder.calls
    assert nccl_args == ("nccl",) and nccl_kwargs == {"device_id": torch.device("cuda", 2)}
    assert gloo_args == ("gloo",) and gloo_kwargs.get("device_id") is None


def test_harness_binds_nccl_ranks_to_their_local_device() -> None:
    from fastinit.testing import dist as harness

    def job(backend: str, rank: int) -> Any:
        return harness._Job(
            fn_ref=("m", "f"),
            args=(),
            kwargs={},
            rank=rank,
            world_size=4,
            local_world_size=2,
            port=0,
            backend=backend,
            init_pg=True,
            trace=False,
            pg_timeout_s=1.0,
            env={},
            log_path="",
        )

    assert harness._device_id(job("nccl", 3)) == torch.device("cuda", 1)
    assert harness._device_id(job("cpu:gloo,cuda:nccl", 2)) == torch.device("cuda", 0)
    assert harness._device_id(job("gloo", 3)) is None
