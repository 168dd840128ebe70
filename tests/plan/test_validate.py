"""validate_plan: every table planned or its module left out, shards tile the table, ranks in the world."""

from __future__ import annotations

import copy
import itertools
import random
import types
from typing import Any

import pytest

pytest.importorskip("torchrec")

from torch import nn  # noqa: E402
from torch.distributed import _remote_device  # noqa: E402
from torch.distributed._shard.sharding_spec import (  # noqa: E402
    EnumerableShardingSpec,
    ShardMetadata,
)
from torchrec.distributed.sharding_plan import get_default_sharders  # noqa: E402
from torchrec.distributed.types import (  # noqa: E402
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

from fastinit.errors import PlanMismatchError, StartupError  # noqa: E402
from fastinit.plan.validate import (  # noqa: E402
    _tiling_problem,
    _tiling_problem_2d,
    count_tables,
    shardable_modules,
    validate_plan,
)
from fastinit.testing.models import SHARDING_TYPES, ModelSpec, build_model, build_plan  # noqa: E402

SPEC = ModelSpec(num_tables=7, num_ec_tables=7, num_weighted_tables=2, fp16_every=3)
SHARDERS = get_default_sharders()


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return build_model(SPEC, device="meta")


@pytest.fixture(scope="module")
def plan(model: nn.Module) -> ShardingPlan:
    return build_plan(model, list(SHARDING_TYPES), world_size=4, local_world_size=2)


def _first_table(plan: ShardingPlan, sharding_type: str) -> tuple[str, str, ParameterSharding]:
    for path, mp in plan.plan.items():
        for name, ps in mp.items():  # type: ignore[attr-defined]
            if ps.sharding_type == sharding_type:
                return path, name, ps
    raise AssertionError(f"no {sharding_type} table")


def _raises(model: nn.Module, plan: ShardingPlan, match: str, world_size: int = 4) -> None:
    with pytest.raises(PlanMismatchError, match=match) as info:
        validate_plan(model, plan, SHARDERS, world_size=world_size)
    assert isinstance(info.value, StartupError)


def test_plans_of_every_sharding_type_pass(model: nn.Module) -> None:
    for world_size, local in ((1, 1), (2, 2), (4, 2), (8, 4)):
        for kinds in [list(SHARDING_TYPES)] + [[t] for t in SHARDING_TYPES]:
            plan = build_plan(model, kinds, world_size=world_size, local_world_size=local)
            validate_plan(model, plan, SHARDERS, world_size=world_size)
            validate_plan(model, plan, SHARDERS)  # placements unchecked without a world size


def test_more_ranks_than_rows_gives_empty_shards_that_pass() -> None:
    tiny = build_model(ModelSpec(num_tables=2, num_ec_tables=0, rows=8), device="meta")
    plan = build_plan(tiny, ["row_wise"], world_size=16, local_world_size=8)
    _, _, ps = _first_table(plan, "row_wise")
    assert any(not s.shard_sizes[0] for s in ps.sharding_spec.shards)  # type: ignore[union-attr]
    validate_plan(tiny, plan, SHARDERS, world_size=16)


def test_a_module_left_out_of_the_plan_is_allowed(model: nn.Module, plan: ShardingPlan) -> None:
    # DistributedModelParallel leaves a module without a (non-empty) module plan unsharded.
    paths = list(plan.plan)
    assert len(paths) == 3
    partial = ShardingPlan({paths[0]: plan.plan[paths[0]]})
    validate_plan(model, partial, SHARDERS, world_size=4)
    emptied = ShardingPlan({paths[0]: plan.plan[paths[0]], paths[1]: EmbeddingModuleShardingPlan()})
    validate_plan(model, emptied, SHARDERS, world_size=4)
    validate_plan(model, ShardingPlan({}), SHARDERS, world_size=4)


def test_a_table_missing_from_a_planned_module(model: nn.Module, plan: ShardingPlan) -> None:
    broken = copy.deepcopy(plan)
    path, name, _ = _first_table(broken, "row_wise")
    del broken.plan[path][name]  # type: ignore[attr-defined]
    # before: passed, then KeyError inside TorchRec's sharded module
    _raises(model, broken, rf"plan for '{path}' leaves out its table\(s\) \['{name}'\]")


def test_a_table_the_module_does_not_have(model: nn.Module, plan: ShardingPlan) -> None:
    broken = copy.deepcopy(plan)
    path, name, ps = _first_table(broken, "table_wise")
    broken.plan[path]["no_such_table"] = ps  # type: ignore[index]
    _raises(model, broken, "table 'no_such_table'")


def test_overlapping_shards_that_sum_to_the_table(model: nn.Module, plan: ShardingPlan) -> None:
    broken = copy.deepcopy(plan)
    path, name, ps = _first_table(broken, "row_wise")
    shards = ps.sharding_spec.shards  # type: ignore[union-attr]
    rows = sum(s.shard_sizes[0] for s in shards)
    assert len(shards) == 4
    # Same sizes (so the element count still matches), but shard 1 starts where shard 0 does.
    shards[1].shard_offsets = list(shards[0].shard_offsets)
    assert sum(s.shard_sizes[0] for s in shards) == rows
    _raises(model, broken, rf"table '{path}\.{name}' overlap at \[0:")  # before: passed


def test_a_gap_between_shards(model: nn.Module, plan: ShardingPlan) -> None:
    broken = copy.deepcopy(plan)
    path, name, ps = _first_table(broken, "column_wise")
    shards = ps.sharding_spec.shards  # type: ignore[union-attr]
    del shards[1]
    _raises(model, broken, rf"table '{path}\.{name}' leave \[.*\] uncovered")


def test_a_shard_outside_the_table(model: nn.Module, plan: ShardingPlan) -> None:
    for mutate in (
        lambda s: setattr(s, "shard_offsets", [s.shard_offsets[0] + 1, s.shard_offsets[1]]),
        lambda s: setattr(s, "shard_offsets", [-1, s.shard_offsets[1]]),
        lambda s: setattr(s, "shard_sizes", [s.shard_sizes[0], s.shard_sizes[1] + 1]),
    ):
        broken = copy.deepcopy(plan)
        path, name, ps = _first_table(broken, "table_row_wise")
        mutate(ps.sharding_spec.shards[-1])  # type: ignore[union-attr]
        _raises(model, broken, rf"table '{path}\.{name}' lies outside the table's shape")
    broken = copy.deepcopy(plan)
    path, name, ps = _first_table(broken, "table_wise")
    ps.sharding_spec.shards[0].shard_offsets = [0]  # type: ignore[union-attr]
    _raises(model, broken, rf"table '{path}\.{name}' does not have the table's 2 dimensions")


def test_ranks_outside_the_world(model: nn.Module, plan: ShardingPlan) -> None:
    broken = copy.deepcopy(plan)
    path, name, ps = _first_table(broken, "table_wise")
    ps.ranks = [7]
    ps.sharding_spec.shards[0].placement = _remote_device("rank:7/cpu")  # type: ignore[union-attr]
    # before: passed, then IndexError inside TorchRec
    _raises(model, broken, rf"table '{path}\.{name}' on rank\(s\) \[7\], outside the world of 4")
    validate_plan(model, broken, SHARDERS, world_size=8)
    broken = copy.deepcopy(plan)
    _, _, ps = _first_table(broken, "grid_shard")
    ps.sharding_spec.shards[-1].placement = _remote_device("rank:4/cpu")  # type: ignore[union-attr]
    _raises(model, broken, r"a shard of table .* rank\(s\) \[4\]")
    _raises(model, broken, r"rank\(s\) \[4\]", world_size=4)
    broken = copy.deepcopy(plan)
    _, _, ps = _first_table(broken, "data_parallel")
    ps.ranks = [0, 1, 2, 3, 4]
    _raises(model, broken, r"rank\(s\) \[4\]")


def test_a_sharded_table_without_a_spec(model: nn.Module, plan: ShardingPlan) -> None:
    broken = copy.deepcopy(plan)
    path, name, ps = _first_table(broken, "column_wise")
    ps.sharding_spec = None
    _raises(model, broken, rf"column_wise sharding of table '{path}\.{name}' has no sharding_spec")


def test_module_paths_that_do_not_fit(model: nn.Module, plan: ShardingPlan) -> None:
    path, mp = next(iter(plan.plan.items()))
    _raises(model, ShardingPlan({"nowhere": mp}), "'nowhere', which the module does not have")
    dense = next(p for p, m in model.named_modules() if p and isinstance(m, nn.Linear))
    _raises(model, ShardingPlan({dense: mp}), rf"'{dense}' \(Linear\), which no sharder handles")
    inner = next(p for p, _ in model.get_submodule(path).named_children())
    nested = ShardingPlan({path: mp, f"{path}.{inner}": mp})
    _raises(model, nested, rf"lies inside '{path}'")


def test_the_sharder_is_found_by_exact_type(model: nn.Module, plan: ShardingPlan) -> None:
    # DistributedModelParallel looks the sharder up by type(module): a subclass has none.
    path = next(iter(plan.plan))
    sub = copy.deepcopy(model)
    target = sub.get_submodule(path)
    target.__class__ = type("MyCollection", (type(target),), {})
    _raises(sub, plan, rf"'{path}' \(MyCollection\), which no sharder handles")


def test_shardable_modules_and_count_tables(model: nn.Module, plan: ShardingPlan) -> None:
    found = [p for p, _, _ in shardable_modules(model, SHARDERS)]
    assert sorted(found) == sorted(plan.plan)
    tables = SPEC.num_tables + SPEC.num_weighted_tables + SPEC.num_ec_tables
    assert count_tables(model, SHARDERS) == tables


def _brute_force(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]
) -> bool:
    cells: dict[tuple[int, ...], int] = {}
    for lo, hi in boxes:
        for cell in itertools.product(*(range(a, b) for a, b in zip(lo, hi, strict=True))):
            cells[cell] = cells.get(cell, 0) + 1
    total = 1
    for d in shape:
        total *= d
    return len(cells) == total and all(v == 1 for v in cells.values())


