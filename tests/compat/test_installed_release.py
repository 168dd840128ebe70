"""fastinit's copies of TorchRec code do what the INSTALLED release's code does (1.8.0 or 1.9.x).

Each test runs the stock code and fastinit's on the same inputs and compares: never a version
literal. On a release without the feature (1.8.0 has no ``mark_data_parallel_skip_grad_sync``,
no ``stash_weights`` on options, no ``tpu`` topology) the comparison still runs and both agree
on its absence; where the feature cannot even be set up, the test is skipped.
"""

from __future__ import annotations

import copy
import logging
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner import shard_estimators as stock_estimators
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlannerError,
    StorageReservation,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import KeyValueParams
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from fastinit.planner import FastPlanner, enumerators, shard_estimators
from fastinit.planner import _torchrec as _tr
from fastinit.testing.dist import run_ranks

logging.getLogger("torchrec").setLevel(logging.ERROR)

MB = 1024 * 1024


def _ebc(n: int = 4, rows: int = 1000, **config: Any) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=16,
            num_embeddings=rows + 10 * i,
            feature_names=[f"f{i}"],
            **(config if i % 2 == 0 else {}),
        )
        for i in range(n)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _topology(**kwargs: Any) -> Topology:
    return Topology(world_size=2, local_world_size=2, compute_device="cuda", **kwargs)


# ---- the storage estimator's key_value_params ---------------------------------------------------


def test_storage_estimator_reads_key_value_params_as_the_installed_one(monkeypatch: Any) -> None:
    """1.9 prefers the sharding option's own ``key_value_params`` over the constraint's (1.8.0:
    the constraint's only). Every ``calculate_shard_storages`` call of each estimator is
    recorded and compared."""
    module = _ebc()
    constraints = {
        f"t{i}": ParameterConstraints(key_value_params=KeyValueParams(ssd_rocksdb_shards=1))
        for i in range(2)
    }
    options = EmbeddingEnumerator(
        topology=_topology(), batch_size=64, constraints=constraints, estimator=[]
    ).enumerate(module, get_default_sharders())
    for k, so in enumerate(options):
        so.key_value_params = KeyValueParams(ssd_rocksdb_shards=100 + k) if k % 3 else None
    real = stock_estimators.calculate_shard_storages
    seen: list[Any] = []

    def recording(**kwargs: Any) -> Any:
        seen.append(kwargs["key_value_params"])
        return real(**kwargs)

    monkeypatch.setattr(stock_estimators, "calculate_shard_storages", recording)
    monkeypatch.setattr(shard_estimators, "calculate_shard_storages", recording)
    sharders = get_default_sharders()
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    data_map = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    results = []
    for estimator in (
        EmbeddingStorageEstimator(topology=_topology(), constraints=constraints),
        shard_estimators.MemoStorageEstimator(topology=_topology(), constraints=constraints),
    ):
        seen.clear()
        mine = copy.deepcopy(options)
        estimator.estimate(mine, data_map)
        results.append((list(seen), [[s.storage for s in so.shards] for so in mine]))
    (stock_kv, stock_storage), (fast_kv, fast_storage) = results
    # the memo computes equal inputs once: compare the distinct values, then the storages
    assert {repr(v) for v in fast_kv} == {repr(v) for v in stock_kv}
    assert fast_storage == stock_storage


# ---- the enumerator's stash_weights -------------------------------------------------------------


def test_enumerator_passes_stash_weights_as_the_installed_one() -> None:
    module = _ebc(n=6, stash_weights=True)
    sharders = get_default_sharders()

    def described(enumerator: Any) -> list[tuple[Any, ...]]:
        return [
            (so.name, so.sharding_type, so.compute_kernel, getattr(so, "stash_weights", "absent"))
            for so in enumerator.enumerate(module, sharders)
        ]

    stock = described(EmbeddingEnumerator(topology=_topology(), batch_size=64))
    fast = described(enumerators.FastEnumerator(topology=_topology(), batch_size=64))
    assert fast == stock
    if hasattr(EmbeddingEnumerator, "_get_stash_weights"):
        assert {s[3] for s in stock} == {True, False}  # the case shows the flag at all


