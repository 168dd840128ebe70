"""fastinit's exceptions, in one place (importable without torch)."""

from __future__ import annotations

__all__ = ["CompatibilityError", "StartupError", "StartupMismatchError", "PlanMismatchError"]


class StartupError(RuntimeError):
    """fastinit's start-up failed on some rank; raised on every rank with the same message."""


class StartupMismatchError(StartupError):
    """Ranks disagree on what they are setting up (planner inputs or an explicit plan)."""


class PlanMismatchError(StartupError):
    """The plan does not fit the module (a missing module or table, or the wrong shape)."""


class CompatibilityError(RuntimeError):
    """The installed torch or TorchRec lacks something fastinit relies on (named in the message)."""
