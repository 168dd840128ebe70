"""Restarts that skip the imports: a per-rank zygote forks the restarted worker.

    torchrun --nproc-per-node 8 --max-restarts 3 -m fastinit.restart train.py --lr 0.1
    torchrun --nproc-per-node 8 --max-restarts 3 -m fastinit.restart -m mypkg.train --lr 0.1

When torchrun restarts its workers after a failure, each new worker starts a Python interpreter
and imports torch and TorchRec again: about 3 s of every restart on a CPU host, the same
3 s it paid at launch. Launched through ``python -m fastinit.restart`` instead, the first worker
of each local rank imports the preload modules (``FASTINIT_RESTART_PRELOAD``: torch and
TorchRec), forks a *zygote* — a copy of itself that has run nothing else, waiting on a private
Unix socket — and then runs the script. A restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0)
asks its local rank's zygote instead: the zygote forks a process that takes the worker's
environment, working directory, standard streams, arguments and fresh random seeds, and runs the
script, with torch already imported. The launched process stays as a thin proxy that torchrun
watches: it passes signals on and exits as the forked worker exits.

What makes this safe and what it costs: ``docs/restarts.md``, "Restarts without the imports".
"""

from __future__ import annotations

import os

__all__ = ["launcher_pid", "served"]

_LAUNCHER: list[int] = []


def launcher_pid() -> int:
    """The process that launched this worker (torchrun's agent under torchrun).

    ``os.getppid()``, except in a worker a zygote forked: its parent is the zygote's helper,
    and the agent is the parent of the proxy process torchrun started.
    """
    return _LAUNCHER[0] if _LAUNCHER else os.getppid()


def served() -> bool:
    """Whether this process is a worker a zygote forked (a restart that skipped the imports)."""
    return bool(_LAUNCHER)


def set_launcher(pid: int) -> None:
    """Record ``pid`` as this worker's launcher (called once, in a worker a zygote forked)."""
    _LAUNCHER[:] = [pid]
