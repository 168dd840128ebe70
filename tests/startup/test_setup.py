"""fastinit.setup builds the stock model: same plan, same shard metadata, same state_dict keys,
same training — and with at most 3 start-up collectives, whatever the table count.

Each spawn runs several cases, since every rank pays seconds of imports on this machine.
"""

from __future__ import annotations

from typing import Any

import pytest

from fastinit.testing.dist import run_ranks
from fastinit.testing.models import SHARDING_TYPES, plan_to_plain

ALL_TYPES = list(SHARDING_TYPES)
# EmbeddingCollection supports DP, TW, CW and RW in torchrec 1.8.0. Stock torchrec 1.8.0 fails to
# train an EmbeddingCollection with a data_parallel table on CPU (its sequence output has the wrong
# length: "split_with_sizes expects split_sizes to sum exactly to ..."), so that case is checked
# for construction only.
EC_TYPES = ["table_wise", "column_wise", "row_wise"]
STEPS = 3


# Kept under this name: tests/tools/test_patches.py imports it.
_plan_fields = plan_to_plain


def _st_metadata(model: Any) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            md = value.metadata()
            out[key] = (
                [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in md.shards_metadata],
                tuple(md.size),
                md.tensor_properties.dtype,
                md.tensor_properties.layout,
                md.tensor_properties.requires_grad,
            )
    return out


def _local_values(model: Any) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            out[key] = [s.tensor.detach().clone() for s in value.local_shards()]
        else:
            out[key] = [value.detach().clone()]
    return out


def _train(model: Any, spec: Any, rank: int) -> list[float]:
    import torch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from fastinit.testing.models import batches

    optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.05),
    )
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    it = batches(spec, batch_size=16, seed=100 + rank)
    data = iter([next(it) for _ in range(STEPS)])
    losses = []
    for _ in range(STEPS):
        loss, _logits, _labels = pipeline.progress(data)  # the model's output, after backward
        losses.append(float(loss))
    return losses


