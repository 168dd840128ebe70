"""fastinit.pg: only the node groups a plan needs, only on their members, no barriers.

The multi-rank tests run real gloo ranks and count at the dispatcher and the store (the tracer), so
what is asserted is what c10d did, not what fastinit says it did. Each spawn batches many checks:
stock and fastinit side by side in the same processes, then identical training.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from fastinit.testing.dist import run_ranks

# TWRW and GRID need the node groups; the others ride along to check they add nothing.
TYPES = ["table_row_wise", "grid_shard", "table_wise", "row_wise", "data_parallel"]
NO_GROUP_TYPES = ["data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise"]
WORLD = 4
_KEEP_ALIVE: list[Any] = []


def _store_ops(n: int) -> int:
    """Store operations one member makes to create a gloo group of n ranks (measured: 1 set, then
    a wait and a get per member, itself included)."""
    return 2 * n + 1


def _flat_state(model: Any) -> dict[str, Any]:
    """Every state_dict entry as this rank's plain tensors (local shards of sharded tensors)."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "local_shards"):
            for i, shard in enumerate(value.local_shards()):
                out[f"{key}#{i}"] = shard.tensor.detach().clone()
        elif hasattr(value, "to_local"):
            out[key] = value.to_local().detach().clone()
        else:
            out[key] = value.detach().clone()
    return out


def _train(model: Any, spec: Any, steps: int) -> tuple[list[float], dict[str, Any]]:
    import itertools

    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.streamable import Pipelineable

    from fastinit.testing.models import Batch, batches

    if not issubclass(Batch, Pipelineable):  # the committed Batch has the methods, not the base
        Pipelineable.register(Batch)
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.SGD(dense, lr=0.1)
    pipeline = TrainPipelineSparseDist(model, optimizer, device=torch.device("cpu"))
    data = itertools.islice(batches(spec, 16, seed=dist.get_rank()), steps + 2)
    losses = [float(pipeline.progress(data)[0]) for _ in range(steps)]
    return losses, _flat_state(model)


def _node_pgs_in(model: Any) -> tuple[set[int], int]:
    """ids of the intra/cross groups TorchRec's TWRW/GRID shardings inside ``model`` hold, and how
    many sharded modules hold such shardings."""
    ids: set[int] = set()
    modules = 0
    for module in model.modules():
        found = False
        for sharding in getattr(module, "_embedding_shardings", None) or []:
            for attr in ("_intra_pg", "_cross_pg"):
                group = getattr(sharding, attr, None)
                if group is not None:
                    ids.add(id(group))
                    found = True
        modules += found
    return ids, modules