# ---- the "no plan fits" message -----------------------------------------------------------------


class _NoPercentage(StorageReservation):
    """A storage reservation with no ``_percentage`` (1.8.0's message reads it anyway)."""

    def reserve(self, topology: Topology, *args: Any, **kwargs: Any) -> Topology:
        self._last = copy.deepcopy(topology)
        return self._last

    @property
    def last_reserved_topology(self) -> Topology | None:
        return getattr(self, "_last", None)


def _reservations() -> list[Any]:
    from torchrec.distributed.planner import storage_reservations as sr

    out: list[Any] = [_NoPercentage, lambda: sr.FixedPercentageStorageReservation(0.1)]
    sku = getattr(sr, "SKUAwareStorageReservation", None)
    if sku is not None:  # 1.9: its own wording
        out.append(lambda: sku(margin_bytes=MB))
        out.append(lambda: sku(margin_bytes=MB, model_base_bytes=2 * MB))
    return out


@pytest.mark.parametrize("reservation", range(4))
def test_no_plan_message_is_the_installed_text(reservation: int) -> None:
    makers = _reservations()
    if reservation >= len(makers):
        pytest.skip("the installed TorchRec has no SKUAwareStorageReservation")
    results = []
    for cls in (FastPlanner, EmbeddingShardingPlanner):
        planner = cls(
            topology=_topology(hbm_cap=16 * MB, ddr_cap=MB),
            storage_reservation=makers[reservation](),
        )
        try:
            results.append(planner.plan(_ebc(n=8, rows=1_000_000), get_default_sharders()))
        except Exception as e:  # compared: same type, same text
            results.append(e)
    fast, stock = results
    assert isinstance(stock, Exception), stock
    assert type(fast) is type(stock)
    # the text may name an object by its address ("at 0x7f..."), which differs between runs
    assert _no_addresses(str(fast)) == _no_addresses(str(stock))
    if isinstance(stock, PlannerError):
        assert "Planner evaluated" in str(stock)  # the "no plan" text, not an earlier error


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", text)


# ---- where the planner sees the compute device (1.9 adds tpu) -----------------------------------


def test_topology_devices_are_the_installed_ones() -> None:
    for device in ("cpu", "cuda", "mtia", "tpu", "xpu", "meta"):
        try:
            Topology(world_size=1, compute_device=device)
        except (AssertionError, ValueError):
            accepted = False
        else:
            accepted = True
        assert (device in _tr.topology_compute_devices()) == accepted, device


def test_search_space_is_the_installed_planners() -> None:
    if not hasattr(EmbeddingShardingPlanner, "get_search_space"):
        pytest.skip("the installed TorchRec's planner keeps no search space")
    spaces = []
    for cls in (FastPlanner, EmbeddingShardingPlanner):
        planner = cls(topology=_topology())
        planner.plan(_ebc(n=4), get_default_sharders())
        spaces.append(
            [
                (so.name, so.sharding_type, so.compute_kernel, [s.size for s in so.shards])
                for so in planner.get_search_space()  # type: ignore[attr-defined]
            ]
        )
    assert spaces[0] == spaces[1]


# ---- init_data_parallel: mark_data_parallel_skip_grad_sync and DDP's device_ids -----------------