def _equivalence(cases: list[tuple[str, dict[str, Any], Any]]) -> dict[str, Any]:
    """Per case: stock and fastinit models agree in plan, metadata, keys, and (unless the case
    name ends in ``/build``) in 3 steps of TrainPipelineSparseDist from the same state."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    ws, rank = dist.get_world_size(), dist.get_rank()
    report: dict[str, Any] = {}
    for name, spec_kwargs, types in cases:
        spec = ModelSpec(**spec_kwargs)

        def planner() -> Any:
            return EmbeddingShardingPlanner(topology=Topology(world_size=ws, compute_device="cpu"))

        if types == "planner":
            stock = stock_setup(build_model(spec, device="meta"), planner=planner())
            fast = fastinit.setup(build_model(spec, device="meta"), planner=planner(), seed=7)
        else:
            plan = build_plan(build_model(spec, device="meta"), types, ws)
            stock = stock_setup(build_model(spec, device="meta"), plan)
            fast = fastinit.setup(build_model(spec, device="meta"), plan=plan, seed=7)
        assert isinstance(fast, type(stock)), type(fast)
        assert _plan_fields(fast.plan) == _plan_fields(stock.plan), name
        assert list(fast.state_dict()) == list(stock.state_dict()), name
        assert _st_metadata(fast) == _st_metadata(stock), name
        fast.load_state_dict(stock.state_dict())
        if name.endswith("/build"):
            report[name] = {"losses": [], "tables": len(_st_metadata(fast))}
            continue
        before = _local_values(fast)
        stock_losses = _train(stock, spec, rank)
        fast_losses = _train(fast, spec, rank)
        assert fast_losses == stock_losses, (name, fast_losses, stock_losses)
        after_stock, after_fast = _local_values(stock), _local_values(fast)
        for key, tensors in after_stock.items():
            for a, b in zip(tensors, after_fast[key], strict=True):
                assert torch.equal(a, b), (name, key)
        changed = any(
            not torch.equal(a, b)
            for key in before
            for a, b in zip(before[key], after_fast[key], strict=True)
        )
        assert changed, f"{name}: training changed nothing; the comparison would prove nothing"
        report[name] = {"losses": fast_losses, "tables": len(_st_metadata(fast))}
    return report


CASES_2 = [
    ("ebc-all-types", {"num_tables": 7, "num_weighted_tables": 2, "fp16_every": 3}, ALL_TYPES),
    ("ec-all-types", {"num_tables": 0, "num_ec_tables": 8, "fp16_every": 2}, EC_TYPES),
    ("ec-dp/build", {"num_tables": 0, "num_ec_tables": 4}, ["data_parallel", "table_wise"]),
    ("mixed-planner", {"num_tables": 5, "num_ec_tables": 3, "num_weighted_tables": 2}, "planner"),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equivalent_to_stock(world_size: int) -> None:
    cases = CASES_2 if world_size in (2, 4) else CASES_2[:2]
    lws = 2 if world_size == 4 else world_size
    results = run_ranks(_equivalence, world_size, args=(cases,), local_world_size=lws, timeout=400)
    # Every rank trained the same global model: the losses are per-rank but must be finite.
    for per_rank in results:
        for case in per_rank.values():
            assert all(loss == loss for loss in case["losses"])


def _counts(cache_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    import fastinit
    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    tracer = trace.active()
    assert tracer is not None
    out: dict[str, Any] = {}
    for tables in (8, 256):
        spec = ModelSpec(num_tables=tables, rows=64, dims=(8,))
        plan = build_plan(build_model(spec, device="meta"), "table_wise", dist.get_world_size())
        with tracer.window() as counts:
            fastinit.setup(build_model(spec, device="meta"), plan=plan, seed=1)
        out[f"explicit{tables}"] = counts
        with tracer.window() as counts:
            fastinit.setup(build_model(spec, device="meta"), plan_cache=f"{cache_dir}/c", seed=1)
        out[f"cold{tables}"] = counts
        with tracer.window() as counts:
            fastinit.setup(build_model(spec, device="meta"), plan_cache=f"{cache_dir}/c", seed=1)
        out[f"cached{tables}"] = counts
    return out


def test_startup_op_counts_do_not_grow_with_tables(tmp_path) -> None:
    results = run_ranks(_counts, 2, args=(str(tmp_path),), trace=True, timeout=400)
    for per_rank in results:
        for tables in (8, 256):
            explicit = per_rank[f"explicit{tables}"]
            cold = per_rank[f"cold{tables}"]
            cached = per_rank[f"cached{tables}"]
            # Every rank holds the same plan: one all_gather of the records and one all_reduce
            # of the replicated values' digests; they agree, so nothing is broadcast.
            assert explicit["c10d_ops"] == {"allgather_": 1, "allreduce_": 1}, explicit
            # Cold: rank 0 plans, one broadcast of the encoded plan.
            assert cold["c10d_ops"] == {"allgather_": 1, "broadcast_": 1, "allreduce_": 1}, cold
            # Warm cache on every rank: no plan message.
            assert cached["c10d_ops"] == {"allgather_": 1, "allreduce_": 1}, cached
            for counts in (explicit, cold, cached):
                assert counts["barriers"] == 0
                assert counts["new_groups"] == 0
                assert counts["store_total"] == 0
        assert per_rank["cold256"]["c10d_bytes"] > per_rank["cold8"]["c10d_bytes"]
    assert list(tmp_path.joinpath("c").iterdir()), "the plan cache was not written"


def _bad_inputs(cache_dir: str) -> dict[str, str]:
    import os
    import warnings

    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    rank = dist.get_rank()
    out: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "ok"
        except fastinit.StartupError as e:
            out[name] = f"{type(e).__name__}: {e}"

    good = ModelSpec(num_tables=4)
    rows = ModelSpec(num_tables=4, rows=2000) if rank == 1 else good
    missing = ModelSpec(num_tables=3) if rank == 1 else good
    attempt("rows", lambda: fastinit.setup(build_model(rows, device="meta"), seed=1))
    attempt("missing", lambda: fastinit.setup(build_model(missing, device="meta"), seed=1))
    sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1 * (rank + 1)})]
    attempt(
        "sharders",
        lambda: fastinit.setup(build_model(good, device="meta"), sharders=sharders, seed=1),
    )
    # A plan for another model: a table the module does not have.
    other = build_plan(build_model(ModelSpec(num_tables=6), device="meta"), "table_wise", 2)
    attempt("bad_plan", lambda: fastinit.setup(build_model(good, device="meta"), plan=other))
    # A corrupt cache entry is ignored with a warning and replaced.
    cache = os.path.join(cache_dir, "shared")
    fastinit.setup(build_model(good, device="meta"), plan_cache=cache, seed=1)
    if rank == 0:  # the planner wrote the entry; damage it
        for entry in os.listdir(cache):
            with open(os.path.join(cache, entry), "r+b") as f:
                f.seek(20)
                f.write(b"garbage")
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attempt(
            "corrupt", lambda: fastinit.setup(build_model(good, device="meta"), plan_cache=cache)
        )
    out["corrupt_warned"] = str(any("cache" in str(w.message).lower() for w in caught))
    # A cache directory that cannot be written: warn and continue.
    blocked = os.path.join(cache_dir, f"file{rank}")
    with open(blocked, "w") as f:
        f.write("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attempt(
            "unwritable",
            lambda: fastinit.setup(build_model(good, device="meta"), plan_cache=blocked),
        )
    out["unwritable_warned"] = str(bool(caught))
    with open(blocked) as f:
        out["still_a_file"] = f.read()
    # The group still works after all of that.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = str(int(t.item()))
    return out


def test_bad_input_raises_the_same_clear_error_everywhere(tmp_path) -> None:
    results = run_ranks(_bad_inputs, 2, args=(str(tmp_path),), timeout=300, pg_timeout=60)
    for case in ("rows", "missing", "sharders"):
        messages = {r[case] for r in results}
        assert len(messages) == 1, messages  # the same message on every rank
        message = messages.pop()
        assert message.startswith("StartupMismatchError"), message
        assert "ranks [0]" in message and "ranks [1]" in message, message
    for r in results:
        assert "PlanMismatchError" in r["bad_plan"] and "'t4'" in r["bad_plan"], r["bad_plan"]
        assert r["corrupt"] == "ok" and r["corrupt_warned"] == "True"
        assert r["unwritable"] == "ok" and r["unwritable_warned"] == "True"
        assert r["still_a_file"] == "not a directory"
        assert r["after"] == "2"


def _dies_during_setup() -> None:
    import os

    import torch.distributed as dist

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model

    if dist.get_rank() == 1:
        os._exit(7)
    fastinit.setup(build_model(ModelSpec(num_tables=4), device="meta"), seed=1)


def test_a_dead_rank_makes_the_others_fail_clearly() -> None:
    results = run_ranks(
        _dies_during_setup,
        2,
        timeout=120,
        pg_timeout=20,
        env={"FASTINIT_COLLECTIVE_TIMEOUT": "20"},
        return_failures=True,
    )
    assert results[1].exitcode == 7
    assert results[0].error is not None
    assert "StartupError" in results[0].error and "rank 0" in results[0].error, results[0].error


def _setup_with_trace_dir() -> int:
    import fastinit
    from fastinit.testing.models import ModelSpec, build_model

    fastinit.setup(build_model(ModelSpec(num_tables=2), device="meta"), seed=1)
    return 0


def test_trace_dir_knob_makes_setup_write_its_trace(tmp_path) -> None:
    from fastinit.trace import read_jsonl

    run_ranks(_setup_with_trace_dir, 2, env={"FASTINIT_TRACE_DIR": str(tmp_path)}, timeout=120)
    for rank in (0, 1):
        events = read_jsonl(str(tmp_path / f"trace-rank{rank}.jsonl"))
        summary = events[-1]
        assert summary["kind"] == "summary"
        assert summary["c10d_ops"] == {"allgather_": 1, "broadcast_": 1, "allreduce_": 1}
        assert "fastinit.setup" in summary["spans_s"]
