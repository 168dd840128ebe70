"""Checks that a sharding plan fits a module."""

from __future__ import annotations

from typing import Any

from torch import nn

from fastinit.errors import PlanMismatchError
from fastinit.sharding.layout import validate_compact

__all__ = ["validate_plan"]


def validate_plan(module: nn.Module, plan: Any, sharders: list[Any]) -> None:
    """Raise :class:`PlanMismatchError` unless every module plan names a shardable module of
    ``module`` and every table in it exists there with shards that tile its shape."""
    modules = dict(module.named_modules())
    by_type = {s.module_type: s for s in sharders}
    for path, module_plan in plan.plan.items():
        target = modules.get(path)
        if target is None:
            raise PlanMismatchError(f"the plan shards {path!r}, which the module does not have")
        sharder = next((s for t, s in by_type.items() if isinstance(target, t)), None)
        if sharder is None:
            raise PlanMismatchError(
                f"the plan shards {path!r} ({type(target).__name__}), which no sharder handles"
            )
        params = sharder.shardable_parameters(target)
        for name, ps in module_plan.items():
            if name not in params:
                raise PlanMismatchError(
                    f"the plan shards table {name!r} of {path!r}, which has only {sorted(params)}"
                )
            shape = tuple(params[name].shape)
            spec = ps.sharding_spec
            if spec is None:
                continue
            if validate_compact(spec, shape, f"{path}.{name}"):  # O(runs), not O(shards)
                continue
            covered = 0
            for shard in spec.shards:
                ends = [o + n for o, n in zip(shard.shard_offsets, shard.shard_sizes, strict=True)]
                if len(ends) != len(shape) or any(e > d for e, d in zip(ends, shape, strict=True)):
                    raise PlanMismatchError(
                        f"the plan's shard {shard.shard_offsets}+{shard.shard_sizes} of "
                        f"{path}.{name} lies outside the table's shape {list(shape)}"
                    )
                size = 1
                for n in shard.shard_sizes:
                    size *= n
                covered += size
            total = 1
            for d in shape:
                total *= d
            if covered != total:
                raise PlanMismatchError(
                    f"the plan's shards of {path}.{name} cover {covered} of its {total} elements"
                )
