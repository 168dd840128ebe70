"""Effective Training Time (ETT%): what seconds of start-up are worth over a day of training.

ETT% = 100% − idle% − failure%: the share of wall time that advances the model. Over a day of
``D`` seconds with ``f`` failures, start-up ``S`` (time to first batch), recovery ``R`` (the
checkpoint load and anything else a restart pays on top of start-up), a checkpoint every ``I``
seconds of training loop that blocks it ``B`` seconds:

* restarts: ``f × (S + R)`` seconds out of the loop, and ``S`` once for the launch itself
  (``initial_starts`` per day, default 0: a long job amortises its first launch);
* loop time ``L = D − f × (S + R) − initial_starts × S``;
* unsaved work lost to failures: ``f × I / 2`` (on average half an interval since the last
  checkpoint);
* checkpoint blocking: ``L / I × B``;
* ETT% = 100 × (L − f × I / 2 − L / I × B) / D.

The interval minimising the loss is Young's: ``I* = sqrt(2 × L × B / f)``.

Example::

    profile = JobProfile(time_to_start_s=300, time_to_recover_s=120, failures_per_day=3,
                         checkpoint_blocking_s=30)
    print(ett(profile).ett_pct, optimal_interval(profile))
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["JobProfile", "EttBreakdown", "ett", "optimal_interval", "ett_points_saved"]

DAY_S = 86_400.0


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class JobProfile:
    """A training job's reliability profile."""

    time_to_start_s: float
    """Launch (or restart) to the first batch consumed."""
    time_to_recover_s: float = 0.0
    """Extra per restart: checkpoint load, replaying the data loader, ..."""
    failures_per_day: float = 3.0
    """Interruptions per day that need a restart."""
    checkpoint_interval_s: float | None = None
    """Training-loop seconds between checkpoints; None: the optimal interval."""
    checkpoint_blocking_s: float = 30.0
    """Seconds each checkpoint blocks the training loop."""
    initial_starts: float = 0.0
    """Launches per day besides the restarts (1 for a one-day job, 0 for a long one)."""
    day_s: float = DAY_S
    """Length of the accounting period."""

    def __post_init__(self) -> None:
        for name in (
            "time_to_start_s",
            "time_to_recover_s",
            "failures_per_day",
            "checkpoint_blocking_s",
            "initial_starts",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.checkpoint_interval_s is not None and self.checkpoint_interval_s <= 0:
            raise ValueError("checkpoint_interval_s must be positive")
        if self.day_s <= 0:
            raise ValueError("day_s must be positive")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class EttBreakdown:
    """Where a day went, in seconds, and the ETT%."""

    interval_s: float
    """The checkpoint interval used (inf: no checkpoints needed)."""
    restart_s: float
    """Start-up and recovery, all restarts (and initial launches) together."""
    unsaved_s: float
    """Work lost since the last checkpoint, all failures together."""
    blocking_s: float
    """Checkpoint blocking."""
    productive_s: float
    """What is left: training that counts."""
    ett_pct: float
    """100 × productive / day."""


def _loop_s(p: JobProfile) -> float:
    restarts = p.failures_per_day * (p.time_to_start_s + p.time_to_recover_s)
    return max(0.0, p.day_s - restarts - p.initial_starts * p.time_to_start_s)


def optimal_interval(p: JobProfile) -> float:
    """Young's interval ``sqrt(2 × L × B / f)`` (inf when nothing fails or nothing blocks)."""
    if p.failures_per_day == 0:
        return math.inf
    if p.checkpoint_blocking_s == 0:
        return 0.0
    return math.sqrt(2.0 * _loop_s(p) * p.checkpoint_blocking_s / p.failures_per_day)


def ett(p: JobProfile) -> EttBreakdown:
    """The day's breakdown at ``p.checkpoint_interval_s`` (or the optimal interval)."""
    interval = p.checkpoint_interval_s or optimal_interval(p)
    loop = _loop_s(p)
    restart = p.day_s - loop
    if math.isinf(interval) or interval == 0.0:
        unsaved = blocking = 0.0
    else:
        unsaved = p.failures_per_day * interval / 2.0
        blocking = loop / interval * p.checkpoint_blocking_s
    productive = max(0.0, loop - unsaved - blocking)
    return EttBreakdown(
        interval_s=interval,
        restart_s=restart,
        unsaved_s=unsaved,
        blocking_s=blocking,
        productive_s=productive,
        ett_pct=100.0 * productive / p.day_s,
    )


def ett_points_saved(p: JobProfile, stock_start_s: float, fastinit_start_s: float) -> float:
    """ETT percentage points gained by starting in ``fastinit_start_s`` instead of
    ``stock_start_s``, everything else in ``p`` equal (each at its own optimal interval when
    ``p.checkpoint_interval_s`` is None)."""
    stock = ett(dataclasses.replace(p, time_to_start_s=stock_start_s))
    fast = ett(dataclasses.replace(p, time_to_start_s=fastinit_start_s))
    return fast.ett_pct - stock.ett_pct
