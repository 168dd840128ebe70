"""Inject failures at fastinit's named points: "rank 1's disk is full at the commit marker".

Production code marks points with :func:`fastinit._faults.point`; this module installs what
happens there, for a test (or a benchmark's fault scenario), and removes it afterwards::

    from fastinit.testing.faults import inject

    with inject("checkpoint.marker", "oserror", ranks=[0]):   # ENOSPC at rank 0's marker
        handle = checkpoint.save(path, model, optimizers)
        handle.wait()                                           # raises on every rank

    with inject("startup.verify", "exit", ranks=[1]):         # rank 1 dies before the digests
        fastinit.setup(module)                                  # StartupError on rank 0

The checkpoint writer process receives the actions installed in its trainer with each job, so a
point inside the writer fails there too.

Points (``POINTS``): where each is, and what a failure there stands for.
"""

from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterable, Iterator

from fastinit._faults import Action, clear, install

__all__ = ["inject", "POINTS", "STARTUP_POINTS", "Action"]

#: Every named point, and what it is.
POINTS: dict[str, str] = {
    "checkpoint.shm_alloc": "allocating a staging buffer in /dev/shm (a full /dev/shm)",
    "checkpoint.handoff": "in save, after the staging copy, before the writer gets the job (a "
    "trainer dying before its save returned)",
    "checkpoint.write": "in the writer, before a part's data is written (a full disk, a stalled "
    "or dying writer)",
    "checkpoint.index": "in rank 0's writer, before the index is written",
    "checkpoint.prefill": "in prepare's thread, after a staging buffer is filled, before the "
    "fill is recorded (a slow fill while the loop trains; a fill failing: copied whole later)",
    "checkpoint.marker": "rank 0 creating the commit marker (a full disk at the marker)",
    # fastinit.setup, one point at the start of each phase (fastinit/startup.py), in order
    "startup.prepare": "setup's prepare phase starts (a rank failing before its record is built)",
    "startup.plan": "inside prepare, before the plan is looked up or made (planning failing on "
    "a rank: the failure travels in its record)",
    "startup.exchange": "before the start-up record all_gather",
    "startup.agree_on_plan": "before the plan broadcast (or its skip)",
    "startup.materialize": "before the meta dense parameters are materialised",
    "startup.construct": "before the sharded model is constructed",
    "startup.verify": "before the replica digest all_reduce",
    "startup.init_data_parallel": "before DDP wraps the dense part (setup's last phase)",
}

#: The points of ``fastinit.setup``'s phases, in the order setup reaches them.
STARTUP_POINTS: tuple[str, ...] = tuple(p for p in POINTS if p.startswith("startup."))


@contextlib.contextmanager
def inject(
    point: str,
    kind: str = "oserror",
    *,
    ranks: Iterable[int] | None = None,
    errno: int = _errno.ENOSPC,
    seconds: float = 0.0,
    times: int | None = None,
) -> Iterator[None]:
    """Make ``point`` fail (or stall) on ``ranks`` while the block runs.

    Args:
        point: a name from :data:`POINTS`.
        kind: ``oserror`` (``OSError(errno)``), ``error`` (``RuntimeError``), ``sleep``
            (``seconds``), ``exit`` (``os._exit(1)``) or ``kill`` (``SIGKILL``).
        ranks: the ranks it applies to (None: every rank).
        errno: the errno of ``oserror`` (default ``ENOSPC``).
        seconds: how long ``sleep`` stalls.
        times: how many times it fires (None: every time).
    """
    if point not in POINTS:
        raise KeyError(f"unknown fault point {point!r}; known: {sorted(POINTS)}")
    install(point, Action(kind, None if ranks is None else tuple(ranks), errno, seconds, times))
    try:
        yield
    finally:
        clear(point)
