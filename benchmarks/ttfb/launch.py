"""Launching the benchmark's programs: the trainer (through the torchx component or torchrun)
and the floor (torchrun), on ``nproc`` ranks of this host, every address 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["RunSpec", "run_trainer", "run_floor", "trace_files", "kill_tree"]


@dataclasses.dataclass(kw_only=True, slots=True)
class RunSpec:
    """One launch."""

    mode: str
    """Trainer mode (:data:`benchmarks.ttfb.trainer.MODES`)."""
    model: str
    cache: str
    """Scenario label."""
    out: str
    """Trace directory of this run (emptied first)."""
    inductor_dir: str
    """``TORCHINDUCTOR_CACHE_DIR`` of the ranks."""
    cache_dir: str | None = None
    """The mode's shared storage (``--cache-dir``)."""
    nproc: int = 2
    data_dir: str = "bench-out/data"
    batch_size: int = 256
    compile: bool = True
    launcher: str = "torchx"
    """"torchx" (the component, local_cwd scheduler) or "torchrun"."""
    timeout_s: float = 1200.0
    steps: int = 1
    """Training steps in all."""
    checkpoint_dir: str | None = None
    """Checkpoints (resumed from when one is committed)."""
    checkpoint_step: int = 0
    """Save after this step (0: never)."""
    checkpoint_every: int = 0
    """Also save after every this many steps (0: never)."""
    checkpointer: str = "mode"
    """The mode's own checkpoints, or "torch-checkpointing"."""
    max_restarts: int = 0
    """torchrun's ``--max-restarts``."""
    store_per_round: bool = False
    """torch's workaround for restarts that read a dead attempt's keys,
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: worker rank 0 hosts a new store every rendezvous
    round instead of the agent's one store (stock modes only: ``fastinit.init_process_group``
    would fall back to torch's)."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment of the ranks (the fault injection's variables)."""
    trainer_args: tuple[str, ...] = ()
    """More arguments of ``benchmarks.ttfb.trainer`` (``--fastinit-parts setup``); the torchrun
    launcher only."""

    @classmethod
    def in_layout(cls, layout: Any, *, data_root: str, **fields: Any) -> RunSpec:
        """A launch on a mode's directories (``layout``: a
        :class:`~benchmarks.ttfb.scenarios.Layout`, its Inductor cache and shared storage) and
        the dataset under ``data_root``; ``fields`` as the class's."""
        return cls(
            inductor_dir=layout.inductor_dir,
            cache_dir=layout.cache_dir,
            data_dir=os.path.join(data_root, "data"),
            **fields,
        )

    def __post_init__(self) -> None:
        if self.trainer_args and self.launcher != "torchrun":
            raise ValueError("trainer_args need the torchrun launcher")
        if self.store_per_round and self.mode == "fastinit":
            raise ValueError("store_per_round is stock's workaround; fastinit mode makes its own")


def _env(spec: RunSpec) -> dict[str, str]:
    return {
        "TORCHINDUCTOR_CACHE_DIR": spec.inductor_dir,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONWARNINGS": "ignore",
        "LOGLEVEL": "WARNING",
        **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if spec.store_per_round else {}),
        **spec.env,
    }


def _torchrun(nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        *(["--max-restarts", str(max_restarts)] if max_restarts else []),
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--local-addr",
        "127.0.0.1",
    ]


def _path_env() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def trace_files(out: str) -> list[str]:
    """The per-rank trace files a run left in ``out``."""
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.startswith("trace-rank"))


def _fresh_out(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)


def _check(spec: RunSpec, ok: bool, detail: str, what: str) -> list[str]:
    paths = trace_files(spec.out)
    if not ok or len(paths) != spec.nproc:
        raise RuntimeError(
            f"{what} {spec.mode}/{spec.model}/{spec.cache} failed ({detail}); "
            f"{len(paths)} of {spec.nproc} trace files"
        )
    return paths


