"""Sharding: plan fingerprint, codec, cache, broadcast; local shard metadata; sharders; planner.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.sharding.cache import FastinitCacheWarning, PlanCache
    from fastinit.sharding.codec import PlanDecodeError, decode_plan, encode_plan, plan_digest
    from fastinit.sharding.fingerprint import planner_fingerprint
    from fastinit.sharding.planner import FastPlanner
    from fastinit.sharding.sharders import (
        FastEmbeddingBagCollectionSharder,
        FastEmbeddingCollectionSharder,
        fast_sharders,
    )

# public name -> module that defines it (add exports here)
_LAZY: dict[str, str] = {
    "FastPlanner": "fastinit.sharding.planner",
    "encode_plan": "fastinit.sharding.codec",
    "decode_plan": "fastinit.sharding.codec",
    "plan_digest": "fastinit.sharding.codec",
    "PlanDecodeError": "fastinit.sharding.codec",
    "planner_fingerprint": "fastinit.sharding.fingerprint",
    "PlanCache": "fastinit.sharding.cache",
    "FastinitCacheWarning": "fastinit.sharding.cache",
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