def _wrapped(stock_method: Any, fast_method: Any, sharding_cls: Any, attr: str) -> None:
    """Run the stock and fastinit ``init_data_parallel`` on a stand-in module with one
    data-parallel lookup, DDP replaced by a recorder: same wrapping, same ``device_ids``."""
    import torch.nn.parallel as parallel
    from torchrec.distributed import embedding, embeddingbag

    class Recorder:
        def __init__(self, module: Any, device_ids: Any = None, **kwargs: Any) -> None:
            self.device_ids = device_ids

    from torchrec.modules import embedding_modules

    # the flag exists where the installed constructors set it (1.9); absent in 1.8.0
    has_flag = hasattr(embedding_modules, "mark_data_parallel_skip_grad_sync")
    sharding = object.__new__(sharding_cls)
    for device_type in ("cpu", "cuda", "mtia", "tpu"):
        for skip in (False, True) if has_flag else (None,):
            got = []
            for method in (stock_method, fast_method):
                module = SimpleNamespace(
                    _lookups=[object()],
                    _env=SimpleNamespace(process_group=None),
                    _device=SimpleNamespace(type=device_type),
                    **{attr: [sharding] if attr == "_embedding_shardings" else {"dp": sharding}},
                )
                if skip is not None:
                    module._skip_data_parallel_grad_sync = skip
                saved = (parallel.DistributedDataParallel, embedding.DistributedDataParallel)
                saved_bag = embeddingbag.DistributedDataParallel
                parallel.DistributedDataParallel = Recorder  # type: ignore[misc]
                embedding.DistributedDataParallel = Recorder  # type: ignore[misc]
                embeddingbag.DistributedDataParallel = Recorder  # type: ignore[misc]
                try:
                    method(module)
                finally:
                    parallel.DistributedDataParallel, embedding.DistributedDataParallel = saved
                    embeddingbag.DistributedDataParallel = saved_bag
                lookup = module._lookups[0]
                got.append(lookup.device_ids if isinstance(lookup, Recorder) else "unwrapped")
            assert got[0] == got[1], (device_type, skip, got)


def test_init_data_parallel_is_the_installed_ones() -> None:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
    from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding

    from fastinit.sharding.sharders import (
        FastShardedEmbeddingBagCollection,
        FastShardedEmbeddingCollection,
    )

    _wrapped(
        ShardedEmbeddingBagCollection.init_data_parallel,
        FastShardedEmbeddingBagCollection.init_data_parallel,
        DpPooledEmbeddingSharding,
        "_embedding_shardings",
    )
    _wrapped(
        ShardedEmbeddingCollection.init_data_parallel,
        FastShardedEmbeddingCollection.init_data_parallel,
        DpSequenceEmbeddingSharding,
        "_sharding_type_to_sharding",
    )


def _skip_grad_sync() -> dict[str, Any]:
    """Stock DMP and ``fastinit.setup`` on a model whose EBC and EC are marked
    ``mark_data_parallel_skip_grad_sync``: which data-parallel lookups DDP wraps."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.modules.embedding_modules import mark_data_parallel_skip_grad_sync

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    spec = ModelSpec(num_tables=3, num_ec_tables=2, rows=64)
    types = ["data_parallel", "table_wise", "data_parallel"]
    out: dict[str, Any] = {}
    for name, make in (
        ("stock", lambda m, p: stock_setup(m, p)),
        ("fast", lambda m, p: fastinit.setup(m, plan=p, seed=3)),
    ):
        model = build_model(spec, device="meta")
        mark_data_parallel_skip_grad_sync(model.sparse.ebc)
        plan = build_plan(model, types, 2)
        dmp = make(model, plan)
        sparse = dmp.module.sparse
        out[name] = {
            part: [
                isinstance(lookup, DistributedDataParallel)
                for lookup in getattr(sparse, part)._lookups
            ]
            for part in ("ebc", "ec")
        }
    return out


def test_skip_grad_sync_leaves_data_parallel_lookups_unwrapped_as_stock() -> None:
    pytest.importorskip("torchrec.modules.embedding_modules").__dict__.get(
        "mark_data_parallel_skip_grad_sync"
    ) or pytest.skip("the installed TorchRec has no mark_data_parallel_skip_grad_sync")
    for out in run_ranks(_skip_grad_sync, 2, timeout=300):
        assert out["fast"] == out["stock"], out
        assert True not in out["stock"]["ebc"]  # marked: unwrapped
        assert True in out["stock"]["ec"]  # not marked: wrapped
