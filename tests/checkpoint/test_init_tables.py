"""``fastinit.setup(init_tables=False)``: the sharded tables left for a checkpoint load.

A restarted job loads its checkpoint over every table right after ``setup``; the tables' random
initialisation is thrown away. With ``init_tables=False`` it is not made: the load fills the
tables, :func:`fastinit.init_tables` gives them ``setup``'s values where there is nothing to
load, and until one of the two the model refuses to train or be saved, on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_checkpoint import PLAN_A, _build, _diff, _error_of, _local, _train

from fastinit.testing.dist import run_ranks

# every sharding type of PLAN_A, the data-parallel t4 initialised by setup either way
_PENDING = {"t0", "t1", "t2", "t3", "w0", "e0", "e1"}


def _tables_rank(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from test_checkpoint import SPEC

    import fastinit
    from fastinit import checkpoint
    from fastinit.checkpoint.loading import flat_target
    from fastinit.tables import _weight_keys, tables_loaded
    from fastinit.testing.models import ModelSpec, make_batch

    out: dict[str, Any] = {}
    reference, ref_opts = _build(PLAN_A, seed=7)
    fresh = _local(reference, ref_opts)

    # Left pending: every sharded table, not the data-parallel one.
    model, opts = _build(PLAN_A, seed=7, init_tables=False)
    pending = fastinit.pending_tables(model)
    out["pending"] = sorted(name.rsplit(".", 1)[-1] for name in pending)
    keys = set(flat_target(model, opts))
    out["unnamed"] = [
        n for n in pending if not keys.intersection(_weight_keys(n.rsplit(".", 1)[0] + ".", n.rsplit(".", 1)[1]))
    ]  # fmt: skip
    local = _local(model, opts)
    out["dp_equal"] = _diff(
        {k: v for k, v in fresh.items() if ".t4." in k}, {k: v for k, v in local.items() if ".t4." in k}
    )  # fmt: skip
    batch = make_batch(ModelSpec(**SPEC), 8, seed=dist.get_rank())
    out["forward"] = _error_of(lambda: model(batch))
    out["save"] = _error_of(lambda: checkpoint.save(f"{root}/refused", model, opts, blocking=True))

    # init_tables: setup's values, bit for bit; then it trains.
    out["initialised"] = sorted(n.rsplit(".", 1)[-1] for n in fastinit.init_tables(model))
    out["init_diff"] = _diff(fresh, _local(model, opts))
    out["pending_after_init"] = fastinit.pending_tables(model)
    out["forward_after_init"] = _error_of(lambda: model(batch))

    # A load fills them: bit-equal to the trained state saved.
    _train(reference, ref_opts, seed=11)
    trained = _local(reference, ref_opts)
    checkpoint.save(f"{root}/ck", reference, ref_opts, blocking=True)
    loaded, loaded_opts = _build(PLAN_A, seed=9, init_tables=False)
    report = checkpoint.load(f"{root}/ck", loaded, loaded_opts)
    out["load_initialised"] = report.initialised
    out["load_diff"] = _diff(trained, _local(loaded, loaded_opts))
    out["pending_after_load"] = fastinit.pending_tables(loaded)
    out["forward_after_load"] = _error_of(lambda: loaded(batch))

    # A table a load did not write (a stock checkpoint without it): setup's values for it.
    other, other_opts = _build(PLAN_A, seed=7, init_tables=False)
    t0 = next(n for n in fastinit.pending_tables(other) if n.endswith(".t0"))
    prefix, name = t0.rsplit(".", 1)
    out["missing_initialised"] = tables_loaded(other, set(_weight_keys(prefix + ".", name)))
    mine = _local(other, other_opts)
    out["missing_diff"] = _diff(
        {k: v for k, v in fresh.items() if ".t0." in k}, {k: v for k, v in mine.items() if ".t0." in k}
    )  # fmt: skip
    out["pending_after_missing"] = fastinit.pending_tables(other)
    return out


@pytest.mark.timeout(600)
def test_tables_left_for_a_load_are_filled_by_it_or_initialised_as_setup_would(
    tmp_path: Any,
) -> None:
    results = run_ranks(_tables_rank, 2, args=(str(tmp_path),), timeout=540)
    for out in results:
        assert out["pending"] == sorted(_PENDING) and out["unnamed"] == [], out
        assert out["dp_equal"] == [], out
        for what in ("forward", "save"):
            assert "init_tables=False) left 7 table(s) uninitialised" in out[what], (what, out)
            assert "fastinit.init_tables(model)" in out[what], (what, out)
        assert out["save"].startswith("CheckpointError") and "nothing was written" in out["save"]
        assert out["forward"].startswith("StartupError"), out
        assert out["initialised"] == sorted(_PENDING), out
        assert out["init_diff"] == [] and out["pending_after_init"] == [], out
        assert out["forward_after_init"] == "no error", out
        assert out["load_initialised"] == [] and out["load_diff"] == [], out
        assert out["pending_after_load"] == [] and out["forward_after_load"] == "no error", out
        assert out["missing_initialised"][0].endswith(".t0"), out
        assert out["missing_diff"] == [] and out["pending_after_missing"] == [], out


def _mismatch_rank() -> str:
    import torch.distributed as dist

    return _error_of(lambda: _build(PLAN_A, seed=1, init_tables=dist.get_rank() == 0))


@pytest.mark.timeout(300)
def test_init_tables_must_be_the_same_on_every_rank() -> None:
    results = run_ranks(_mismatch_rank, 2, timeout=240)
    for out in results:
        assert out.startswith("StartupMismatchError") and "init_tables=False on ranks [1]" in out