def _reinit_world() -> None:
    """Destroy the default group and join a new one on a fresh store, traced like the first.

    A fresh store, so that no key of the first default group is read as one of the second's. The
    tracer's store is a Python object that C++ calls back into: it must outlive the groups using it
    (when it is collected, torch reports "fn INTERNAL ASSERT FAILED ... Not implemented").
    """
    from datetime import timedelta

    import torch.distributed as dist

    from fastinit import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    timeout = timedelta(seconds=30)
    server = None
    port = [0]
    if rank == 0:
        server = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        port = [server.port]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    store: Any = server or dist.TCPStore(
        "127.0.0.1", port[0], world_size, is_master=False, timeout=timeout
    )
    tracer = trace.active()
    assert tracer is not None
    store = tracer.wrap_store(store)
    _KEEP_ALIVE.append(store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _side_by_side(types: list[str], extras: bool) -> dict[str, Any]:
    """On every rank: stock DMP, then fastinit.pg + DMP, then identical training; counts of each.

    With ``extras``, then: a second default group in the same process, and a member that never
    comes (:func:`_absent_member`).
    """
    import torch
    import torch.distributed as dist

    import fastinit.pg as fpg
    from fastinit import trace
    from fastinit.pg import _torchrec
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup

    tracer = trace.active()
    assert tracer is not None
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # Two sharded modules (types cycle on into the weighted EBC: TWRW and GRID in both).
    spec = ModelSpec(num_tables=len(types), num_weighted_tables=2, rows=96)
    plan = build_plan(build_model(spec, device="meta"), types, world_size)
    out: dict[str, Any] = {"needs": fpg.plan_needs_node_groups(plan)}

    # Stock: TorchRec creates every node group on every rank, then 2 barriers.
    _torchrec.reset_node_groups()
    with tracer.window() as out["stock_dmp"]:
        stock = stock_setup(build_model(spec, device="meta"), plan)

    # TorchRec's groups are already there with the right ranks: adopted, nothing created.
    with tracer.window() as out["adopt"]:
        fpg.prepare_for_plan(plan)
    out["adopt_method"] = fpg.node_groups().method

    # fastinit from scratch in the same processes.
    _torchrec.reset_node_groups()
    fpg.clear_cache()
    with tracer.window() as out["prepare"]:
        fpg.prepare_for_plan(plan)
    groups = fpg.node_groups()
    out["method"], out["created"] = groups.method, groups.created
    out["intra_ranks"] = dist.get_process_group_ranks(groups.intra)
    out["cross_ranks"] = dist.get_process_group_ranks(groups.cross)
    out["intra_is_world"] = groups.intra is dist.group.WORLD
    out["cross_is_world"] = groups.cross is dist.group.WORLD
    out["installed"] = _torchrec.installed_node_groups() == (groups.intra, groups.cross)
    out["names"] = (groups.intra.group_name, groups.cross.group_name)
    # Created with the start-up timeout, then given torch's default, like TorchRec's own groups.
    out["timeouts_s"] = [
        g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for g in (groups.intra, groups.cross)
        if g is not dist.group.WORLD
    ]
    with tracer.window() as out["again"]:
        fpg.prepare_for_plan(plan)  # a second setup call, another sharded module: cached
        again = fpg.ensure_node_groups()
    out["same_objects"] = again == (groups.intra, groups.cross)
    with tracer.window() as out["fast_dmp"]:
        fast = stock_setup(build_model(spec, device="meta"), plan)
    held, out["node_sharded_modules"] = _node_pgs_in(fast)
    out["shardings_use_ours"] = held == {id(groups.intra), id(groups.cross)}

    # A plan without TWRW/GRID: no group, no store op, no collective, torchrec globals untouched.
    no_group_plan = build_plan(build_model(spec, device="meta"), NO_GROUP_TYPES, world_size)
    _torchrec.reset_node_groups()
    with tracer.window() as out["no_group"]:
        fpg.prepare_for_plan(no_group_plan)
    out["no_group_needs"] = fpg.plan_needs_node_groups(no_group_plan)
    out["no_group_installed"] = _torchrec.installed_node_groups()
    _torchrec.install_node_groups(groups.intra, groups.cross)

    # Identical training: same weights, same batches, same optimizers, 3 pipelined steps.
    fast.load_state_dict(stock.state_dict())
    before = _flat_state(stock)
    stock_losses, stock_state = _train(stock, spec, 3)
    fast_losses, fast_state = _train(fast, spec, 3)
    out["losses"] = (stock_losses, fast_losses)
    out["state_keys_equal"] = sorted(stock_state) == sorted(fast_state)
    out["state_mismatch"] = [
        k for k in stock_state if k in fast_state and not torch.equal(stock_state[k], fast_state[k])
    ]
    # Training moved the weights (dense and embedding), so equal states mean equal updates.
    out["changed"] = sorted(k for k in before if not torch.equal(before[k], stock_state[k]))

    if extras:
        # A second default group in the same process: the cache must not hand out stale groups.
        old = (groups.intra, groups.cross)
        _reinit_world()
        with tracer.window() as out["reinit"]:
            fpg.prepare_for_plan(plan)
        fresh = fpg.node_groups()
        out["reinit_fresh"] = all(a is not b for a, b in zip(old, (fresh.intra, fresh.cross)))
        out["reinit_installed"] = _torchrec.installed_node_groups() == (fresh.intra, fresh.cross)
        total = torch.ones(1) * (rank + 1)
        dist.all_reduce(total, group=fresh.intra)
        out["reinit_intra_sum"] = float(total)
        out["absent"] = _absent_member()
    return out


def _check_side_by_side(results: list[dict[str, Any]], local: int) -> None:
    hosts = WORLD // local
    # Member-only groups are named from local state: the members of each group must agree.
    names: dict[tuple[int, ...], set[str]] = {}
    for r in results:
        names.setdefault(tuple(r["intra_ranks"]), set()).add(r["names"][0])
        names.setdefault(tuple(r["cross_ranks"]), set()).add(r["names"][1])
    assert all(len(n) == 1 for n in names.values()), names
    for rank, r in enumerate(results):
        where = f"rank {rank}, LOCAL_WORLD_SIZE={local}"
        intra = list(range(rank // local * local, (rank // local + 1) * local))
        cross = list(range(rank % local, WORLD, local))
        assert r["needs"], where

        # Stock, measured in the same processes: every group on every rank, 2 barriers.
        stock = r["stock_dmp"]
        assert stock["new_groups"] == hosts + local, where
        assert stock["member_groups"] == 2, where
        assert stock["barriers"] == 2, where

        # Adopting TorchRec's existing groups costs nothing.
        assert r["adopt_method"] == "adopted", where
        assert (r["adopt"]["new_groups"], r["adopt"]["store_total"], r["adopt"]["c10d_total"]) == (
            0,
            0,
            0,
        ), where

        # fastinit: only this rank's groups, member-only, no collective, no barrier.
        prep = r["prepare"]
        assert r["method"] == "new_group", where
        assert prep["barriers"] == 0 and prep["c10d_total"] == 0, (where, prep["c10d_ops"])
        made = [g for g in prep["groups"]]
        assert all(g["member"] and g["local_sync"] for g in made), (where, made)
        expected = [g for g in (intra, cross) if g != list(range(WORLD))]
        assert [g["ranks"] for g in made] == expected, (where, made)
        assert prep["new_groups"] == prep["member_groups"] == r["created"] == len(expected), where
        assert prep["store_total"] == sum(_store_ops(len(g)) for g in expected), (
            where,
            prep["store_ops"],
        )
        assert r["intra_ranks"] == intra and r["cross_ranks"] == cross, where
        assert r["intra_is_world"] == (local == WORLD), where
        assert r["cross_is_world"] == (local == 1), where
        assert r["installed"], where
        assert r["timeouts_s"] == [1800.0] * len(expected), (where, r["timeouts_s"])

        # Repeated calls reuse; DMP right after creates nothing and its shardings hold our groups.
        assert r["same_objects"], where
        assert (r["again"]["new_groups"], r["again"]["store_total"], r["again"]["c10d_total"]) == (
            0,
            0,
            0,
        ), where
        dmp = r["fast_dmp"]
        assert dmp["new_groups"] == 0 and dmp["barriers"] == 0, (where, dmp["groups"])
        assert r["shardings_use_ours"] and r["node_sharded_modules"] == 2, where
        # The same collectives as stock minus its 2 barriers, and minus the 2 broadcasts of
        # init_collective_validation, which runs once per process (the stock DMP ran it).
        expected_ops = {k: v for k, v in stock["c10d_ops"].items() if k != "barrier"}
        expected_ops["broadcast_"] -= 2
        assert dmp["c10d_ops"] == expected_ops, (where, dmp["c10d_ops"], stock["c10d_ops"])

        # No TWRW/GRID: nothing at all.
        none = r["no_group"]
        assert not r["no_group_needs"], where
        assert none["new_groups"] == none["store_total"] == none["c10d_total"] == 0, where
        assert r["no_group_installed"] == (None, None), where

        # Same training, bit for bit.
        stock_losses, fast_losses = r["losses"]
        assert stock_losses == fast_losses, (where, r["losses"])
        assert r["state_keys_equal"] and not r["state_mismatch"], (where, r["state_mismatch"])
        changed = r["changed"]
        assert any("embedding" in k for k in changed), (where, changed)
        assert any("over_arch" in k for k in changed), (where, changed)


ABSENT_TIMEOUT_S = 2


def _absent_member() -> dict[str, Any]:
    """Ranks 0-2 create their node groups afresh; rank 3 never does (it stands for a hung or dead
    peer) until the others have given up, so no rank needs killing."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import fastinit.pg as fpg
    from fastinit import knobs
    from fastinit.pg import _torchrec

    rank = dist.get_rank()
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    if rank == WORLD - 1:
        store.wait([f"test-pg-gave-up/{r}" for r in range(WORLD - 1)])
        return {"error": None, "elapsed": 0.0}
    fpg.clear_cache()
    _torchrec.reset_node_groups()  # else the installed groups are adopted and nothing is created
    t0 = time.monotonic()
    error = None
    try:
        with knobs.override(FASTINIT_COLLECTIVE_TIMEOUT=str(ABSENT_TIMEOUT_S)):
            fpg.ensure_node_groups(local_size=2)
    except fpg.NodeGroupError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        store.set(f"test-pg-gave-up/{rank}", "1")
    return {"error": error, "elapsed": time.monotonic() - t0}


def _spawn(local: int, extras: bool) -> list[dict[str, Any]]:
    return run_ranks(
        _side_by_side,
        WORLD,
        args=(TYPES, extras),
        trace=True,
        local_world_size=local,
        timeout=150,
        pg_timeout=60,
    )


@pytest.fixture(scope="module")
def two_hosts() -> list[dict[str, Any]]:
    """One spawn of 4 ranks, 2 per host, shared by the tests below (each spawn costs seconds)."""
    return _spawn(2, extras=True)


def test_side_by_side_with_stock_two_hosts(two_hosts: list[dict[str, Any]]) -> None:
    _check_side_by_side(two_hosts, 2)


def test_side_by_side_with_stock_one_host() -> None:
    _check_side_by_side(_spawn(4, extras=False), 4)


def test_new_default_group_gets_new_node_groups(two_hosts: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(two_hosts):
        reinit = r["reinit"]
        assert r["reinit_fresh"] and r["reinit_installed"], rank
        assert reinit["new_groups"] == 2 and reinit["barriers"] == 0, (rank, reinit["groups"])
        host = rank // 2
        assert r["reinit_intra_sum"] == (2 * host + 1) + (2 * host + 2), rank


def test_absent_member_fails_fast_and_says_whom_it_waits_for(
    two_hosts: list[dict[str, Any]],
) -> None:
    # rank 2's host group [2, 3] misses rank 3; rank 0's cross-node group [0, 2] then misses rank 2
    # (which failed before it got there); rank 1's cross-node group [1, 3] misses rank 3.
    expected = {
        0: ("cross-node", [0, 2], 2),
        1: ("cross-node", [1, 3], 3),
        2: ("intra-node", [2, 3], 3),
    }
    for rank, (kind, ranks, missing) in expected.items():
        absent = two_hosts[rank]["absent"]
        error = absent["error"] or ""
        assert error.startswith("NodeGroupError"), (rank, absent)
        assert f"its {kind} process group of ranks {ranks}" in error, (rank, error)
        assert f"still waiting for rank {missing}" in error, (rank, error)
        waited = float(re.search(r"gave up after ([\d.]+)s", error).group(1))  # type: ignore[union-attr]
        assert ABSENT_TIMEOUT_S <= waited < ABSENT_TIMEOUT_S + 5, (rank, waited)
        assert absent["elapsed"] < 2 * ABSENT_TIMEOUT_S + 10, (rank, absent["elapsed"])


def test_node_group_ranks_match_torchrec_layout() -> None:
    import fastinit.pg as fpg

    for world, local in [(1, 1), (4, 1), (4, 2), (4, 4), (16, 8), (12, 6)]:
        seen_intra: set[tuple[int, ...]] = set()
        seen_cross: set[tuple[int, ...]] = set()
        for rank in range(world):
            intra, cross = fpg.node_group_ranks(rank, world, local)
            assert rank in intra and rank in cross
            assert len(intra) == local and len(cross) == world // local
            assert set(intra) & set(cross) == {rank}
            seen_intra.add(tuple(intra))
            seen_cross.add(tuple(cross))
        # Disjoint partitions of the world, as many as torchrec's loops create.
        assert len(seen_intra) == world // local and len(seen_cross) == local
        assert sorted(r for g in seen_intra for r in g) == list(range(world))
        assert sorted(r for g in seen_cross for r in g) == list(range(world))
    # torchrec's docstring example: 12 ranks, 6 per host.
    assert fpg.node_group_ranks(7, 12, 6) == ([6, 7, 8, 9, 10, 11], [1, 7])
    with pytest.raises(ValueError):
        fpg.node_group_ranks(0, 6, 4)


def test_plan_needs_node_groups() -> None:
    import fastinit.pg as fpg

    def plan(*kinds: Any) -> SimpleNamespace:
        module = {f"t{i}": SimpleNamespace(sharding_type=k) for i, k in enumerate(kinds)}
        return SimpleNamespace(plan={"sparse.ebc": module, "other": object()})

    for kind in NO_GROUP_TYPES:
        assert not fpg.plan_needs_node_groups(plan(kind, "table_wise")), kind
    assert fpg.plan_needs_node_groups(plan("table_wise", "table_row_wise"))
    assert fpg.plan_needs_node_groups(plan("grid_shard"))
    assert fpg.plan_needs_node_groups(plan(SimpleNamespace(value="grid_shard")))  # an enum
    assert fpg.plan_sharding_types(plan("row_wise", "grid_shard")) == {"row_wise", "grid_shard"}
    assert not fpg.plan_needs_node_groups(SimpleNamespace(plan={}))


def test_import_is_cheap() -> None:
    code = (
        "import sys, fastinit.pg as p; "
        "from types import SimpleNamespace as S; "
        "assert not p.plan_needs_node_groups(S(plan={'m': {'t': S(sharding_type='row_wise')}})); "
        "p.prepare_for_plan(S(plan={'m': {'t': S(sharding_type='table_wise')}})); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("local", [4, 8])
def test_bound_device_uses_one_split_per_grouping(
    local: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A default group bound to a device (NCCL with init_process_group(device_id=...)) gets its node
    groups from split_group, called on every rank with every split. No GPU here: the "fake" backend
    plays rank 5 of 8 and split_group is replaced by a recorder, so this checks fastinit's calls,
    not NCCL."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fastinit.pg as fpg

    calls: list[dict[str, Any]] = []

    def split_group(**kwargs: Any) -> Any:
        calls.append(kwargs)
        mine = next(s for s in kwargs["split_ranks"] if dist.get_rank() in s)
        return SimpleNamespace(ranks=mine)

    monkeypatch.setattr(dist, "split_group", split_group)
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        world = dist.group.WORLD
        assert world is not None
        world.bound_device_id = torch.device("cuda", 0)
        fpg.clear_cache()
        groups = fpg.node_groups(local_size=local)
        world.bound_device_id = None
    finally:
        fpg.clear_cache()
        dist.destroy_process_group()
    assert groups.method == "split_group"
    intra: Any = groups.intra
    cross: Any = groups.cross
    splits = [c["split_ranks"] for c in calls]
    if local == 4:
        assert splits == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]]
        assert intra.ranks == [4, 5, 6, 7] and cross.ranks == [1, 5]
    else:  # one host: intra-node is the world itself, one split for the cross-node singletons
        assert splits == [[[r] for r in range(8)]]
        assert intra is world and cross.ranks == [5]
    assert groups.created == len(calls)
    assert all(c["parent_pg"] is world for c in calls)


def test_missing_torchrec_names_fall_back_to_stock(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The private names touched are checked by capability: when one is missing, nothing is
    created or installed (TorchRec then makes its own groups, as stock), and a warning names it.
    A version string alone (a source build reads "unknown") does not decide."""
    import torchrec

    import fastinit.pg as fpg
    from fastinit import compat
    from fastinit.pg import _torchrec, registry

    monkeypatch.setattr(torchrec, "__version__", "unknown")
    assert _torchrec.unsupported_reason() is None

    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("created groups for an unsupported torchrec")

    gone = "torchrec.distributed.comm:_INTRA_PG (a module attribute) is missing"
    real_missing = compat.missing
    monkeypatch.setattr(
        compat,
        "missing",
        lambda component: [gone] if component == "pg" else real_missing(component),
    )
    monkeypatch.setattr(registry, "node_groups", must_not_run)
    monkeypatch.setattr(_torchrec, "install_node_groups", must_not_run)
    plan = SimpleNamespace(plan={"m": {"t": SimpleNamespace(sharding_type="table_row_wise")}})
    with caplog.at_level("WARNING", logger="fastinit.pg.registry"):
        fpg.prepare_for_plan(plan)
    assert "_INTRA_PG" in caplog.text, caplog.text
    assert _torchrec.unsupported_reason() is not None
    with pytest.raises(RuntimeError, match="_INTRA_PG"):
        _torchrec.reset_node_groups()
