"""FastPlanner returns TorchRec's plan: field by field, over a zoo of models, topologies, constraints.

Planning is local arithmetic, so no processes are needed; "cuda" topologies plan on a CPU host.
Every case runs the stock ``EmbeddingShardingPlanner`` and ``FastPlanner`` on the same inputs.
Stock planning is slow, so stock-side cases stay small (the benchmark covers the large ones).
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.partitioners import (
    GreedyPerfPartitioner,
    MemoryBalancedPartitioner,
    SortBy,
)
from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import CacheParams, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from fastinit.planner import FastPlanner
from fastinit.planner import partitioners as fast_partitioners
from fastinit.planner import planners as fast_planners
from fastinit.planner import proposers as fast_proposers
from fastinit.testing.models import plan_to_plain

logging.getLogger("torchrec").setLevel(logging.ERROR)

MB = 1024 * 1024
GB = 1024 * MB


# ---- helpers -------------------------------------------------------------------------------------


def assert_same_plan(fast: ShardingPlan, stock: ShardingPlan) -> None:
    a, b = plan_to_plain(fast), plan_to_plain(stock)
    assert a.keys() == b.keys()
    for key in b:
        assert a[key] == b[key], f"{key}: fast {a[key]} != stock {b[key]}"


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", text)


def ebc(tables: list[EmbeddingBagConfig]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def ec(tables: list[EmbeddingConfig]) -> EmbeddingCollection:
    return EmbeddingCollection(tables=tables, device=torch.device("meta"))


def bag_tables(
    n: int,
    dims: tuple[int, ...] = (8, 16, 32, 64, 128),
    fp16_every: int = 0,
    prefix: str = "t",
    min_exp: int = 2,
) -> list[EmbeddingBagConfig]:
    """``n`` tables of varied dims and row counts (some fp16 when ``fp16_every``)."""
    return [
        EmbeddingBagConfig(
            name=f"{prefix}{i}",
            embedding_dim=dims[i % len(dims)],
            num_embeddings=(97 + 31 * i) * (10 ** (min_exp + i % 4)),
            feature_names=[f"{prefix}f{i}"],
            data_type=DataType.FP16 if fp16_every and i % fp16_every == 0 else DataType.FP32,
        )
        for i in range(n)
    ]


def seq_tables(n: int, dim: int = 32, fp16_every: int = 0) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=f"s{i}",
            embedding_dim=dim,
            num_embeddings=(53 + 17 * i) * (10 ** (2 + i % 4)),
            feature_names=[f"sf{i}"],
            data_type=DataType.FP16 if fp16_every and i % fp16_every == 0 else DataType.FP32,
        )
        for i in range(n)
    ]


@dataclass
class Case:
    """One planning problem; ``planner_kwargs`` is a factory so each planner gets fresh objects."""

    name: str
    module: Callable[[], torch.nn.Module]
    world_size: int
    local_world_size: int
    device: str
    hbm_cap: int | None = None
    ddr_cap: int | None = None
    planner_kwargs: Callable[[], dict[str, Any]] = field(default=lambda: {})

    def topology(self) -> Topology:
        return Topology(
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            compute_device=self.device,
            hbm_cap=self.hbm_cap,
            ddr_cap=self.ddr_cap,
        )


def run_both(case: Case) -> tuple[Any, Any, FastPlanner]:
    """Plan ``case`` with both planners. Returns (fast result, stock result, fast planner)."""
    module = case.module()
    results = []
    planners = []
    for cls in (FastPlanner, EmbeddingShardingPlanner):
        planner = cls(topology=case.topology(), **case.planner_kwargs())
        try:
            results.append(planner.plan(module, get_default_sharders()))
        except Exception as e:  # compared below: same type, same message
            results.append(e)
        planners.append(planner)
    planners[0].stock_num_proposals = planners[1]._num_proposals  # type: ignore[attr-defined]
    return results[0], results[1], planners[0]


def _constraints_mixed() -> dict[str, ParameterConstraints]:
    return {
        "t0": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value]),
        "t1": ParameterConstraints(
            sharding_types=[ShardingType.TABLE_ROW_WISE.value, ShardingType.TABLE_WISE.value]
        ),
        "t2": ParameterConstraints(
            sharding_types=[ShardingType.COLUMN_WISE.value], min_partition=16
        ),
        "t3": ParameterConstraints(
            compute_kernels=[EmbeddingComputeKernel.FUSED_UVM_CACHING.value],
            cache_params=CacheParams(load_factor=0.25),
        ),
        "t4": ParameterConstraints(pooling_factors=[7.5], num_poolings=[2.0]),
        "t5": ParameterConstraints(
            sharding_types=[ShardingType.DATA_PARALLEL.value, ShardingType.TABLE_WISE.value],
            pooling_factors=[1.0, 3.0],
            batch_sizes=[256, 1024],
            feature_names=["tf5", "tf5b"],
        ),
        "t6": ParameterConstraints(
            compute_kernels=[EmbeddingComputeKernel.FUSED_UVM.value], enforce_hbm=True
        ),
        "t7": ParameterConstraints(
            sharding_types=[ShardingType.TABLE_COLUMN_WISE.value], stochastic_rounding=False
        ),
    }


def _constrained_module() -> torch.nn.Module:
    tables = bag_tables(12, fp16_every=3)
    tables[5] = EmbeddingBagConfig(
        name="t5", embedding_dim=32, num_embeddings=50_000, feature_names=["tf5", "tf5b"]
    )
    return ebc(tables)


def _alike_tables(n: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"a{i}", embedding_dim=32, num_embeddings=10_000, feature_names=[f"af{i}"]
        )
        for i in range(n)
    ]


def _big_table() -> EmbeddingBagConfig:
    # 3e6 x 128 fp32 = 1.5 GB: with the other tables, more than a 2 GB rank holds on every rank
    return EmbeddingBagConfig(
        name="big", embedding_dim=128, num_embeddings=3_000_000, feature_names=["bigf"]
    )


def _one_type_each() -> dict[str, ParameterConstraints]:
    types = [
        ShardingType.DATA_PARALLEL.value,
        ShardingType.TABLE_WISE.value,
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_COLUMN_WISE.value,
    ]
    return {f"t{i}": ParameterConstraints(sharding_types=[t]) for i, t in enumerate(types)}


CASES = [
    Case("ebc-cpu-ws8", lambda: ebc(bag_tables(48)), 8, 8, "cpu"),
    Case("ebc-cpu-ws1", lambda: ebc(bag_tables(16)), 1, 1, "cpu"),
    Case("ebc-cpu-ws16-lws2", lambda: ebc(bag_tables(32, fp16_every=2)), 16, 2, "cpu"),
    Case("ec-cpu-ws4-lws2", lambda: ec(seq_tables(24, fp16_every=4)), 4, 2, "cpu"),
    Case("ebc-cuda-ws16", lambda: ebc(bag_tables(12, fp16_every=3)), 16, 8, "cuda"),
    Case("ebc-cuda-ws2-lws1", lambda: ebc(bag_tables(10)), 2, 1, "cuda"),
    Case("ec-cuda-ws8", lambda: ec(seq_tables(10, dim=64)), 8, 8, "cuda"),
    Case("ebc-cuda-ws64", lambda: ebc(bag_tables(10)), 64, 8, "cuda"),
    Case("ebc-cuda-ws512", lambda: ebc(bag_tables(4)), 512, 8, "cuda"),
    Case("ebc-cpu-ws512", lambda: ebc(bag_tables(12)), 512, 8, "cpu"),
    Case("ebc-cuda-grid-search", lambda: ebc(bag_tables(3)), 4, 2, "cuda"),
    Case(
        "ebc-cuda-tight-hbm",  # storage binds: shards spill to less loaded devices, some fail
        lambda: ebc(bag_tables(12)),
        8,
        4,
        "cuda",
        hbm_cap=40 * MB,
    ),
    Case(
        "constraints-cuda",
        _constrained_module,
        16,
        8,
        "cuda",
        planner_kwargs=lambda: {"constraints": _constraints_mixed()},
    ),
    Case(
        "constraints-cpu",
        _constrained_module,
        8,
        4,
        "cpu",
        planner_kwargs=lambda: {
            "constraints": {
                k: v for k, v in _constraints_mixed().items() if k in ("t2", "t4", "t5", "t7")
            }
        },
    ),
    Case(
        "partitioner-perf-balanced",
        lambda: ebc(bag_tables(10) + bag_tables(6, prefix="u")),
        8,
        4,
        "cuda",
        planner_kwargs=lambda: {
            "partitioner": GreedyPerfPartitioner(sort_by=SortBy.PERF, balance_modules=True)
        },
    ),
    Case(  # feedback-driven proposer: the proposal-by-proposal search
        "greedy-threshold",
        lambda: ebc(bag_tables(20)),
        8,
        8,
        "cuda",
        planner_kwargs=lambda: {
            "proposer": [GreedyProposer(threshold=3), GreedyProposer(use_depth=False)]
        },
    ),
    Case(  # alike tables: equal scores, storages and ratings everywhere (tie-breaks)
        "ties-alike-tables-cpu",
        lambda: ebc(_alike_tables(24)),
        8,
        4,
        "cpu",
    ),
    Case(  # one shard per option: both greedy proposers propose the same sequence (all repeats)
        "ties-one-rank",
        lambda: ebc(_alike_tables(12) + bag_tables(6)),
        1,
        1,
        "cpu",
    ),
    Case(  # a table too big for a rank: every proposal placing it data parallel fails
        "table-does-not-fit-cpu",
        lambda: ebc(bag_tables(10, dims=(8, 16), min_exp=1) + [_big_table()]),
        8,
        4,
        "cpu",
        ddr_cap=2 * GB,
    ),
    Case(  # the same, proposal by proposal (every failure met in stock order)
        "table-does-not-fit-cpu-timeout",
        lambda: ebc(bag_tables(10, dims=(8, 16), min_exp=1) + [_big_table()]),
        8,
        4,
        "cpu",
        ddr_cap=2 * GB,
        planner_kwargs=lambda: {"timeout_seconds": 600},
    ),
    Case(  # each sharding type the CPU planner proposes, forced on some table, and free ones
        "every-cpu-sharding-type",
        lambda: ebc(bag_tables(12, fp16_every=4)),
        16,
        4,
        "cpu",
        planner_kwargs=lambda: {"constraints": _one_type_each()},
    ),
    Case(  # row-wise shards of unequal sizes (uniform options that are not alike)
        "row-wise-uneven-cpu",
        lambda: ebc(bag_tables(6)),
        24,
        8,
        "cpu",
        planner_kwargs=lambda: {
            "constraints": {
                f"t{i}": ParameterConstraints(
                    sharding_types=[ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value]
                )
                for i in range(3)
            }
        },
    ),
    Case(  # a timeout also selects the proposal-by-proposal search
        "timeout",
        lambda: ebc(bag_tables(20)),
        8,
        8,
        "cpu",
        planner_kwargs=lambda: {"timeout_seconds": 600, "proposer": UniformProposer()},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_plan_as_stock(case: Case) -> None:
    fast, stock, planner = run_both(case)
    assert not isinstance(stock, Exception), f"stock planner failed: {stock!r}"
    assert isinstance(fast, ShardingPlan), f"FastPlanner failed: {fast!r}"
    assert planner.fallback_reason is None, planner.fallback_reason
    assert gc.isenabled()  # paused while planning only
    assert_same_plan(fast, stock)
    # proposals counted as stock counts them: every distinct proposal once
    assert planner._num_proposals == planner.stock_num_proposals  # type: ignore[attr-defined]


def test_every_cpu_sharding_type_is_planned() -> None:
    """The forced-type case really plans each type the CPU planner proposes (same as stock)."""
    case = next(c for c in CASES if c.name == "every-cpu-sharding-type")
    fast, stock, _ = run_both(case)
    assert_same_plan(fast, stock)
    planned = {v["sharding_type"] for v in plan_to_plain(fast).values()}
    assert planned >= {"data_parallel", "table_wise", "column_wise", "table_column_wise"}


@pytest.mark.parametrize("timeout", [None, 600])
def test_hash_collisions_do_not_merge_proposals(
    monkeypatch: pytest.MonkeyPatch, timeout: int | None
) -> None:
    """Every proposal hashes alike: repeats are told apart by their vectors (same plan, count)."""

    class Colliding(fast_planners._Stream):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._z = [7] * len(self._z)
            self._zc = [7] * len(self._zc)

    # patched where FastPlanner reads it
    monkeypatch.setattr(fast_planners, "_Stream", Colliding)
    kwargs: dict[str, Any] = {"timeout_seconds": timeout} if timeout else {}
    case = Case("collide", lambda: ebc(bag_tables(12)), 8, 4, "cpu", planner_kwargs=lambda: kwargs)
    fast, stock, planner = run_both(case)
    assert planner.fallback_reason is None
    assert_same_plan(fast, stock)
    assert planner._num_proposals == planner.stock_num_proposals  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["ebc-cuda-grid-search", "ebc-cuda-tight-hbm", "ec-cuda-ws8"])
def test_stopped_partitions_and_alike_proposals_keep_the_stock_plan(name: str) -> None:
    """Partitions stopped at the best rating, and proposals that take an alike one's result.

    A partition stops once a device's load passes the best rating (``_num_cut``); a proposal
    whose options partition alike to an evaluated one (a one-shard column-wise option is placed
    as table-wise) takes its ranks and rating (``_num_twins``). Both paths run here, and the
    plan is still the stock plan.
    """
    case = next(c for c in CASES if c.name == name)
    fast, stock, planner = run_both(case)
    assert isinstance(fast, ShardingPlan) and isinstance(stock, ShardingPlan)
    assert_same_plan(fast, stock)
    assert planner._num_cut > 0
    assert planner._num_twins > 0
    assert planner._num_proposals == planner.stock_num_proposals  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "name",
    [
        "ebc-cpu-ws8",
        "ebc-cpu-ws16-lws2",
        "ec-cuda-ws8",
        "ties-alike-tables-cpu",
        "row-wise-uneven-cpu",
        "table-does-not-fit-cpu",
    ],
)
def test_batched_partitions_keep_the_stock_plan(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Proposals partitioned together (``Search.evaluate_batch``) give the stock plan."""
    monkeypatch.setattr(FastPlanner, "_batch_min", 1)
    monkeypatch.setattr(FastPlanner, "_batch_max", 5)
    case = next(c for c in CASES if c.name == name)
    fast, stock, planner = run_both(case)
    assert isinstance(fast, ShardingPlan) and isinstance(stock, ShardingPlan)
    assert_same_plan(fast, stock)
    assert planner._num_batched > 0
    assert planner._num_proposals == planner.stock_num_proposals  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "name",
    [
        "ebc-cpu-ws8",
        "ebc-cpu-ws1",
        "ebc-cpu-ws16-lws2",
        "ec-cpu-ws4-lws2",
        "ec-cuda-ws8",
        "ties-alike-tables-cpu",
        "ties-one-rank",
        "table-does-not-fit-cpu",
        "every-cpu-sharding-type",
    ],
)
@pytest.mark.parametrize("host_block", [32, 3])
def test_batched_partition_equals_one_by_one(
    monkeypatch: pytest.MonkeyPatch, name: str, host_block: int
) -> None:
    """``evaluate_batch`` gives every proposal of both greedy proposers the ranks and rating that
    ``evaluate`` gives it, bit for bit, or hands it back (``SCALAR``); hosts searched in one
    block or in blocks of 3 (the last one padded)."""
    monkeypatch.setattr(fast_partitioners.Search, "host_block", host_block)
    case = next(c for c in CASES if c.name == name)
    planner = FastPlanner(topology=case.topology(), **case.planner_kwargs())
    opts, lists, search = _search_parts(planner, case.module(), case.world_size)
    assert search.batch_ok
    stream = fast_planners._Stream(opts, len(lists), case.world_size)
    vecs = []
    for use_depth in (True, False):
        replay = fast_proposers.GreedyReplay(opts, lists, GreedyProposer(use_depth=use_depth))
        changes = replay.propose()
        while changes is not None:
            stream.apply(changes)
            vecs.append(list(stream.cur))
            replay.feedback(True, None)
            changes = replay.propose()
    results = search.evaluate_batch(vecs)
    assert results is not None
    batched = 0
    for vec, result in zip(vecs, results):
        expected = search.evaluate(vec)
        if result is fast_partitioners.SCALAR:
            continue
        assert expected is not None
        ranks, rating = result
        assert rating == expected[1]
        assert ranks() == expected[0]
        batched += 1
    assert batched > 0


