"""Named points where a test can inject a failure: the one seam for fault injection.

Production code marks a point with :func:`point` (``point("checkpoint.marker", rank=r)``): a
dictionary look-up that does nothing unless a test installed an action there through
:mod:`fastinit.testing.faults`. Actions raise an error, sleep, or end the process with
``os._exit`` / ``SIGKILL`` (a rank or a writer dying at that point). Installed actions are
plain data (:class:`Action`), so the checkpoint writer process receives the parent's actions in
its first message and honours them too. Nothing here reads the environment.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import threading
import time
from typing import Any

__all__ = ["Action", "point", "install", "installed", "clear"]


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """What happens when a point is reached.

    Attributes:
        kind: ``"oserror"`` (raise ``OSError(errno)``), ``"error"`` (raise ``RuntimeError``),
            ``"sleep"`` (sleep ``seconds``, then go on), ``"exit"`` (``os._exit(1)``) or
            ``"kill"`` (``SIGKILL`` to this process).
        ranks: the ranks it applies to (None: every rank).
        errno: the errno of ``"oserror"`` (default ``ENOSPC``: a full disk).
        seconds: how long ``"sleep"`` sleeps.
        times: how many times it fires (None: every time).
    """

    kind: str
    ranks: tuple[int, ...] | None = None
    errno: int = errno.ENOSPC
    seconds: float = 0.0
    times: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("oserror", "error", "sleep", "exit", "kill"):
            raise ValueError(f"unknown fault kind {self.kind!r}")


_lock = threading.Lock()
_actions: dict[str, Action] = {}
_fired: dict[str, int] = {}


def install(name: str, action: Action) -> None:
    """Install ``action`` at the point ``name`` (replacing any action there)."""
    with _lock:
        _actions[name] = action
        _fired.pop(name, None)


def installed() -> dict[str, Action]:
    """The installed actions (to hand to another process)."""
    with _lock:
        return dict(_actions)


def clear(name: str | None = None) -> None:
    """Remove the action at ``name`` (every action with None)."""
    with _lock:
        if name is None:
            _actions.clear()
            _fired.clear()
        else:
            _actions.pop(name, None)
            _fired.pop(name, None)


def point(name: str, *, rank: int | None = None, **context: Any) -> None:
    """A named point: runs the action a test installed here for ``rank``, else nothing."""
    if not _actions:
        return
    with _lock:
        action = _actions.get(name)
        if action is None or (action.ranks is not None and rank not in action.ranks):
            return
        count = _fired.get(name, 0)
        if action.times is not None and count >= action.times:
            return
        _fired[name] = count + 1
    where = f"{name} (rank {rank})" if rank is not None else name
    if action.kind == "oserror":
        raise OSError(action.errno, f"{os.strerror(action.errno)} (injected at {where})")
    if action.kind == "error":
        raise RuntimeError(f"fault injected at {where}")
    if action.kind == "sleep":
        time.sleep(action.seconds)
        return
    if action.kind == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)
