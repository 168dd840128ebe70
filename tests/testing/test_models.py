"""Reference models, explicit plans for all seven sharding types, and batches."""

from __future__ import annotations

import pytest
import torch

from fastinit.testing.models import (
    SHARDING_TYPES,
    ModelSpec,
    build_model,
    build_plan,
    make_batch,
    table_configs,
)


def test_spec_is_deterministic_and_varied() -> None:
    spec = ModelSpec(num_tables=6, num_weighted_tables=2, num_ec_tables=3, fp16_every=3)
    a, b = table_configs(spec), table_configs(spec)
    assert [c.name for c in a["ebc"]] == [c.name for c in b["ebc"]]
    all_tables = a["ebc"] + a["wbc"] + a["ec"]
    assert len({c.num_embeddings for c in all_tables}) > 1
    assert {c.data_type.name for c in all_tables} == {"FP32", "FP16"}
    assert {c.embedding_dim for c in a["ec"]} == {spec.ec_dim}


@pytest.mark.parametrize("bad", [{"num_tables": 0}, {"dims": (6,)}, {"over_arch": (8, 2)}])
def test_spec_rejects_bad_input(bad: dict) -> None:
    with pytest.raises(ValueError):
        ModelSpec(**bad)


def test_unsharded_model_trains_on_a_batch() -> None:
    spec = ModelSpec(num_tables=3, num_weighted_tables=2, num_ec_tables=2, fp16_every=0)
    model = build_model(spec)
    batch = make_batch(spec, batch_size=16, seed=1)
    for kjt, configs in ((batch.sparse, table_configs(spec)["ebc"] + table_configs(spec)["ec"]),):
        for c in configs:
            ids = kjt[c.feature_names[0]].values()
            assert ids.numel() == 0 or int(ids.max()) < c.num_embeddings
    assert (
        batch.weighted is not None
        and batch.weighted.weights().numel() == batch.weighted.values().numel()
    )
    loss, (_, logits, labels) = model(batch)
    assert logits.shape == labels.shape == (16,)
    loss.backward()
    assert model.over_arch[0].weight.grad is not None
    # Same seed, same batch; another seed, another batch.
    assert torch.equal(make_batch(spec, 16, seed=1).dense, batch.dense)
    assert not torch.equal(make_batch(spec, 16, seed=2).dense, batch.dense)


def test_build_plan_covers_all_seven_types() -> None:
    spec = ModelSpec(num_tables=7, num_ec_tables=7)
    model = build_model(spec, device="meta")
    plan = build_plan(model, list(SHARDING_TYPES), world_size=4, local_world_size=2)
    for path in ("sparse.ebc", "sparse.ec"):
        module_plan = plan.plan[path]
        assert sorted(ps.sharding_type for ps in module_plan.values()) == sorted(SHARDING_TYPES)
        for ps in module_plan.values():
            if ps.sharding_type == "data_parallel":
                assert ps.sharding_spec is None
            else:
                assert ps.compute_kernel == "fused"
                assert ps.sharding_spec is not None and ps.ranks
    twrw = next(
        ps for ps in plan.plan["sparse.ebc"].values() if ps.sharding_type == "table_row_wise"
    )
    assert twrw.ranks in ([0, 1], [2, 3])
    with pytest.raises(ValueError):
        build_plan(model, "table_row_wise", world_size=4, local_world_size=3)