def test_partition_classes_merge_only_alike_options() -> None:
    """One-shard table-wise and column-wise options of a table share a class; nothing else does."""
    planner = FastPlanner(topology=Topology(world_size=8, local_world_size=4, compute_device="cpu"))
    opts, lists, search = _search_parts(planner, ebc(bag_tables(6)), 8)
    classes = search.classes
    for lst in lists:
        for i, k in itertools.combinations(lst, 2):
            a, b = opts[i], opts[k]
            alike = (
                {a.sharding_type, b.sharding_type} == {"table_wise", "column_wise"}
                and a.n == b.n == 1
                and (a.st, a.pf) == (b.st, b.pf)
            )
            assert (classes[i] == classes[k]) == alike, (a.sharding_type, b.sharding_type)
    # options of different tables never share a class
    owner: dict[int, str] = {}
    for i, o in enumerate(opts):
        assert owner.setdefault(classes[i], o.fqn) == o.fqn
    assert len(set(classes)) < len(classes)  # some alike options were found


NO_FIT_CASES = [
    Case("no-fit-cuda-storage", lambda: ebc(bag_tables(8, dims=(256,))), 4, 2, "cuda", hbm_cap=MB),
    Case("no-fit-cpu-storage", lambda: ebc(bag_tables(8, dims=(256,))), 2, 2, "cpu", ddr_cap=MB),
    Case(
        "no-fit-strict-constraints",  # fits globally, but column-wise shards cannot be placed
        lambda: ebc(bag_tables(4, dims=(128,))),
        2,
        2,
        "cuda",
        hbm_cap=256 * MB,
        planner_kwargs=lambda: {
            "constraints": {
                f"t{i}": ParameterConstraints(
                    sharding_types=[ShardingType.COLUMN_WISE.value],
                    min_partition=8,
                    compute_kernels=[EmbeddingComputeKernel.FUSED.value],
                )
                for i in range(4)
            }
        },
    ),
]


