"""Inject failures at fastinit's named points: "rank 1's disk is full at the commit marker".

Production code marks points with :func:`fastinit._faults.point`; this module installs what
happens there, for a test (or a benchmark's fault scenario), and removes it afterwards::

    from fastinit.testing.faults import inject

    with inject("checkpoint.marker", "oserror", ranks=[0]):   # ENOSPC at rank 0's marker
        handle = checkpoint.save(path, model, optimizers)
        handle.wait()                                           # raises on every rank

The checkpoint writer process receives the actions installed in its trainer with each job, so a
point inside the writer fails there too.

Points (``POINTS``): where each is, and what a failure there stands for.
"""

from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterable, Iterator

from fastinit._faults import Action, clear, install

__all__ = ["inject", "POINTS", "Action"]

#: Every named point, and what it is.
POINTS: dict[str, str] = {
    "checkpoint.shm_alloc": "allocating a staging buffer in /dev/shm (a full /dev/shm)",
    "checkpoint.handoff": "in save, after the staging copy, before the writer gets the job (a "
    "trainer dying before its save returned)",
    "checkpoint.write": "in the writer, before a part's data is written (a full disk, a stalled "
    "or dying writer)",
    "checkpoint.index": "in rank 0's writer, before the index is written",
    "checkpoint.marker": "rank 0 creating the commit marker (a full disk at the marker)",
}


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
