"""The plan's life apart from building the sharded modules: fingerprint, codec, cache, checks.

* :func:`planner_fingerprint` (``fingerprint``): the digest of what decides a plan, the cache key
  and what every rank compares; ``provenance``: what a cache entry was planned for, so a miss can
  say which input differs.
* :func:`encode_plan`, :func:`decode_plan`, :func:`plan_digest` (``codec``): the versioned,
  pickle-free encoding the start-up protocol broadcasts and the cache stores.
* :class:`PlanCache`, :class:`TorchRecPlanCache`, :func:`as_plan_cache` (``cache``): plans on disk
  by fingerprint, and TorchRec 1.9's ``PlanCache`` protocol both ways.
* :func:`validate_plan` (``validate``): a plan checked against the module and the world before
  TorchRec is handed it (a cached plan is a hint, never an authority).

The planner itself is :class:`fastinit.planner.FastPlanner`. Nothing heavy is imported here: the
names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

if TYPE_CHECKING:
    from fastinit.errors import FastinitCacheWarning, PlanDecodeError
    from fastinit.plan.cache import PlanCache, TorchRecPlanCache, as_plan_cache
    from fastinit.plan.codec import decode_plan, encode_plan, plan_digest
    from fastinit.plan.fingerprint import planner_fingerprint
    from fastinit.plan.validate import validate_plan

__all__ = [
    "FastinitCacheWarning",
    "PlanCache",
    "PlanDecodeError",
    "TorchRecPlanCache",
    "as_plan_cache",
    "decode_plan",
    "encode_plan",
    "plan_digest",
    "planner_fingerprint",
    "validate_plan",
]

_EXPORTS = {
    "FastinitCacheWarning": "fastinit.errors",
    "PlanCache": ".cache",
    "TorchRecPlanCache": ".cache",
    "as_plan_cache": ".cache",
    "PlanDecodeError": "fastinit.errors",
    "decode_plan": ".codec",
    "encode_plan": ".codec",
    "plan_digest": ".codec",
    "planner_fingerprint": ".fingerprint",
    "validate_plan": ".validate",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
