"""Micro-benchmarks of fastinit's start-up pieces (pytest-benchmark; not part of the test suite).

    .venv/bin/python -m benchmarks.micro        # make micro

* plan codec: fastinit's pickle-free encoding against pickle, for a 256-table plan on 64 ranks;
* shard metadata built locally from the plan (what replaces stock's per-table all_gather_object);
* planner-input fingerprint (what every rank computes for the one start-up all_gather);
* planning: TorchRec's ``EmbeddingShardingPlanner`` against fastinit's ``FastPlanner``.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest

pytest.importorskip("pytest_benchmark")

RANKS = 64


@pytest.fixture(scope="module")
def medium() -> Any:
    from benchmarks.ttfb.trainer import model_spec
    from fastinit.testing.models import build_model

    return build_model(model_spec("medium"), device="meta")


@pytest.fixture(scope="module")
def plan(medium: Any) -> Any:
    from fastinit.testing.models import build_plan

    return build_plan(
        medium,
        ["table_wise", "row_wise", "column_wise", "data_parallel"],
        world_size=RANKS,
        local_world_size=8,
    )


def test_codec_encode(benchmark: Any, plan: Any) -> None:
    from fastinit.plan.codec import encode_plan

    data = benchmark(encode_plan, plan)
    benchmark.extra_info["bytes"] = len(data)


def test_codec_decode(benchmark: Any, plan: Any) -> None:
    from fastinit.plan.codec import decode_plan, encode_plan

    data = encode_plan(plan)
    benchmark(decode_plan, data)


def test_pickle_round_trip(benchmark: Any, plan: Any) -> None:
    data = pickle.dumps(plan)
    benchmark.extra_info["bytes"] = len(data)
    benchmark(lambda: pickle.loads(pickle.dumps(plan)))


def test_local_shard_metadata(benchmark: Any, plan: Any) -> None:
    """Global ShardedTensor metadata of every table, from the plan alone (no collective)."""
    import torch
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    specs = [
        ps.sharding_spec
        for mp in plan.plan.values()
        for ps in mp.values()
        if ps.sharding_spec is not None
    ]
    props = TensorProperties(dtype=torch.float32)

    def build() -> int:
        n = 0
        for spec in specs:
            rows = max(s.shard_offsets[0] + s.shard_sizes[0] for s in spec.shards)
            cols = max(s.shard_offsets[1] + s.shard_sizes[1] for s in spec.shards)
            spec.build_metadata(torch.Size([rows, cols]), props)
            n += 1
        return n

    benchmark.extra_info["tables"] = benchmark(build)


def test_fingerprint(benchmark: Any, medium: Any) -> None:
    from torchrec.distributed.planner import Topology

    from benchmarks.ttfb.trainer import _sharders
    from fastinit.plan.fingerprint import planner_fingerprint

    sharders = _sharders()
    topology = Topology(local_world_size=8, world_size=RANKS, compute_device="cpu")
    benchmark(planner_fingerprint, medium, sharders, topology)


@pytest.mark.parametrize("which", ["stock", "fastinit"])
def test_planner_small_2_ranks(benchmark: Any, which: str) -> None:
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from benchmarks.ttfb.trainer import _sharders, model_spec
    from fastinit.planner import FastPlanner
    from fastinit.testing.models import build_model

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    module = build_model(model_spec("small"), device="meta")
    cls = EmbeddingShardingPlanner if which == "stock" else FastPlanner

    def plan() -> Any:
        planner = cls(topology=Topology(local_world_size=2, world_size=2, compute_device="cpu"))
        return planner.plan(module, _sharders())

    benchmark.pedantic(plan, rounds=3, iterations=1)
