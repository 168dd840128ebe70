"""Fault injection for the benchmark: SIGKILL one rank right after a given training step.

Driven by environment variables, so the trainer carries no fault flags of its own; the trainer
calls :func:`after_step` after every completed step, and nothing happens unless the variables
are set:

* ``FASTINIT_BENCH_KILL_RANK``: the rank to kill (unset: no fault; ``-1``: every rank, each
  right after the step, recording to ``<file>.rank<N>``: :data:`EVERY_RANK`);
* ``FASTINIT_BENCH_KILL_STEP``: after which step (1-based, the job's global step count);
* ``FASTINIT_BENCH_KILL_FILE``: where the killed rank records the moment of the kill (JSON:
  ``time``, ``rank``, ``step``, ``attempt``), written and fsync-ed just before the signal;
* ``FASTINIT_BENCH_KILL_ATTEMPT``: in which attempt of the job (torchrun's
  ``TORCHELASTIC_RESTART_COUNT``; default 0, so the restarted workers run on).

The kill is ``SIGKILL`` of the rank's own process: no handler, no teardown, no flush, as a host
or a process dying. torchrun's agent sees the worker gone, stops the others and, with
``--max-restarts`` left, restarts every worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Mapping

__all__ = ["ENV", "EVERY_RANK", "KillAt", "from_env", "after_step", "read_kill"]

#: ``KillAt.rank`` for every rank (each kills itself after the step; its record goes to
#: ``<record>.rank<N>``).
EVERY_RANK = -1

#: The variables, by role.
ENV = {
    "rank": "FASTINIT_BENCH_KILL_RANK",
    "step": "FASTINIT_BENCH_KILL_STEP",
    "file": "FASTINIT_BENCH_KILL_FILE",
    "attempt": "FASTINIT_BENCH_KILL_ATTEMPT",
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class KillAt:
    """Kill ``rank`` after ``step`` in ``attempt``; the kill's time goes to ``record``."""

    rank: int
    step: int
    record: str
    attempt: int = 0

    def env(self) -> dict[str, str]:
        """The environment variables that arm this fault."""
        return {
            ENV["rank"]: str(self.rank),
            ENV["step"]: str(self.step),
            ENV["file"]: self.record,
            ENV["attempt"]: str(self.attempt),
        }


def from_env(environ: Mapping[str, str] | None = None) -> KillAt | None:
    """The fault the environment arms, or None.

    Raises:
        ValueError: the variables are set but malformed (a fault silently not injected would
            pass for a clean run).
    """
    env = os.environ if environ is None else environ
    if ENV["rank"] not in env:
        return None
    try:
        return KillAt(
            rank=int(env[ENV["rank"]]),
            step=int(env[ENV["step"]]),
            record=env[ENV["file"]],
            attempt=int(env.get(ENV["attempt"], "0")),
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"fault injection: {', '.join(ENV.values())} malformed ({e})") from e


def after_step(step: int, rank: int, environ: Mapping[str, str] | None = None) -> None:
    """Called by the trainer after each completed step: kills this process if the fault the
    environment arms is for this rank, step and attempt."""
    env = os.environ if environ is None else environ
    fault = from_env(env)
    if fault is None or fault.rank not in (rank, EVERY_RANK) or fault.step != step:
        return
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt != fault.attempt:
        return
    record = {"time": time.time(), "rank": rank, "step": step, "attempt": attempt}
    path = fault.record if fault.rank != EVERY_RANK else f"{fault.record}.rank{rank}"
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    os.kill(os.getpid(), signal.SIGKILL)


def read_kill(path: str) -> dict[str, float]:
    """The record :func:`after_step` left (``time``, ``rank``, ``step``, ``attempt``)."""
    with open(path) as f:
        return dict(json.load(f))