def test_the_sweep_agrees_with_counting_cells() -> None:
    rng = random.Random(0)
    agreed = {True: 0, False: 0}
    for _ in range(3000):
        shape = (rng.randint(1, 6), rng.randint(1, 5))
        # A random grid (a valid tiling), then sometimes a perturbation.
        rows = sorted({0, shape[0], *rng.sample(range(1, shape[0] + 1), rng.randint(0, shape[0]))})
        cols = sorted({0, shape[1], *rng.sample(range(1, shape[1] + 1), rng.randint(0, shape[1]))})
        boxes = [
            ((r0, c0), (r1, c1))
            for r0, r1 in itertools.pairwise(rows)
            for c0, c1 in itertools.pairwise(cols)
        ]
        if rng.random() < 0.5 and len(boxes) > 1:  # merge two neighbours: still a tiling
            boxes.sort()
            (a0, a1), (b0, b1) = boxes[0], boxes[1]
            if a0[0] == b0[0] and a1[0] == b1[0]:
                boxes[0:2] = [(a0, b1)]
        if rng.random() < 0.6:
            i = rng.randrange(len(boxes))
            (r0, c0), (r1, c1) = boxes[i]
            r0 = max(0, min(r0 + rng.choice((-1, 0, 1)), r1 - 1))
            c1 = max(c0 + 1, min(c1 + rng.choice((-1, 0, 1)), shape[1]))
            boxes[i] = ((r0, c0), (r1, c1))
        if rng.random() < 0.2:
            boxes.append(boxes[rng.randrange(len(boxes))])
        if rng.random() < 0.2 and len(boxes) > 1:
            boxes.pop(rng.randrange(len(boxes)))
        expected = _brute_force(boxes, shape)
        assert (_tiling_problem(boxes, shape, 0) is None) == expected, (boxes, shape)
        shards = [
            types.SimpleNamespace(
                shard_offsets=list(lo), shard_sizes=[b - a for a, b in zip(lo, hi)]
            )
            for lo, hi in boxes
        ]
        assert (_tiling_problem_2d("t", shape, shards, None) is None) == expected, (boxes, shape)
        agreed[expected] += 1
    assert agreed[True] > 300 and agreed[False] > 300, agreed


