"""Sharding: plan fingerprint, codec, cache, broadcast; local shard metadata; sharders; planner.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.sharding.planner import FastPlanner

# public name -> module that defines it (add exports here)
_LAZY: dict[str, str] = {
    "FastPlanner": "fastinit.sharding.planner",
}

__all__ = ["FastPlanner"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
