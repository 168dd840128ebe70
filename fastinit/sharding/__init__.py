"""Sharding: building the sharded modules: sharders, local shard metadata, per-shard answers from
layout rules, TorchRec's kernels subclassed, and the ported construction code (``mirror/``).

The plan (its layouts, fingerprint, codec, cache and checks) is :mod:`fastinit.plan`; the planner
is :mod:`fastinit.planner`.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.sharding.sharders import (
        FastEmbeddingBagCollectionSharder,
        FastEmbeddingCollectionSharder,
        fast_sharders,
    )

# public name -> module that defines it (add exports here)
_LAZY: dict[str, str] = {
    "FastEmbeddingBagCollectionSharder": "fastinit.sharding.sharders",
    "FastEmbeddingCollectionSharder": "fastinit.sharding.sharders",
    "fast_sharders": "fastinit.sharding.sharders",
}

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "fast_sharders",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
