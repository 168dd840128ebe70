"""Sharding: the planner; local shard metadata; sharders; layouts as rules; TorchRec's kernels.

The plan's fingerprint, codec, cache and checks are in :mod:`fastinit.plan`; their names below
(``encode_plan``, ``PlanCache``, ...) are still exported here, as before.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.plan.cache import FastinitCacheWarning, PlanCache
    from fastinit.plan.codec import PlanDecodeError, decode_plan, encode_plan, plan_digest
    from fastinit.plan.fingerprint import planner_fingerprint
    from fastinit.sharding.planner import FastPlanner
    from fastinit.sharding.sharders import (
        FastEmbeddingBagCollectionSharder,
        FastEmbeddingCollectionSharder,
        fast_sharders,
    )

# public name -> module that defines it (add exports here)
_LAZY: dict[str, str] = {
    "FastPlanner": "fastinit.sharding.planner",
    "encode_plan": "fastinit.plan.codec",
    "decode_plan": "fastinit.plan.codec",
    "plan_digest": "fastinit.plan.codec",
    "PlanDecodeError": "fastinit.plan.codec",
    "planner_fingerprint": "fastinit.plan.fingerprint",
    "PlanCache": "fastinit.plan.cache",
    "FastinitCacheWarning": "fastinit.plan.cache",
    "FastEmbeddingBagCollectionSharder": "fastinit.sharding.sharders",
    "FastEmbeddingCollectionSharder": "fastinit.sharding.sharders",
    "fast_sharders": "fastinit.sharding.sharders",
}

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "FastPlanner",
    "FastinitCacheWarning",
    "PlanCache",
    "PlanDecodeError",
    "decode_plan",
    "encode_plan",
    "fast_sharders",
    "plan_digest",
    "planner_fingerprint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
