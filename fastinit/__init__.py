"""fastinit: the same TorchRec sharded model, with near-zero start-up communication.

``import fastinit`` is cheap: torch and torchrec load when a function that needs them is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "__version__",
    "setup",
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

_ERRORS = (
    "StartupError",
    "StartupMismatchError",
    "PlanMismatchError",
    "FastinitError",
    "FastinitWarning",
)
_MODULES = (
    "errors",
    "trace",
    "knobs",
    "testing",
    "plan",
    "planner",
    "sharding",
    "pg",
    "warmup",
    "checkpoint",
)


def __getattr__(name: str) -> Any:
    import importlib

    if name == "setup":
        from fastinit.startup import setup

        return setup
    if name == "init_process_group":
        from fastinit.pg.rendezvous import init_process_group

        return init_process_group
    if name in _ERRORS:
        from fastinit import errors

        return getattr(errors, name)
    if name in _MODULES:
        return importlib.import_module(f"fastinit.{name}")
    raise AttributeError(f"module 'fastinit' has no attribute {name!r}")
