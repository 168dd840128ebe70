"""FastPlanner's hot paths at 4,096 tables x 4,096 ranks (pytest-benchmark; ``make micro``).

    .venv/bin/python -m pytest benchmarks/micro/test_planner_micro.py --benchmark-only

One benchmark per stage of ``FastPlanner.plan`` (see docs/planner.md for the cost model):

* enumeration: options, shard sizes, and the two estimators (``FastEnumerator.enumerate_compact``);
* the search's per-option data (``Opt``) and device arrays (``Search``);
* the proposal stream: every proposal of the four stock proposers, hashed, de-duplicated and
  bounded (what ``_search_offline`` does before it partitions anything);
* one partition and rating of a whole proposal (``Search.evaluate``);
* ``plan()`` end to end.

The model is ``benchmarks.planner.main.build_model`` (dims 16..128, rows 1e3..1e6, every fifth
table fp16) on a CPU topology with 8 ranks per host. Sizes: ``FASTINIT_MICRO_TABLES`` and
``FASTINIT_MICRO_RANKS`` are not knobs of fastinit, only of this file (default 4096 each).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

pytest.importorskip("pytest_benchmark")

TABLES = int(os.environ.get("FASTINIT_MICRO_TABLES", "4096"))
RANKS = int(os.environ.get("FASTINIT_MICRO_RANKS", "4096"))


def _topology() -> Any:
    from torchrec.distributed.planner import Topology

    return Topology(world_size=RANKS, local_world_size=min(8, RANKS), compute_device="cpu")


@pytest.fixture(scope="module", autouse=True)
def quiet_logging() -> Any:
    """Logging off below WARNING while this module runs, as in ``bench_planner``'s workers."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def parts() -> dict[str, Any]:
    """The model, a planner, its search space and search, built once for the module."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    from benchmarks.planner.main import build_model
    from fastinit.planner import FastPlanner
    from fastinit.planner import partitioners as fast_partitioners

    model = build_model(TABLES)
    sharders = get_default_sharders()
    planner = FastPlanner(topology=_topology())
    storage = planner._storage_reservation.reserve(
        topology=planner._topology,
        batch_size=planner._batch_size,
        module=model,
        sharders=sharders,
    )
    space = planner._enumerator.enumerate_compact(model, sharders)
    opts = [fast_partitioners.Opt(c) for c in space]
    lists: dict[str, list[int]] = {}
    for i, o in enumerate(opts):
        lists.setdefault(o.fqn, []).append(i)
    search = fast_partitioners.Search(opts, storage, RANKS, False, False)
    return {
        "model": model,
        "sharders": sharders,
        "planner": planner,
        "storage": storage,
        "space": space,
        "opts": opts,
        "lists": list(lists.values()),
        "search": search,
    }


def _replays(parts: dict[str, Any]) -> list[Any]:
    from torchrec.distributed.planner.proposers import (
        GreedyProposer,
        GridSearchProposer,
    )

    from fastinit.planner import proposers as fast_proposers

    opts, lists = parts["opts"], parts["lists"]
    fqn_pos = {opts[lst[0]].fqn: f for f, lst in enumerate(lists)}
    return [
        fast_proposers.GridReplay(opts, lists, GridSearchProposer()._max_proposals),
        fast_proposers.GreedyReplay(opts, lists, GreedyProposer()),
        fast_proposers.GreedyReplay(opts, lists, GreedyProposer(use_depth=False)),
        fast_proposers.UniformReplay(opts, fqn_pos, True),
    ]


def test_enumerate(benchmark: Any, parts: dict[str, Any]) -> None:
    """Enumeration and estimation of every option (a fresh enumerator: no cache)."""
    from fastinit.planner import enumerators as tr

    def run() -> int:
        enumerator = tr.FastEnumerator(topology=_topology(), batch_size=512)
        return len(enumerator.enumerate_compact(parts["model"], parts["sharders"]))

    benchmark.extra_info["options"] = benchmark.pedantic(run, rounds=2, iterations=1)


def test_search_options(benchmark: Any, parts: dict[str, Any]) -> None:
    """Per-option search data and the device arrays."""
    from fastinit.planner import partitioners as fast_partitioners

    def run() -> Any:
        opts = [fast_partitioners.Opt(c) for c in parts["space"]]
        return fast_partitioners.Search(opts, parts["storage"], RANKS, False, False)

    benchmark.pedantic(run, rounds=3, iterations=1)


def test_proposal_stream(benchmark: Any, parts: dict[str, Any]) -> None:
    """Every proposal of the stock proposers: applied, de-duplicated and bounded."""
    from fastinit.planner import planners as fast_planners

    def run() -> int:
        stream = fast_planners._Stream(parts["opts"], len(parts["lists"]), RANKS)
        seen: dict[int, list[int]] = {}
        distinct = 0
        for replay in _replays(parts):
            changes = replay.propose()
            while changes is not None:
                s = stream.apply(changes)
                if stream.find(seen, s) is None:
                    distinct += 1
                    stream.bound()
                replay.feedback(True, None)
                changes = replay.propose()
        return distinct

    benchmark.extra_info["proposals"] = benchmark.pedantic(run, rounds=3, iterations=1)


def test_partition_and_rate(benchmark: Any, parts: dict[str, Any]) -> None:
    """One greedy partition and rating of a whole proposal (every table placed)."""
    replay = _replays(parts)[1]
    proposal = [lst[0] for lst in replay._lists]
    result = benchmark.pedantic(parts["search"].evaluate, args=(proposal,), rounds=3, iterations=1)
    assert result is not None


def test_plan(benchmark: Any, parts: dict[str, Any]) -> None:
    """``FastPlanner.plan`` end to end (a fresh planner: enumeration included)."""
    from fastinit.planner import FastPlanner

    def run() -> Any:
        return FastPlanner(topology=_topology()).plan(parts["model"], parts["sharders"])

    benchmark.pedantic(run, rounds=2, iterations=1)
