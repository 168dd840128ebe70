"""How often to checkpoint: the interval that minimises the work a failure loses plus the time
checkpoints block the training loop (Young's formula, with Daly's higher-order estimate beside it).

Over ``L`` seconds of training loop with a mean time between failures ``M`` (``f = L / M``
failures), checkpoints every ``I`` seconds, each blocking the loop ``B`` seconds:

* unsaved work lost: ``f × I / 2`` (a failure comes on average half an interval after the last
  checkpoint);
* blocking: ``L / I × B``.

Their sum is least at ``I* = sqrt(2 × L × B / f) = sqrt(2 × B × M)`` (J. W. Young, *A first order
approximation to the optimum checkpoint interval*, CACM 1974), where the two costs are equal.
Daly's higher-order estimate (*A higher order estimate of the optimum checkpoint interval for
restart dumps*, FGCS 2006) is ``sqrt(2BM) × (1 + sqrt(B / 2M) / 3 + B / 18M) − B`` for ``B < 2M``,
else ``M``; the two agree while ``B ≪ M``.

Example::

    choice = choose_interval(blocking_s=2.5, mtbf_s=7.9 * 3600)
    print(choice.interval_s, format_choice(choice))
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "IntervalChoice",
    "young_interval",
    "daly_interval",
    "interval_cost",
    "choose_interval",
    "format_choice",
]

DAY_S = 86_400.0

#: The formula, as the command and the benchmark's report print it.
FORMULA = "I* = sqrt(2 × blocking × MTBF)"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class IntervalChoice:
    """The optimal interval and what checkpointing at it costs over ``loop_s``."""

    blocking_s: float
    """Seconds one checkpoint blocks the training loop."""
    mtbf_s: float
    """Mean time between failures of the job, seconds."""
    loop_s: float
    """Training-loop seconds the costs are totalled over."""
    interval_s: float
    """Young's optimal interval, seconds of training loop between checkpoints."""
    daly_interval_s: float
    """Daly's higher-order estimate (for comparison)."""
    failures: float
    """Expected failures over ``loop_s``."""
    unsaved_s: float
    """Work lost to failures at ``interval_s``, over ``loop_s``."""
    blocking_total_s: float
    """Checkpoint blocking at ``interval_s``, over ``loop_s``."""
    step_s: float | None = None
    """Seconds per training step, when given (the interval in steps follows)."""

    @property
    def overhead_s(self) -> float:
        """Unsaved plus blocking."""
        return self.unsaved_s + self.blocking_total_s

    @property
    def overhead_pct(self) -> float:
        """The overhead as a share of the loop, percent."""
        return 100.0 * self.overhead_s / self.loop_s

    @property
    def interval_steps(self) -> int | None:
        """The interval in whole training steps (at least 1), when ``step_s`` is known."""
        if self.step_s is None or math.isinf(self.interval_s):
            return None
        return max(1, round(self.interval_s / self.step_s))


def _check(blocking_s: float, mtbf_s: float) -> None:
    if not (blocking_s >= 0 and math.isfinite(blocking_s)):
        raise ValueError(f"blocking time must be a finite number >= 0, got {blocking_s}")
    if not mtbf_s > 0:
        raise ValueError(f"the mean time between failures must be > 0, got {mtbf_s}")


def young_interval(blocking_s: float, mtbf_s: float) -> float:
    """``sqrt(2 × blocking × MTBF)`` seconds (inf when nothing ever fails)."""
    _check(blocking_s, mtbf_s)
    if math.isinf(mtbf_s):
        return math.inf
    return math.sqrt(2.0 * blocking_s * mtbf_s)


