"""Sharding: building the sharded modules: sharders, local shard metadata, per-shard answers from
layout rules, TorchRec's kernels subclassed, and the ported construction code (``mirror/``).

The plan (its layouts, fingerprint, codec, cache and checks) is :mod:`fastinit.plan`; the planner
is :mod:`fastinit.planner`.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

if TYPE_CHECKING:
    from fastinit.sharding.sharders import (
        FastEmbeddingBagCollectionSharder,
        FastEmbeddingCollectionSharder,
        fast_sharders,
    )

__all__ = [
    "FastEmbeddingBagCollectionSharder",
    "FastEmbeddingCollectionSharder",
    "fast_sharders",
]

_EXPORTS = {
    "FastEmbeddingBagCollectionSharder": ".sharders",
    "FastEmbeddingCollectionSharder": ".sharders",
    "fast_sharders": ".sharders",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