def run_trainer(spec: RunSpec) -> list[str]:
    """Launch :mod:`benchmarks.ttfb.trainer` once; returns its per-rank trace files.

    Raises:
        RuntimeError: the run failed or left fewer trace files than ranks.
    """
    from benchmarks.ttfb.components import trainer_args, trainer_entry, ttfb

    _fresh_out(spec.out)
    env = _path_env()
    if spec.launcher == "torchx":
        app = ttfb(
            mode=spec.mode,
            model=spec.model,
            cache=spec.cache,
            out=spec.out,
            cache_dir=spec.cache_dir,
            data_dir=spec.data_dir,
            nproc=spec.nproc,
            batch_size=spec.batch_size,
            no_compile=not spec.compile,
            steps=spec.steps,
            checkpoint_dir=spec.checkpoint_dir,
            checkpoint_step=spec.checkpoint_step,
            checkpoint_every=spec.checkpoint_every,
            checkpointer=spec.checkpointer,
            max_restarts=spec.max_restarts,
            env=_env(spec),
        )
        ok, detail = _run_torchx(app, spec, env)
    else:
        args = trainer_args(
            spec.mode,
            spec.model,
            spec.cache,
            spec.out,
            spec.cache_dir,
            spec.data_dir,
            spec.batch_size,
            1,
            not spec.compile,
            spec.steps,
            spec.checkpoint_dir,
            spec.checkpoint_step,
            spec.checkpoint_every,
            spec.checkpointer,
        )
        parts = "all" if not spec.trainer_args else "parts"  # the one-line change: no launcher
        entry = trainer_entry(spec.mode, parts)
        cmd = [*_torchrun(spec.nproc, spec.max_restarts), "-m", *entry, *args, *spec.trainer_args]
        ok, detail = _run(cmd, {**env, **_env(spec)}, spec)
    return _check(spec, ok, detail, "run")


def run_floor(spec: RunSpec, plan_file: str) -> list[str]:
    """Launch :mod:`benchmarks.ttfb.floor` once (torchrun); returns its per-rank trace files."""
    _fresh_out(spec.out)
    cmd = [
        *_torchrun(spec.nproc),
        "-m",
        "benchmarks.ttfb.floor",
        "--model",
        spec.model,
        "--plan",
        plan_file,
        "--cache",
        spec.cache,
        "--out",
        spec.out,
        "--data-dir",
        spec.data_dir,
        "--batch-size",
        str(spec.batch_size),
    ]
    if not spec.compile:
        cmd.append("--no-compile")
    ok, detail = _run(cmd, {**_path_env(), **_env(spec)}, spec)
    return _check(spec, ok, detail, "floor")


def _run(cmd: list[str], env: dict[str, str], spec: RunSpec) -> tuple[bool, str]:
    """Run ``cmd`` in a session of its own; on timeout, kill it and every process it started
    (torchrun starts each worker in a session of its own: a hung worker must not outlive its run)."""
    log = os.path.join(spec.out, "launch.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            return False, f"timed out after {spec.timeout_s:.0f}s; log {log}"
        except BaseException:  # interrupted (Ctrl-C, a test's timeout): nothing left running
            kill_tree(proc.pid)
            proc.wait()
            raise
    return code == 0, f"exit code {code}; log {log}"


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from ``/proc`` (none where it is missing)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` (a session leader this module started), its session and every descendant,
    whichever session they moved to. ``pid`` is stopped first, so it starts nothing meanwhile."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    for child in _descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _run_torchx(app: Any, spec: RunSpec, env: dict[str, str]) -> tuple[bool, str]:
    """Run the AppDef on torchx's local_cwd scheduler and wait for it."""
    from torchx.runner import get_runner

    log_dir = os.path.join(spec.out, "torchx")
    saved = dict(os.environ)
    os.environ["PATH"] = env["PATH"]  # the scheduler resolves torchrun through PATH
    try:
        with get_runner() as runner:
            handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": log_dir})
            deadline = time.monotonic() + spec.timeout_s
            status = None
            while time.monotonic() < deadline:
                status = runner.status(handle)
                if status is not None and status.is_terminal():
                    break
                time.sleep(0.2)
            else:
                runner.cancel(handle)
                return False, f"timed out after {spec.timeout_s:.0f}s; logs {log_dir}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    state = getattr(status, "state", None)
    return str(state).endswith("SUCCEEDED"), f"torchx state {state}; logs {log_dir}"
