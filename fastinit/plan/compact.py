"""The compact sharding spec: an ``EnumerableShardingSpec`` held as :class:`ShardRun` s.

:class:`CompactShardingSpec` holds only the runs of a layout (:mod:`fastinit.plan.layout`, which
stays torch-free): its ``shards`` are built on first use (then kept), and
:meth:`CompactShardingSpec.shards_of_rank` gives one rank's shards without building the others.
:func:`compact_plan` turns a plan's shard lists into these specs once; :func:`expanded_plan` turns
them back into TorchRec's own objects.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed.remote_device import _remote_device

from fastinit.errors import LayoutError, PlanMismatchError
from fastinit.plan.layout import (
    Expansions,
    LazyShards,
    ShardRun,
    SharedShards,
    runs_of,
    validate_runs,
)

__all__ = [
    "CompactShardingSpec",
    "compact_plan",
    "expanded_plan",
    "validate_compact",
]


class CompactShardingSpec(EnumerableShardingSpec):
    """An ``EnumerableShardingSpec`` held as :class:`ShardRun` s.

    ``shards`` is built on first use and then kept; it compares equal to the
    ``EnumerableShardingSpec`` of the same shards. Pickles and deep-copies as its runs.
    """

    runs: tuple[ShardRun, ...]
    """The rule: the runs of the shards, as built (see :meth:`current_runs`)."""

    def __init__(self, runs: Sequence[ShardRun], expansions: Expansions | None = None):
        self.__dict__["runs"] = tuple(runs)
        self.__dict__["_shards"] = None
        self.__dict__["_exp"] = expansions if expansions is not None else Expansions()
        self.__dict__["_count"] = sum(r.count for r in self.runs)

    @property
    def _placements(self) -> dict[str, Any]:
        return self.__dict__["_exp"].placements

    def _get_shards(self) -> Any:
        shards = self.__dict__["_shards"]
        if shards is None:
            shards = self.__dict__["_shards"] = self.__dict__["_exp"].shards(self.runs)
        return shards

    def unshare(self) -> None:
        """Give this spec placement and ``ShardMetadata`` objects of its own (before code
        that mutates them in place, such as TorchRec's meta-device placement rewrite)."""
        self.__dict__["_exp"] = Expansions()
        self.__dict__["_shards"] = None

    def build_metadata(self, tensor_sizes: Any, tensor_properties: Any) -> Any:
        """``EnumerableShardingSpec.build_metadata``, the bounds checked on the runs (O(runs)
        instead of O(shards)) while the shards are as the runs describe them."""
        if self.__dict__["_shards"] is not None and not isinstance(
            self.__dict__["_shards"], SharedShards
        ):
            return EnumerableShardingSpec.build_metadata(self, tensor_sizes, tensor_properties)
        shards = self.shards if self.expanded else self.lazy_shards()
        key = ("bounds", tuple(tensor_sizes))
        if key not in shards.checked:
            try:
                validate_runs(self.runs, list(tensor_sizes), "shards")
            except LayoutError:
                return EnumerableShardingSpec.build_metadata(
                    self, tensor_sizes, tensor_properties
                )  # torch's error
            shards.checked[key] = True
        return ShardedTensorMetadata(shards, tensor_sizes, tensor_properties)

    def lazy_shards(self) -> Any:
        """The shards as a :class:`LazyShards` (built only where read whole), while
        ``shards`` has not been built; else ``shards``."""
        if self.__dict__["_shards"] is not None:
            return self.__dict__["_shards"]
        return LazyShards(self.runs, self.__dict__["_exp"])

    def _set_shards(self, value: list[ShardMetadata]) -> None:
        self.__dict__["runs"] = runs_of(value)
        self.__dict__["_shards"] = list(value)
        self.__dict__["_count"] = len(value)

    shards = property(_get_shards, _set_shards)

    @property
    def expanded(self) -> bool:
        """Whether ``shards`` has been built."""
        return self.__dict__["_shards"] is not None

    def current_runs(self) -> tuple[ShardRun, ...]:
        """The runs of the shards as they are now (rescanned if ``shards`` was built and
        could have been edited in place)."""
        if self.__dict__["_shards"] is None:
            return self.runs
        return runs_of(self.__dict__["_shards"])

    def num_shards(self) -> int:
        return self.__dict__["_count"]

    def shards_of_rank(self, rank: int) -> list[tuple[int, ShardMetadata]]:
        """``(index in shards, ShardMetadata)`` of every shard on ``rank``, in O(runs)."""
        if self.__dict__["_shards"] is not None:
            return [
                (i, s)
                for i, s in enumerate(self.__dict__["_shards"])
                if s.placement is not None and s.placement.rank() == rank
            ]
        out = []
        base_index = 0
        for run in self.runs:
            js: Iterable[int] = ()
            if run.rank is not None:
                if run.rank_step == 0:
                    js = range(run.count) if run.rank == rank else ()
                else:
                    q, rem = divmod(rank - run.rank, run.rank_step)
                    js = (q,) if rem == 0 and 0 <= q < run.count else ()
            for j in js:
                text = run.placement_at(j)
                placement = self._placements.get(text)
                if placement is None:
                    placement = self._placements[text] = _remote_device(text)
                out.append(
                    (
                        base_index + j,
                        ShardMetadata(run.offsets_at(j), list(run.sizes), placement),
                    )
                )
            base_index += run.count
        return out

    def shard_ranks(self) -> list[int | None]:
        """The rank of every shard, in order (O(shards) ints, no ShardMetadata)."""
        out: list[int | None] = []
        for run in self.runs:
            if run.rank is None:
                out.append(None)
            elif run.rank_step == 0:
                out.extend([run.rank] * run.count)
            else:
                out.extend(range(run.rank, run.rank + run.count * run.rank_step, run.rank_step))
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CompactShardingSpec):
            return self.current_runs() == other.current_runs()
        if isinstance(other, EnumerableShardingSpec):
            return self.shards == other.shards
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CompactShardingSpec(runs={list(self.current_runs())!r})"

    def __reduce__(self) -> Any:
        return (_rebuild, (self.current_runs(),))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return type(self)(self.current_runs())

    def __copy__(self) -> Any:
        return type(self)(self.current_runs())


