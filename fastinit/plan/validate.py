"""Checks that a sharding plan fits a module and a world, before TorchRec is handed it.

What ``DistributedModelParallel`` does with a plan (torchrec 1.8.0, ``_shard_modules_impl``), and
so what :func:`validate_plan` requires:

* It walks the module from the root. A module whose path has a non-empty module plan is sharded
  by the sharder of its exact type, and its children are not visited; any other module is left as
  it is and its children are visited. So a shardable module **absent from the plan** (or with an
  empty module plan) is deliberately left unsharded, as stock does: it stays a dense module,
  replicated by the data-parallel wrapper. This is allowed.
* A module plan that is present must name **every** shardable parameter (table) of its module:
  TorchRec's sharded modules look every table up in it (a missing one is a ``KeyError`` deep in
  the constructor). Every name in it must be a table of the module.
* A module plan for a path the module does not have, for a module no sharder handles (by exact
  type), or nested inside another planned module (never reached) does not fit.
* Every sharding type except ``data_parallel`` needs an enumerable ``sharding_spec``; its shards
  must lie inside the table (non-negative offsets, offset + size within each dimension), be
  pairwise disjoint and cover the table. Every placement and every entry of ``ranks`` must be a
  rank of the world ``0 <= rank < world_size``.

The shard check is a sweep, not a pairwise comparison: shards are sorted along the first dimension
and the shards crossing each strip between consecutive boundaries must tile the remaining
dimensions (recursively; the last dimension is a sorted run of intervals). Its cost is
``O(shards log shards)`` for every layout TorchRec produces (row-wise, column-wise, table-wise,
table-row-wise, grid), and in general the number of (strip, crossing shard) pairs.

Example::

    validate_plan(model, plan, sharders, world_size=env.world_size)  # PlanMismatchError if not
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from fastinit.errors import PlanMismatchError, StartupError
from fastinit.plan.compact import validate_compact

if TYPE_CHECKING:
    from torchrec.distributed.types import ModuleSharder, ShardingPlan

__all__ = ["validate_plan", "shardable_modules", "count_tables", "check_unsharded"]

_DATA_PARALLEL = "data_parallel"

# (offsets, ends) of one non-empty shard, in every dimension.
_Box = tuple[tuple[int, ...], tuple[int, ...]]


def _sharder_map(sharders: Sequence[ModuleSharder[Any]]) -> dict[type, ModuleSharder[Any]]:
    # As DistributedModelParallel's _sharder_map: keyed by exact module type, the last one wins.
    return {s.module_type: s for s in sharders}


def shardable_modules(
    module: nn.Module, sharders: Sequence[ModuleSharder[Any]]
) -> Iterator[tuple[str, nn.Module, ModuleSharder[Any]]]:
    """``(path, module, sharder)`` of every module a sharder handles (by exact type), found from
    the root down without descending into one (as TorchRec's planner enumerates them)."""
    by_type = _sharder_map(sharders)
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        path, child = stack.pop()
        sharder = by_type.get(type(child))
        if sharder is not None:
            yield path, child, sharder
            continue
        children = [(f"{path}.{n}" if path else n, m) for n, m in child.named_children()]
        stack.extend(reversed(children))


def count_tables(module: nn.Module, sharders: Sequence[ModuleSharder[Any]]) -> int:
    """The number of shardable parameters (tables) of every shardable module of ``module``
    (for :func:`fastinit.plan.cache.plan_bytes_bound`)."""
    return sum(len(s.shardable_parameters(m)) for _, m, s in shardable_modules(module, sharders))


def validate_plan(
    module: nn.Module,
    plan: ShardingPlan,
    sharders: Sequence[ModuleSharder[Any]],
    world_size: int | None = None,
) -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` fits ``module`` (and the world).

    See the module docstring for exactly what is required; a shardable module absent from the
    plan is allowed (left unsharded, as ``DistributedModelParallel`` does).

    Args:
        module: the unsharded model (parameters may be on "meta").
        plan: the sharding plan to check.
        sharders: the sharders the model will be sharded with.
        world_size: ranks in the world; None skips the placement checks.

    Raises:
        PlanMismatchError: the first misfit found, naming the module path and table.
    """
    by_type = _sharder_map(sharders)
    planned = {path for path, mp in plan.plan.items() if mp}
    for path, module_plan in plan.plan.items():
        if not module_plan:  # DMP treats an empty module plan as absent
            continue
        try:
            target = module.get_submodule(path)
        except AttributeError:
            raise PlanMismatchError(
                f"the plan shards {path!r}, which the module does not have"
            ) from None
        outer = _planned_ancestor(path, planned)
        if outer is not None:
            raise PlanMismatchError(
                f"the plan shards {path!r}, which lies inside {outer!r}, also sharded by the plan"
            )
        sharder = by_type.get(type(target))
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
            _check_table(
                f"{path}.{name}" if path else name, tuple(params[name].shape), ps, world_size
            )
        missing = [name for name in params if name not in module_plan]
        if missing:
            raise PlanMismatchError(
                f"the plan for {path!r} leaves out its table(s) {missing}; a module in the plan "
                "must have every table planned (leave the whole module out to keep it unsharded)"
            )


def _planned_ancestor(path: str, planned: set[str]) -> str | None:
    if not path:
        return None
    if "" in planned:
        return ""
    parts = path.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix in planned:
            return prefix
    return None


def _check_ranks(where: str, ranks: Any, world_size: int | None) -> None:
    if world_size is None or not ranks:
        return
    if min(ranks) >= 0 and max(ranks) < world_size:  # O(n) in C: row-wise tables list every rank
        return
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise PlanMismatchError(
            f"the plan places {where} on rank(s) {bad[:8]}, outside the world of {world_size}"
        )


def _check_table(table: str, shape: tuple[int, ...], ps: Any, world_size: int | None) -> None:
    _check_ranks(f"table {table!r}", getattr(ps, "ranks", None), world_size)
    spec = ps.sharding_spec
    if spec is None:
        if ps.sharding_type != _DATA_PARALLEL:
            raise PlanMismatchError(
                f"the plan's {ps.sharding_type} sharding of table {table!r} has no sharding_spec"
            )
        return
    rule_error: PlanMismatchError | None = None
    try:
        on_rule = validate_compact(spec, shape, f"table {table!r}")  # O(runs), not O(shards)
    except PlanMismatchError as e:  # the shards, one by one, name the problem more precisely
        on_rule, rule_error = False, e
    if on_rule:
        for run in spec.runs:
            if run.rank is not None and run.count:
                ends = (run.rank, run.rank_at(run.count - 1))
                _check_ranks(f"a shard of table {table!r}", [min(ends), max(ends)], world_size)
        return
    shards = getattr(spec, "shards", None)
    if shards is None:
        raise PlanMismatchError(
            f"the plan's sharding_spec of table {table!r} is a {type(spec).__name__}, "
            "not an enumerable list of shards"
        )
    if len(shape) == 2:  # every embedding table: a tighter loop, and 1-D runs for RW/CW
        problem = _tiling_problem_2d(table, shape, shards, world_size)
    else:
        problem = _tiling_problem_nd(table, shape, shards, world_size)
    if problem is not None:
        raise PlanMismatchError(f"the plan's shards of table {table!r} {problem}")
    if rule_error is not None:
        raise rule_error


def _outside(table: str, shape: tuple[int, ...], offsets: Any, sizes: Any) -> PlanMismatchError:
    return PlanMismatchError(
        f"the plan's shard {list(offsets)}+{list(sizes)} of table {table!r} lies outside "
        f"the table's shape {list(shape)}"
    )


def _wrong_dims(table: str, shape: tuple[int, ...], offsets: Any, sizes: Any) -> PlanMismatchError:
    return PlanMismatchError(
        f"the plan's shard {list(offsets)}+{list(sizes)} of table {table!r} does not have "
        f"the table's {len(shape)} dimensions {list(shape)}"
    )


def _tiling_problem_2d(
    table: str, shape: tuple[int, ...], shards: Any, world_size: int | None
) -> str | None:
    rows, cols = shape
    boxes: list[tuple[int, int, int, int]] = []
    placements: list[int] = []
    for shard in shards:
        offsets, sizes = shard.shard_offsets, shard.shard_sizes
        if len(offsets) != 2 or len(sizes) != 2:
            raise _wrong_dims(table, shape, offsets, sizes)
        r0, c0 = offsets
        nr, nc = sizes
        r1, c1 = r0 + nr, c0 + nc
        if r0 < 0 or c0 < 0 or nr < 0 or nc < 0 or r1 > rows or c1 > cols:
            raise _outside(table, shape, offsets, sizes)
        if world_size is not None:
            placements.append(_placement_rank(table, shard))
        if nr and nc:
            boxes.append((r0, r1, c0, c1))
    _check_ranks(f"a shard of table {table!r}", placements, world_size)
    if not rows or not cols:
        return None
    if all(b[2] == 0 and b[3] == cols for b in boxes):  # row-wise, table-row-wise, table-wise
        return _run_problem(sorted((b[0], b[1]) for b in boxes), rows, (), 1)
    if all(b[0] == 0 and b[1] == rows for b in boxes):  # column-wise, table-column-wise
        problem = _run_problem(sorted((b[2], b[3]) for b in boxes), cols, ((0, rows),), 0)
        return problem
    return _tiling_problem([((b[0], b[2]), (b[1], b[3])) for b in boxes], shape, 0)


def _tiling_problem_nd(
    table: str, shape: tuple[int, ...], shards: Any, world_size: int | None
) -> str | None:
    ndim = len(shape)
    boxes: list[_Box] = []
    placements: list[int] = []
    for shard in shards:
        offsets, sizes = tuple(shard.shard_offsets), tuple(shard.shard_sizes)
        if len(offsets) != ndim or len(sizes) != ndim:
            raise _wrong_dims(table, shape, offsets, sizes)
        ends = tuple(o + n for o, n in zip(offsets, sizes, strict=True))
        if (
            any(o < 0 for o in offsets)
            or any(n < 0 for n in sizes)
            or any(e > d for e, d in zip(ends, shape, strict=True))
        ):
            raise _outside(table, shape, offsets, sizes)
        if world_size is not None:
            placements.append(_placement_rank(table, shard))
        if all(sizes):
            boxes.append((offsets, ends))
    _check_ranks(f"a shard of table {table!r}", placements, world_size)
    if ndim == 0 or not all(shape):
        return None
    return _tiling_problem(boxes, shape, 0)


def _run_problem(
    intervals: list[tuple[int, int]], size: int, prefix: tuple[tuple[int, int], ...], rest: int
) -> str | None:
    """None when the sorted ``intervals`` tile ``[0, size)``; else the first gap or overlap."""
    pos = 0
    for lo, hi in intervals:
        if lo > pos:
            return f"leave {_where(prefix, rest, pos, lo)} uncovered"
        if lo < pos:
            return f"overlap at {_where(prefix, rest, lo, min(pos, hi))}"
        pos = hi
    if pos < size:
        return f"leave {_where(prefix, rest, pos, size)} uncovered"
    return None


def _placement_rank(table: str, shard: Any) -> int:
    placement = shard.placement
    rank = placement.rank() if placement is not None else None
    if rank is None:
        raise PlanMismatchError(f"a shard of table {table!r} has no rank in its placement")
    return int(rank)


def _where(prefix: tuple[tuple[int, int], ...], rest: int, lo: int, hi: int) -> str:
    """The region ``[a:b, lo:hi, :, ...]`` in slice notation."""
    ranges = [f"{a}:{b}" for a, b in prefix] + [f"{lo}:{hi}"] + [":"] * rest
    return f"[{', '.join(ranges)}]"


def _tiling_problem(
    boxes: list[_Box],
    shape: tuple[int, ...],
    dim: int,
    prefix: tuple[tuple[int, int], ...] = (),
) -> str | None:
    """None when ``boxes`` tile ``shape`` in dimensions ``dim..``; else what is wrong (a gap or
    an overlap, with the region)."""
    size = shape[dim]
    rest = len(shape) - dim - 1
    if not rest:
        return _run_problem(sorted((b[0][dim], b[1][dim]) for b in boxes), size, prefix, 0)
    # Sweep dimension ``dim``: between consecutive boundaries, the crossing shards must tile the
    # remaining dimensions.
    order = sorted(boxes, key=lambda b: b[0][dim])
    bounds = sorted({0, size, *(b[0][dim] for b in boxes), *(b[1][dim] for b in boxes)})
    active: list[_Box] = []
    nxt = 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        active = [b for b in active if b[1][dim] > lo]
        while nxt < len(order) and order[nxt][0][dim] == lo:
            active.append(order[nxt])
            nxt += 1
        if not active:
            return f"leave {_where(prefix, rest, lo, hi)} uncovered"
        problem = _tiling_problem(active, shape, dim + 1, (*prefix, (lo, hi)))
        if problem is not None:
            return problem
    return None


def check_unsharded(module: nn.Module) -> None:
    """Raise unless ``module`` is unsharded: no ``DistributedModelParallel`` (``setup``'s own
    result passed again) and no TorchRec ``ShardedModule`` anywhere in it.

    Raises:
        StartupError: naming the first such submodule (in ``named_modules`` order, so the
            outermost) and its class.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardedModule

    for name, sub in module.named_modules():
        if isinstance(sub, DistributedModelParallel | ShardedModule):
            where = f"submodule {name!r}" if name else "the module itself"
            raise StartupError(
                f"fastinit.setup: {where} is already sharded (a {type(sub).__name__}): pass the "
                "unsharded model, as built (e.g. on the meta device), not the result of "
                "fastinit.setup or DistributedModelParallel nor a model holding it"
            )