def _spec(shards: list[tuple[list[int], list[int], int]]) -> Any:
    metadata = [ShardMetadata(offsets, sizes, f"rank:{r}/cpu") for offsets, sizes, r in shards]
    spec = EnumerableShardingSpec(metadata[:1])  # its constructor refuses overlapping shards
    spec.shards.extend(metadata[1:])  # as a decoded or hand-edited plan may hold them
    return spec


def test_explicit_specs_of_one_table(model: nn.Module) -> None:
    path, _, sharder = next(iter(shardable_modules(model, SHARDERS)))
    params = sharder.shardable_parameters(model.get_submodule(path))
    rows, dim = params["t0"].shape
    base = build_plan(model, ["table_wise"], world_size=2)
    for shards, ok in (
        ([([0, 0], [rows, dim], 0)], True),
        ([([0, 0], [rows, dim // 2], 0), ([0, dim // 2], [rows, dim - dim // 2], 1)], True),
        ([([0, 0], [rows, dim], 0), ([0, 0], [0, dim], 1)], True),  # an empty shard
        ([([0, 0], [rows // 2, dim], 0), ([rows // 2, 0], [rows // 2, dim], 1)], rows % 2 == 0),
        ([([0, 0], [rows, dim], 0), ([0, 0], [rows, dim], 1)], False),  # a copy, twice the size
    ):
        plan = copy.deepcopy(base)
        ps = plan.plan[path]["t0"]  # type: ignore[index]
        ps.sharding_spec = _spec(shards)
        ps.ranks = [r for _, _, r in shards]
        if ok:
            validate_plan(model, plan, SHARDERS, world_size=2)
        else:
            _raises(model, plan, "t0", world_size=2)