def _rebuild(runs: tuple[ShardRun, ...]) -> CompactShardingSpec:
    return CompactShardingSpec(runs)


def validate_compact(spec: Any, shape: Sequence[int], where: str) -> bool:
    """For ``validate_plan``: if ``spec`` is a compact spec that has not been expanded, check it
    against the table's ``shape`` in O(runs) and return True (raising
    :class:`fastinit.errors.PlanMismatchError` if it does not fit); otherwise return False and
    let the caller check the shards one by one."""
    if not isinstance(spec, CompactShardingSpec) or spec.expanded:
        return False
    try:
        validate_runs(spec.runs, shape, f"the plan's shards of {where}")
    except LayoutError as e:
        raise PlanMismatchError(str(e)) from None
    return True


def compact_plan(plan: Any) -> Any:
    """``plan`` with every shard list that follows a rule held as that rule: one linear pass.

    An explicit plan (TorchRec's ``construct_module_sharding_plan``, ``torch.load`` of a saved
    plan, another planner) holds one ``ShardMetadata`` per shard. Each table's
    ``EnumerableShardingSpec`` whose shards form fewer runs than shards (row-wise,
    table-row-wise, column blocks, grid) becomes a :class:`CompactShardingSpec` of those runs,
    so validation, the digest, construction, the ShardedTensors and the fused optimizer's state
    work from the rule, as for a decoded plan; a table whose shards follow no rule (one run per
    shard) keeps its list. The plan given is not changed: the result is a new ``ShardingPlan``
    (its ``ParameterSharding`` s copied where the spec changed, shared where not); a plan with
    nothing to compact is returned as it is. The specs of one plan share their placements and,
    between tables of one layout, their ``ShardMetadata`` (one :class:`Expansions`).
    """
    exp: Expansions | None = None
    modules: dict[str, Any] = {}
    changed = False
    for path, module_plan in plan.plan.items():
        if not hasattr(module_plan, "items"):
            modules[path] = module_plan
            continue
        out = None
        for name, ps in module_plan.items():
            spec: Any = getattr(ps, "sharding_spec", None)
            if (
                type(spec) is not EnumerableShardingSpec
            ):  # None, compact already, or another spec type
                continue
            shards = spec.shards
            if not isinstance(shards, list) or len(shards) < 2:
                continue
            try:
                runs = runs_of(shards)
            except Exception:  # not a list of ShardMetadata: left for validation to name
                continue
            if len(runs) == len(shards):
                continue  # follows no rule: keeps its list
            if exp is None:
                exp = Expansions()
            if out is None:
                out = type(module_plan)(module_plan.items())
            out[name] = dataclasses.replace(ps, sharding_spec=CompactShardingSpec(runs, exp))
        if out is not None:
            changed = True
        modules[path] = out if out is not None else module_plan
    return type(plan)(plan=modules) if changed else plan


def expanded_plan(plan: Any) -> Any:
    """A copy of ``plan`` whose compact specs are TorchRec's own ``EnumerableShardingSpec`` of
    freshly built ``ShardMetadata`` (nothing shared with ``plan`` or between tables): the plan a
    stock rank would hold."""
    modules = {}
    for path, module_plan in plan.plan.items():
        if not hasattr(module_plan, "items"):
            modules[path] = copy.deepcopy(module_plan)
            continue
        out = type(module_plan)()
        for name, ps in module_plan.items():
            spec = ps.sharding_spec
            if isinstance(spec, CompactShardingSpec):
                shards = [
                    ShardMetadata(list(s.shard_offsets), list(s.shard_sizes), str(s.placement))
                    for s in spec.shards
                ]
                ps = dataclasses.replace(ps, sharding_spec=EnumerableShardingSpec(shards))
            out[name] = ps
        modules[path] = out
    return type(plan)(plan=modules)