@pytest.mark.parametrize("case", NO_FIT_CASES, ids=[c.name for c in NO_FIT_CASES])
def test_same_error_when_nothing_fits(case: Case) -> None:
    fast, stock, planner = run_both(case)
    assert isinstance(stock, PlannerError), f"the case should not fit: stock returned {stock!r}"
    assert type(fast) is type(stock)
    assert fast.error_type == stock.error_type
    # the stock message can name a ShardingOption by its memory address ("object at 0x7f..."),
    # which differs between any two runs; everything else must match character for character
    assert _no_addresses(str(fast)) == _no_addresses(str(stock))
    assert planner.fallback_reason is None


def test_stock_fallback_gives_same_plan() -> None:
    """A partitioner the fast search does not replay runs the stock planner (same plan)."""
    case = Case(
        "memory-balanced",
        lambda: ebc(bag_tables(8)),
        4,
        2,
        "cuda",
        planner_kwargs=lambda: {"partitioner": MemoryBalancedPartitioner()},
    )
    fast, stock, planner = run_both(case)
    assert planner.fallback_reason is not None
    assert_same_plan(fast, stock)


def test_fast_enumerator_estimates_match_stock() -> None:
    """The memoising estimators give every shard of every option the stock storage and perf."""
    module = _constrained_module()
    for device, ws, keep in (("cuda", 16, "01234567"), ("cpu", 8, "2457")):
        constraints = {k: v for k, v in _constraints_mixed().items() if k[1] in keep}
        topo = Topology(world_size=ws, local_world_size=4, compute_device=device)
        fast = FastPlanner(topology=topo, constraints=constraints)._enumerator
        stock = EmbeddingEnumerator(topology=topo, batch_size=512, constraints=constraints)
        a = fast.enumerate(module, get_default_sharders())
        b = stock.enumerate(module, get_default_sharders())
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert (x.fqn, x.sharding_type, x.compute_kernel) == (
                y.fqn,
                y.sharding_type,
                y.compute_kernel,
            )
            assert x.is_weighted == y.is_weighted
            assert [(s.size, s.offset, s.storage, s.perf) for s in x.shards] == [
                (s.size, s.offset, s.storage, s.perf) for s in y.shards
            ]
            assert len({id(s.perf) for s in x.shards}) == len(x.shards)  # no shared objects
        # the stored copy is a deep copy equal to the stock one
        kept_a, kept_b = fast.last_stored_search_space, stock.last_stored_search_space
        assert kept_a is not None and kept_b is not None
        assert [hash(so) for so in kept_a] == [hash(so) for so in kept_b]
        assert not {id(s) for so in kept_a for s in so.shards} & {
            id(s) for so in a for s in so.shards
        }


