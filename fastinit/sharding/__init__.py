"""Sharding: the planner; local shard metadata; sharders; layouts as rules; TorchRec's kernels.

The plan's fingerprint, codec, cache and checks are in :mod:`fastinit.plan`.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.sharding.planner import FastPlanner
    from fastinit.sharding.sharders import (
        FastEmbeddingBagCollectionSharder,
        FastEmbeddingCollectionSharder,
        fast_sharders,
    )

# public name -> module that defines it (add exports here)
_LAZY: dict[str, str] = {
    "FastPlanner": "fastinit.sharding.planner",
    "FastEmbeddingBagCollectionSharder": "fastinit.sharding.sharders",
    "FastEmbeddingCollectionSharder": "fastinit.sharding.sharders",
    "fast_sharders": "fastinit.sharding.sharders",
}

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "FastPlanner",
    "fast_sharders",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
