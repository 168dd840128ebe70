"""Pin what stock TorchRec 1.8.0 does at start-up, so we know the tracer sees what DESIGN.md says.

These are the numbers fastinit is measured against; if a TorchRec upgrade changes them, these tests
say so first.
"""

from __future__ import annotations

from typing import Any

import pytest

from fastinit.testing.dist import run_ranks
from fastinit.testing.models import SHARDING_TYPES

MIXED = list(SHARDING_TYPES)


def _stock_counts(cases: list[tuple[str, dict[str, Any], Any]]) -> dict[str, Any]:
    import torch.distributed as dist

    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    out: dict[str, Any] = {}
    for name, spec_kwargs, types in cases:
        model = build_model(ModelSpec(**spec_kwargs), device="meta")
        plan = None if types == "planner" else build_plan(model, types, dist.get_world_size())
        phases: dict[str, Any] = {}
        tracer = trace.active()
        assert tracer is not None
        with tracer.window() as total:
            stock_setup(model, plan, phases=phases)
        out[name] = {"phases": phases, "total": total}
    return out


def test_stock_two_ranks_table_wise_and_embedding_collection() -> None:
    cases = [
        ("ebc8_planner", {"num_tables": 8}, "planner"),
        ("ebc8_tw", {"num_tables": 8}, "table_wise"),
        ("ec2", {"num_tables": 0, "num_ec_tables": 2}, "table_wise"),
        ("ec5", {"num_tables": 0, "num_ec_tables": 5}, "table_wise"),
    ]
    for rank_out in run_ranks(_stock_counts, 2, args=(cases,), trace=True, timeout=240):
        planned = rank_out["ebc8_planner"]
        # collective_plan: broadcast_object_list = 2 broadcasts.
        assert planned["phases"]["plan"]["c10d_ops"] == {"broadcast_": 2}
        # DMP, all table-wise EBC: init_collective_validation (2 broadcasts), DDP verify
        # (1 all_gather + 1 broadcast), DDP coalesced parameter broadcast (1).
        assert planned["phases"]["dmp"]["c10d_ops"] == {"broadcast_": 4, "allgather_": 1}
        assert planned["total"]["c10d_total"] == 7
        assert planned["total"]["barriers"] == 0
        assert planned["total"]["new_groups"] == 0
        # A second DMP in the same process: init_collective_validation runs once per process.
        assert rank_out["ebc8_tw"]["phases"]["dmp"]["c10d_ops"] == {
            "broadcast_": 2,
            "allgather_": 1,
        }
        # EmbeddingCollection: 2 all_gathers per table on top (ShardedTensor._init_from_local_shards).
        ec2 = rank_out["ec2"]["phases"]["dmp"]["c10d_ops"]["allgather_"]
        ec5 = rank_out["ec5"]["phases"]["dmp"]["c10d_ops"]["allgather_"]
        assert ec2 == 1 + 2 * 2
        assert ec5 - ec2 == 2 * 3


@pytest.mark.parametrize("local_world_size", [2])
def test_stock_mixed_plan_creates_node_groups_and_barriers(local_world_size: int) -> None:
    cases = [("mixed", {"num_tables": 7}, MIXED)]
    results = run_ranks(
        _stock_counts,
        4,
        args=(cases,),
        trace=True,
        local_world_size=local_world_size,
        timeout=240,
    )
    for rank_out in results:
        dmp = rank_out["mixed"]["phases"]["dmp"]
        # comm.intra_and_cross_node_pg: every rank creates every intra-node group (world/local)
        # and every cross-node group (local), then 2 barriers over the world.
        hosts = 4 // local_world_size
        assert dmp["new_groups"] == hosts + local_world_size
        assert dmp["member_groups"] == 2
        assert not any(g["local_sync"] for g in dmp["groups"])
        assert dmp["barriers"] == 2
        intra = [g["ranks"] for g in dmp["groups"][:hosts]]
        assert intra == [
            list(range(h * local_world_size, (h + 1) * local_world_size)) for h in range(hosts)
        ]
        # DP tables add DDP verification + broadcasts: more ops than the all-table-wise model.
        assert dmp["c10d_total"] > 5
