"""What a plan holds, summed up: tables per sharding type and kernel, shards and weight bytes per
rank, each table's layout (what ``fastinit plan`` prints and ``--json`` writes)."""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.types import ShardingPlan

__all__ = [
    "PlanSummary",
    "summarize_plan",
    "table_layouts",
    "format_summary",
    "MAX_LISTED_SHARDS",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanSummary:
    """What ``fastinit plan`` planned and where it put it."""

    key: str
    """The plan-cache key, hex."""
    entry: str
    """The cache entry written (or found identical)."""
    inputs: str | None
    """The description written beside it (None if it could not be written)."""
    status: str
    """"written", "unchanged" (an identical entry was there) or "replaced"."""
    planner: str
    """The planner's class."""
    seconds: float
    """Planning time."""
    world_size: int
    """Ranks planned for."""
    local_world_size: int
    """Ranks per host planned for."""
    device: str
    """Compute device type planned for."""
    tables_by_type: dict[str, int]
    """Tables per sharding type."""
    tables_by_kernel: dict[str, int]
    """Tables per compute kernel."""
    rank_shards: list[int]
    """Shards held by each rank (a data-parallel table counts once per rank)."""
    rank_bytes: list[int]
    """Bytes of embedding weights held by each rank."""
    tables: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Each table's layout (:func:`table_layouts`): ``module``, ``table``, ``sharding_type``,
    ``compute_kernel``, ``ranks`` and ``shards`` (``[rank, offsets, sizes]`` each; None for a
    data-parallel table, and for every table of a plan with more than
    :data:`MAX_LISTED_SHARDS` shards)."""


def _shardable(module: nn.Module, sharders: Sequence[Any], path: str) -> dict[str, Any]:
    sub = module.get_submodule(path)
    for sharder in sharders:
        if type(sub) is sharder.module_type or isinstance(sub, sharder.module_type):
            return dict(sharder.shardable_parameters(sub))
    return {}


def summarize_plan(
    plan: ShardingPlan, module: nn.Module, sharders: Sequence[Any], world_size: int
) -> tuple[dict[str, int], dict[str, int], list[int], list[int]]:
    """Tables per sharding type and per kernel, then shards and weight bytes per rank."""
    by_type: dict[str, int] = {}
    by_kernel: dict[str, int] = {}
    shards = [0] * world_size
    nbytes = [0] * world_size
    for path, module_plan in plan.plan.items():
        params = _shardable(module, sharders, path)
        for table, ps in module_plan.items():
            by_type[ps.sharding_type] = by_type.get(ps.sharding_type, 0) + 1
            by_kernel[ps.compute_kernel] = by_kernel.get(ps.compute_kernel, 0) + 1
            param = params.get(table)
            item = param.element_size() if param is not None else 0
            if ps.sharding_spec is None:  # data parallel: the whole table on each of its ranks
                numel = param.numel() if param is not None else 0
                for rank in ps.ranks or range(world_size):
                    shards[rank] += 1
                    nbytes[rank] += numel * item
                continue
            for shard in ps.sharding_spec.shards:
                rank = shard.placement.rank()
                numel = 1
                for n in shard.shard_sizes:
                    numel *= n
                shards[rank] += 1
                nbytes[rank] += numel * item
    return by_type, by_kernel, shards, nbytes


#: ``fastinit plan --json`` lists every shard's offsets and sizes up to this many shards in all
#: (a row-wise table has one per rank: at thousands of ranks the list would be the plan again).
MAX_LISTED_SHARDS = 65_536


def table_layouts(plan: ShardingPlan, world_size: int) -> list[dict[str, Any]]:
    """Each table's layout in ``plan``, in the plan's order: module path, table, sharding type,
    compute kernel, the ranks holding it, and its shards (``[rank, offsets, sizes]``; None for a
    data-parallel table, or when the plan has more than :data:`MAX_LISTED_SHARDS` shards)."""
    total = sum(
        len(ps.sharding_spec.shards)
        for module_plan in plan.plan.values()
        for ps in module_plan.values()
        if ps.sharding_spec is not None
    )
    out = []
    for path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():
            spec = ps.sharding_spec
            shards = None
            if spec is not None and total <= MAX_LISTED_SHARDS:
                shards = [
                    [s.placement.rank(), list(s.shard_offsets), list(s.shard_sizes)]
                    for s in spec.shards
                ]
            if ps.ranks is not None:
                ranks = sorted(set(ps.ranks))
            elif spec is not None:
                ranks = sorted({s.placement.rank() for s in spec.shards})
            else:
                ranks = list(range(world_size))
            out.append(
                {
                    "module": path,
                    "table": table,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": ranks,
                    "shards": shards,
                }
            )
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def format_summary(s: PlanSummary) -> str:
    """The human-readable summary ``fastinit plan`` prints."""
    lines = [
        f"planned for {s.world_size} ranks ({s.local_world_size} per host) on {s.device} by "
        f"{s.planner} in {s.seconds:.2f} s",
        "",
        f"{'sharding type':<20} {'tables':>7}",
    ]
    lines += [f"{st:<20} {n:>7}" for st, n in sorted(s.tables_by_type.items())]
    lines.append(f"{'total':<20} {sum(s.tables_by_type.values()):>7}")
    lines += ["", f"{'compute kernel':<20} {'tables':>7}"]
    lines += [f"{k:<20} {n:>7}" for k, n in sorted(s.tables_by_kernel.items())]
    lines += ["", f"{'rank':<8} {'shards':>7} {'weights MiB':>12}"]
    ranks = list(range(s.world_size))
    if len(ranks) > 16:
        lines += [f"{r:<8} {s.rank_shards[r]:>7} {_mib(s.rank_bytes[r]):>12}" for r in ranks[:4]]
        lines.append(f"{'...':<8}")
        b = s.rank_bytes
        lines.append(
            f"min/median/max MiB: {_mib(min(b))} / {_mib(statistics.median(b))} / {_mib(max(b))}"
        )
    else:
        lines += [f"{r:<8} {s.rank_shards[r]:>7} {_mib(s.rank_bytes[r]):>12}" for r in ranks]
    lines += [
        "",
        f"cache key: {s.key}",
        f"cache entry ({s.status}): {s.entry}",
    ]
    if s.inputs:
        lines.append(f"planned-for inputs: {s.inputs}")
    cache_dir = os.path.dirname(s.entry) or "."
    lines.append(
        f"the job hits it with fastinit.setup(..., plan_cache={cache_dir!r}) (or "
        f"FASTINIT_PLAN_CACHE) on {s.world_size} ranks, {s.local_world_size} per host, {s.device}"
    )
    return "\n".join(lines)
