"""fastinit's exceptions and warnings: one family, in one place (importable without torch).

Every exception fastinit raises to its caller derives from :class:`FastinitError` and keeps the
standard base it has always had (``except ValueError`` still catches a :class:`PlanDecodeError`);
every warning it issues derives from :class:`FastinitWarning`. The subsystem that raises a class
also exports it (``fastinit.checkpoint.CheckpointError`` is this module's class).

Example::

    try:
        model = fastinit.setup(module, env=env, device=device)
    except fastinit.FastinitError as e:  # any of fastinit's own failures
        ...
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FastinitError",
    "FastinitWarning",
    "StartupError",
    "StartupMismatchError",
    "PlanMismatchError",
    "CompatibilityError",
    "PlanDecodeError",
    "PlanEncodeError",
    "LayoutError",
    "PlanCacheError",
    "CheckpointError",
    "Taken",
    "PublishError",
    "NodeGroupError",
    "StageError",
    "BatchSchemaError",
    "CliError",
    "RanksFailed",
    "FreshProcessError",
    "FastinitCacheWarning",
    "ReplicaMismatchWarning",
    "TraceWarning",
    "RestartWarning",
]


class FastinitError(Exception):
    """The base of every exception fastinit raises to its caller."""


class FastinitWarning(Warning):
    """The base of every warning fastinit issues."""


# -- start-up (fastinit.setup) ---------------------------------------------------------------


class StartupError(FastinitError, RuntimeError):
    """fastinit's start-up failed on some rank; raised on every rank with the same message."""


class StartupMismatchError(StartupError):
    """Ranks disagree on what they are setting up (planner inputs or an explicit plan)."""


class PlanMismatchError(StartupError):
    """The plan does not fit the module (a missing module or table, or the wrong shape)."""


class CompatibilityError(FastinitError, RuntimeError):
    """The installed torch or TorchRec lacks something fastinit relies on (named in the message)."""


class ReplicaMismatchWarning(FastinitWarning, UserWarning):
    """Replicated values differed across ranks; rank 0's were broadcast (named in the message)."""


# -- the plan (fastinit.plan) ------------------------------------------------------------------


class PlanDecodeError(FastinitError, ValueError):
    """The bytes are not a plan this version of fastinit wrote (truncated, foreign, malformed)."""


class PlanEncodeError(FastinitError, TypeError):
    """The plan holds a value the codec cannot encode (a type outside its allowlist)."""


class LayoutError(FastinitError, ValueError):
    """Runs that do not describe a valid (or canonical) shard layout."""


class PlanCacheError(FastinitError, RuntimeError):
    """A plan cannot be stored ahead of the job: its key cannot be cached, an entry of the same key
    holds another plan, or the cache directory cannot be written."""


class FastinitCacheWarning(FastinitWarning, UserWarning):
    """A plan-cache entry was ignored, or the cache could not be written."""


# -- checkpoints (fastinit.checkpoint) ---------------------------------------------------------


class CheckpointError(FastinitError, RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked (torn, foreign, damaged, ...)."""


class Taken(CheckpointError):
    """The directory was committed by another save (another job, or another save of this one)."""


class PublishError(CheckpointError):
    """The checkpoint cannot be published: it does not fit the model, or the output is taken."""


# -- process groups (fastinit.pg) --------------------------------------------------------------


class NodeGroupError(FastinitError, RuntimeError):
    """A node group could not be created (typically: a member never joined within the timeout)."""


# -- warm-up (fastinit.warmup) -----------------------------------------------------------------


class StageError(FastinitError, RuntimeError):
    """A stage failed (or was never reached because a peer failed); chained to the cause.

    Attributes:
        stage: the stage that failed on this rank.
        rank: this rank.
        first_failure: ``(stage, rank)`` of the first failure published by any rank through the
            graph's store, when one was found (it may be another rank's).
    """

    def __init__(
        self, stage: str, rank: int, cause: BaseException, first_failure: tuple[str, int] | None
    ) -> None:
        message = f"start-up stage {stage!r} failed on rank {rank}: {type(cause).__name__}: {cause}"
        if first_failure is not None and first_failure != (stage, rank):
            message += f" (first failure: stage {first_failure[0]!r} on rank {first_failure[1]})"
        super().__init__(message)
        self.stage = stage
        self.rank = rank
        self.first_failure = first_failure


class BatchSchemaError(FastinitError, ValueError):
    """A batch does not have the schema the warm-up was built for."""


# -- tracing (fastinit.trace) ------------------------------------------------------------------


class TraceWarning(FastinitWarning, UserWarning):
    """A trace could not be written (the job goes on untraced); the message says where and why."""


# -- restarts (fastinit.restart) --------------------------------------------------------------


class RestartWarning(FastinitWarning, UserWarning):
    """A restart could not be forked by its zygote and starts a fresh interpreter instead; the
    message says why (the job goes on, only slower to come back)."""


# -- the command line (fastinit.cli) -----------------------------------------------------------


class CliError(FastinitError):
    """A mistake in what the command was given: printed as one line, exit status 2."""


# -- tests and benchmarks (fastinit.testing) ---------------------------------------------------


class RanksFailed(FastinitError, AssertionError):
    """One or more ranks failed, died or timed out; the message holds each rank's story.

    Attributes:
        results: every rank's :class:`fastinit.testing.dist.RankResult`.
    """

    def __init__(self, message: str, results: list[Any]):
        super().__init__(message)
        self.results = results


class FreshProcessError(FastinitError, RuntimeError):
    """A function run by :func:`fastinit.testing.dist.call_fresh` failed, printed no result or
    timed out."""
