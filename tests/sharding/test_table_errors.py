"""An error while building a table's ShardedTensor reads as stock's, on the installed TorchRec.

TorchRec 1.9 wraps it as "Failed to initialize sharded tensor for table '<name>': ..." (its own
test, ``test_initialize_torch_state_error_includes_table_name``, injects the fault by replacing
torch's ``ShardedTensor._init_from_local_shards_and_global_metadata``); 1.8.0 raises torch's error
as is. fastinit's sharded modules must give the same message as stock's in both.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")


def _error_of(which: str) -> str:
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    spec = ModelSpec(num_tables=2, num_ec_tables=0, num_weighted_tables=0)
    plan = build_plan(build_model(spec, device="meta"), "table_wise", dist.get_world_size())
    if which == "stock":
        dmp = stock_setup(build_model(spec, device="meta"), plan)
    else:
        dmp = fastinit.setup(build_model(spec, device="meta"), plan=plan, seed=1)
    ebc = dict(dmp.module.named_modules())["sparse.ebc"]
    original = ShardedTensor.__dict__["_init_from_local_shards_and_global_metadata"]

    calls = 0

    def fail(cls: type, *args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls > 1:  # as TorchRec's test: the second table's
            raise RuntimeError("Number of local shards (0) does not match")
        return original.__func__(cls, *args, **kwargs)

    ShardedTensor._init_from_local_shards_and_global_metadata = classmethod(fail)  # type: ignore[assignment]
    try:
        ebc._initialize_torch_state()
    except RuntimeError as e:
        return str(e)
    finally:
        ShardedTensor._init_from_local_shards_and_global_metadata = original  # type: ignore[assignment]
    return "no error"


@pytest.mark.timeout(300)
def test_sharded_tensor_errors_read_as_stocks() -> None:
    from fastinit.testing.dist import run_ranks

    (stock,) = run_ranks(_error_of, 1, args=("stock",), timeout=240)
    (fast,) = run_ranks(_error_of, 1, args=("fastinit",), timeout=240)
    assert "Number of local shards (0) does not match" in stock
    assert fast == stock  # 1.9.2 names the table on its wrapped path; this model's is not it


def _state_under_mock(which: str) -> tuple[list[str], list[str]]:
    """Build with ``ShardedEmbeddingBagCollection._initialize_torch_state`` mocked out (as
    TorchRec's ``test_initialize_torch_state_error_includes_table_name`` does), then run it."""
    from unittest import mock

    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    spec = ModelSpec(num_tables=2, num_ec_tables=0, num_weighted_tables=0)
    plan = build_plan(build_model(spec, device="meta"), "table_wise", dist.get_world_size())
    with mock.patch.object(
        ShardedEmbeddingBagCollection, "_initialize_torch_state", lambda self, **kwargs: None
    ):
        if which == "stock":
            dmp = stock_setup(build_model(spec, device="meta"), plan)
        else:
            dmp = fastinit.setup(build_model(spec, device="meta"), plan=plan, seed=1)
    ebc = dict(dmp.module.named_modules())["sparse.ebc"]
    before = sorted(getattr(ebc, "_model_parallel_name_to_sharded_tensor", {}))
    ebc._initialize_torch_state()
    return before, sorted(ebc._model_parallel_name_to_sharded_tensor)


@pytest.mark.timeout(300)
def test_a_mocked_out_initialize_torch_state_is_honoured_as_stock_does() -> None:
    from fastinit.testing.dist import run_ranks

    (stock,) = run_ranks(_state_under_mock, 1, args=("stock",), timeout=240)
    (fast,) = run_ranks(_state_under_mock, 1, args=("fastinit",), timeout=240)
    assert stock[1]  # the tables' ShardedTensors once the method runs
    assert fast == stock
