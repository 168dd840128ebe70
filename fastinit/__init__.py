"""fastinit: the same TorchRec sharded model, with near-zero start-up communication.

``import fastinit`` is cheap: torch and torchrec load when a function that needs them is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

__version__ = "0.1.0"
if TYPE_CHECKING:
    from fastinit import errors, knobs, trace
    from fastinit.errors import (
        FastinitError,
        FastinitWarning,
        PlanMismatchError,
        StartupError,
        StartupMismatchError,
    )
    from fastinit.pg.rendezvous import init_process_group
    from fastinit.startup import setup
    from fastinit.tables import init_tables, pending_tables

__all__ = [
    "__version__",
    "setup",
    "init_tables",
    "pending_tables",
    "init_process_group",
    "StartupError",
    "StartupMismatchError",
    "PlanMismatchError",
    "FastinitError",
    "FastinitWarning",
    "errors",
    "trace",
    "knobs",
]

_EXPORTS = {
    "errors": ".errors",
    "knobs": ".knobs",
    "trace": ".trace",
    "FastinitError": ".errors",
    "FastinitWarning": ".errors",
    "PlanMismatchError": ".errors",
    "StartupError": ".errors",
    "StartupMismatchError": ".errors",
    "init_process_group": ".pg.rendezvous",
    "setup": ".startup",
    "init_tables": ".tables",
    "pending_tables": ".tables",
    "testing": ".testing",
    "plan": ".plan",
    "planner": ".planner",
    "sharding": ".sharding",
    "pg": ".pg",
    "warmup": ".warmup",
    "checkpoint": ".checkpoint",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