def daly_interval(blocking_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: ``sqrt(2BM)(1 + sqrt(B/2M)/3 + B/18M) − B`` for ``B < 2M``,
    else ``M``."""
    _check(blocking_s, mtbf_s)
    if math.isinf(mtbf_s):
        return math.inf
    b, m = blocking_s, mtbf_s
    if b >= 2.0 * m:
        return m
    return math.sqrt(2.0 * b * m) * (1.0 + math.sqrt(b / (2.0 * m)) / 3.0 + b / (18.0 * m)) - b


def interval_cost(
    interval_s: float, blocking_s: float, mtbf_s: float, loop_s: float = DAY_S
) -> tuple[float, float]:
    """``(unsaved, blocking)`` seconds over ``loop_s`` when checkpointing every ``interval_s``:
    ``loop / MTBF × interval / 2`` and ``loop / interval × blocking``."""
    _check(blocking_s, mtbf_s)
    if not interval_s > 0:
        raise ValueError(f"the interval must be > 0, got {interval_s}")
    failures = loop_s / mtbf_s
    unsaved = 0.0 if failures == 0 else failures * interval_s / 2.0
    blocking = 0.0 if math.isinf(interval_s) else loop_s / interval_s * blocking_s
    return unsaved, blocking


def choose_interval(
    blocking_s: float, mtbf_s: float, loop_s: float = DAY_S, step_s: float | None = None
) -> IntervalChoice:
    """The interval minimising unsaved work plus blocking, and its costs over ``loop_s``.

    Args:
        blocking_s: seconds one checkpoint blocks the training loop (measured: the time the
            loop waits in ``save``, not the background write).
        mtbf_s: the job's mean time between failures, seconds.
        loop_s: training-loop seconds to total the costs over (default: a day).
        step_s: seconds per training step, to give the interval in steps too.

    Raises:
        ValueError: a negative blocking time, a non-positive MTBF, loop or step time.
    """
    _check(blocking_s, mtbf_s)
    if not loop_s > 0:
        raise ValueError(f"the loop time must be > 0, got {loop_s}")
    if step_s is not None and not step_s > 0:
        raise ValueError(f"the step time must be > 0, got {step_s}")
    interval = young_interval(blocking_s, mtbf_s)
    if interval == 0.0:  # checkpoints are free: no work need ever be lost
        unsaved = blocking = 0.0
    else:
        unsaved, blocking = interval_cost(interval, blocking_s, mtbf_s, loop_s)
    return IntervalChoice(
        blocking_s=blocking_s,
        mtbf_s=mtbf_s,
        loop_s=loop_s,
        interval_s=interval,
        daly_interval_s=daly_interval(blocking_s, mtbf_s),
        failures=loop_s / mtbf_s,
        unsaved_s=unsaved,
        blocking_total_s=blocking,
        step_s=step_s,
    )


def _dur(s: float) -> str:
    if math.isinf(s):
        return "never"
    if s >= 3600:
        return f"{s:,.0f} s ({s / 3600:.2f} h)"
    if s >= 60:
        return f"{s:,.0f} s ({s / 60:.1f} min)"
    return f"{s:.2f} s"


def format_choice(c: IntervalChoice) -> str:
    """The choice as text, the formula with the numbers put in."""
    lines = [
        "checkpoint interval minimising unsaved work + blocking (Young):",
        f"  {FORMULA} = sqrt(2 × {c.blocking_s:g} s × {c.mtbf_s:,.0f} s) = {_dur(c.interval_s)}",
    ]
    if c.interval_s == 0.0:
        lines.append("  a checkpoint blocks for nothing: checkpoint as often as the writes allow")
    elif not math.isinf(c.interval_s):
        lines.append(
            f"  over {c.loop_s:,.0f} s of training loop: {c.failures:.2f} failures × I*/2 = "
            f"{c.unsaved_s:,.0f} s unsaved + {c.loop_s:,.0f} s / I* × {c.blocking_s:g} s = "
            f"{c.blocking_total_s:,.0f} s blocking = {c.overhead_s:,.0f} s "
            f"({c.overhead_pct:.2f} % of the loop)"
        )
        lines.append(f"  Daly's higher-order estimate: {_dur(c.daly_interval_s)}")
    if c.interval_steps is not None:
        lines.append(f"  at {c.step_s:g} s per step: every {c.interval_steps:,} steps")
    return "\n".join(lines)