def test_perf_shared_across_hash_sizes_equals_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables of one shape but different row counts share a perf result where a trial with the
    hash sizes probed shows they are not read (table-wise, column-wise, ...), and keep their own
    where they are read (data-parallel reads the table size): every shard's perf is the stock
    one, and equals the one computed without sharing."""
    from fastinit.planner.estimator import estimator as est

    # same dims and dtypes, distinct row counts (the benchmark model's shape)
    tables = [
        EmbeddingBagConfig(
            name=f"h{i}",
            embedding_dim=(16, 64)[i % 2],
            num_embeddings=1000 + 7919 * i,
            feature_names=[f"hf{i}"],
            data_type=DataType.FP16 if i % 3 == 0 else DataType.FP32,
        )
        for i in range(12)
    ]
    module = ebc(tables)
    for device, ws, lws in (("cpu", 8, 4), ("cuda", 16, 4)):
        topo = Topology(world_size=ws, local_world_size=lws, compute_device=device)

        def perfs(share: bool, topo: Topology = topo) -> tuple[list[Any], Any]:
            monkeypatch.setattr(est.MemoPerfEstimator, "_any_hash_size", share)
            enumerator = FastPlanner(topology=topo)._enumerator
            space = enumerator.enumerate(module, get_default_sharders())
            got = [(so.fqn, so.sharding_type, [s.perf for s in so.shards]) for so in space]
            return got, enumerator._estimators[0]

        shared, memo = perfs(True)
        alone, _ = perfs(False)
        stock_space = EmbeddingEnumerator(topology=topo, batch_size=512).enumerate(
            module, get_default_sharders()
        )
        stock = [(so.fqn, so.sharding_type, [s.perf for s in so.shards]) for so in stock_space]
        assert shared == alone == stock
        assert memo._num_any_hash_hits > 0  # some contexts took a shared result
        assert memo._num_any_hash_trials > 0


def test_storage_memo_on_alike_tables_equals_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options with equal storage inputs (alike tables) share one computation, looked up by the
    full key only once their sharding type, kernel and tensor were seen: every shard's storage
    is the stock one, and fewer computations run than there are options."""
    from fastinit.planner import shard_estimators as se

    calls = 0
    real = se.calculate_shard_storages

    def counted(**kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(**kwargs)

    monkeypatch.setattr(se, "calculate_shard_storages", counted)
    module = ebc(_alike_tables(6) + bag_tables(4))
    for device, ws, lws in (("cpu", 8, 4), ("cuda", 16, 4)):
        topo = Topology(world_size=ws, local_world_size=lws, compute_device=device)
        calls = 0
        fast = FastPlanner(topology=topo)._enumerator.enumerate(module, get_default_sharders())
        stock = EmbeddingEnumerator(topology=topo, batch_size=512).enumerate(
            module, get_default_sharders()
        )
        assert [[s.storage for s in so.shards] for so in fast] == [
            [s.storage for s in so.shards] for so in stock
        ]
        per_alike = sum(1 for so in fast if so.name == "a0")
        # the first two alike tables are computed, the other four take the memo
        assert calls == len(fast) - 4 * per_alike


def test_hash_size_probe_allows_only_a_product_with_zero() -> None:
    from fastinit.planner.estimator import estimator as est

    probe = est._PROBE
    assert math.copysign(1.0, 0.0 * probe) == 1.0
    assert math.copysign(1.0, probe * -0.0) == -1.0
    uses: list[Callable[[], Any]] = [
        lambda: 2.0 * probe,
        lambda: 0 * probe,
        lambda: probe + 0,
        lambda: probe < 1,
        lambda: min(probe, 3),
        lambda: probe == probe,
        lambda: hash(probe),
        lambda: float(probe),
        lambda: int(probe),
        lambda: bool(probe),
        lambda: f"{probe}",
        lambda: probe.bit_length(),
        lambda: math.ceil(probe),
        lambda: -probe,
    ]
    for use in uses:
        with pytest.raises(est._HashSizeRead):
            use()


def _search_parts(
    planner: FastPlanner, module: torch.nn.Module, ws: int
) -> tuple[list[Any], list[list[int]], Any]:
    """The fast search's options, per-table option lists and ``Search`` for ``module``."""
    space = planner._enumerator.enumerate_compact(module, get_default_sharders())
    storage = planner._storage_reservation.reserve(
        topology=planner._topology,
        batch_size=planner._batch_size,
        module=module,
        sharders=get_default_sharders(),
    )
    opts = [fast_partitioners.Opt(c) for c in space]
    lists: dict[str, list[int]] = {}
    for i, o in enumerate(opts):
        lists.setdefault(o.fqn, []).append(i)
    search = fast_partitioners.Search(opts, storage, ws, False, False)
    return opts, list(lists.values()), search


def test_lower_bound_never_exceeds_rating() -> None:
    """The pruning bounds (batch and streamed) are below the exact rating of every proposal."""
    module = ebc(bag_tables(10, fp16_every=2))
    for device, ws, lws in (("cuda", 16, 4), ("cpu", 8, 8)):
        planner = FastPlanner(
            topology=Topology(world_size=ws, local_world_size=lws, compute_device=device)
        )
        opts, lists, search = _search_parts(planner, module, ws)
        stream = fast_planners._Stream(opts, len(lists), ws)
        replay = fast_proposers.GreedyReplay(opts, lists, GreedyProposer())
        checked = 0
        changes = replay.propose()
        while changes is not None:
            stream.apply(changes)
            proposal = list(stream.cur)
            result = search.evaluate(proposal)
            if result is not None:
                assert search.lower_bound(proposal) <= result[1] * (1 + 1e-12)
                assert stream.bound() <= result[1] * (1 + 1e-12)
                assert stream.bound() == pytest.approx(search.lower_bound(proposal), rel=1e-12)
                checked += 1
            replay.feedback(result is not None, None)
            changes = replay.propose()
        assert checked > 10


def test_import_is_cheap() -> None:
    """``import fastinit.planner`` loads neither torchrec.distributed nor the planner's modules."""
    code = (
        "import sys, fastinit.planner as s; "
        "assert 'torchrec.distributed' not in sys.modules, 'torchrec.distributed imported'; "
        "assert 'fastinit.planner.planners' not in sys.modules; "
        "assert 'FastPlanner' in s.__all__"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the stock side: minutes at 1,024 ranks on a loaded machine
@pytest.mark.parametrize(
    "n_tables,world_size,device",
    [(128, 8, "cpu"), (64, 64, "cpu"), (24, 32, "cuda"), (6, 1024, "cpu"), (4, 512, "cuda")],
)
def test_same_plan_as_stock_larger(n_tables: int, world_size: int, device: str) -> None:
    case = Case(
        "larger", lambda: ebc(bag_tables(n_tables, fp16_every=5, min_exp=1)), world_size, 8, device
    )
    fast, stock, _ = run_both(case)
    assert isinstance(stock, ShardingPlan), f"stock planner failed: {stock!r}"
    assert isinstance(fast, ShardingPlan), f"FastPlanner failed: {fast!r}"
    assert_same_plan(fast, stock)


def test_sweep_fit_recovers_exponents() -> None:
    """The sweep's growth fit (pure) finds the exponents of synthetic timings."""
    from benchmarks.planner.main import fit_growth, sweep_markdown

    rows = [
        {"tables": t, "world_size": w, "cpu_s": 0.5 * t**1.1 * w**0.2}
        for t in (256, 1024, 4096)
        for w in (8, 512, 4096)
    ]
    rows.append({"tables": 16384, "world_size": 4096, "cpu_s": None, "note": "not run"})
    fit = fit_growth(rows)
    assert fit["n"] == 9
    assert fit["a"] == pytest.approx(0.5, rel=1e-9)
    assert fit["b"] == pytest.approx(1.1, abs=1e-9)
    assert fit["c"] == pytest.approx(0.2, abs=1e-9)
    assert fit["per_w"][8] == pytest.approx(1.1, abs=1e-9)
    assert fit["per_t"][1024] == pytest.approx(0.2, abs=1e-9)
    for r in rows[:-1]:
        r.update(wall_s=r["cpu_s"], peak_rss_mb=100.0, num_proposals=1, num_plans=1)
    md = sweep_markdown(rows, {"cpu_s": fit}, {})
    assert "T^1.10 x W^0.20" in md and "| 16384 | 4096 | not run" in md


def test_grid_search_skipped_at_thousands_of_tables() -> None:
    """Grid search is skipped (as stock skips it) even when its size has 10,000 digits."""
    from types import SimpleNamespace

    opts: Any = [SimpleNamespace(score_depth=0.0, score_sum=0.0)] * 40_000
    lists = [[2 * f, 2 * f + 1] for f in range(20_000)]  # 2**20000 proposals
    assert fast_proposers.GridReplay(opts, lists, 10_000).propose() is None
    small = fast_proposers.GridReplay(opts, lists[:3], 10_000)
    seen = []
    changes = small.propose()
    vec = [-1] * 3
    while changes is not None:
        for f, o in changes:
            vec[f] = o
        seen.append(tuple(vec))
        small.feedback(True, None)
        changes = small.propose()
    assert seen == list(itertools.product(*lists[:3]))
