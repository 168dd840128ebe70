"""The start-up protocol: the record, the checks, the device messages travel on, and the replica
digest check — replicated values verified on every rank, not assumed.

Multi-rank cases share one spawn of ranks (each rank pays seconds of imports on this machine).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from fastinit import protocol
from fastinit.errors import PlanMismatchError, StartupError, StartupMismatchError
from fastinit.protocol import Record
from fastinit.testing.dist import run_ranks

# -- the record --------------------------------------------------------------------------------


def test_record_round_trips_at_a_fixed_size() -> None:
    rec = Record(
        flags=protocol.HAS_PLAN | protocol.SEED_GIVEN,
        fingerprint=b"f" * 32,
        structure=b"s" * 32,
        plan_digest=b"p" * 32,
        plan_len=123,
        structure_len=456,
        seed=(1 << 63) - 1,
    )
    rec.fail(PlanMismatchError("the plan shards table 'x' " + "é" * 500))
    data = rec.pack()
    assert len(data) == Record.SIZE == len(Record().pack())
    back = Record.unpack(data)
    assert back.error_class == "PlanMismatchError"
    assert back.error.startswith("PlanMismatchError: the plan shards table 'x'")
    assert (back.plan_len, back.structure_len, back.seed) == (123, 456, (1 << 63) - 1)
    assert back.flags & protocol.FAILED and back.flags & protocol.HAS_PLAN
    assert back.fingerprint == b"f" * 32 and back.structure == b"s" * 32
    bad = bytearray(data)
    bad[0] = 99
    with pytest.raises(StartupError, match="record version 99"):
        Record.unpack(bytes(bad))


def test_a_foreign_exception_travels_as_startup_error() -> None:
    rec = Record()
    rec.fail(KeyError("t9"))
    assert rec.error_class == "" and rec.error == "KeyError: 't9'"


def test_seeds_normalise_to_63_bits_deterministically() -> None:
    assert protocol.normalize_seed(0) == 0
    assert protocol.normalize_seed(12345) == 12345
    assert protocol.normalize_seed((1 << 63) - 1) == (1 << 63) - 1
    big = [1 << 63, 1 << 64, (1 << 200) + 7, -1, -(1 << 70)]
    values = [protocol.normalize_seed(s) for s in big]
    assert all(0 <= v < (1 << 63) for v in values)
    assert len(set(values)) == len(values)
    assert values == [protocol.normalize_seed(s) for s in big]  # deterministic
    assert protocol.normalize_seed(True) == 1
    with pytest.raises(TypeError):
        protocol.normalize_seed(1.5)  # type: ignore[arg-type]


def test_structure_lists_every_parameter_and_buffer_sorted() -> None:
    a = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    text = protocol.structure_of(a).decode()
    lines = text.split("\n")
    assert lines == sorted(lines)
    assert "0.weight\tparam\t[4x3]\tfloat32" in lines
    assert any(line.startswith("1.running_mean\tbuffer") for line in lines)
    b = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    assert protocol.structure_of(a) != protocol.structure_of(b)
    assert protocol.structure_of(a) == protocol.structure_of(a.to("meta"))  # devices do not count


def _records(**per_rank: Any) -> list[Record]:
    n = max(len(v) for v in per_rank.values())
    out = [Record(flags=protocol.HAS_PLAN) for _ in range(n)]
    for field, values in per_rank.items():
        for rec, value in zip(out, values, strict=True):
            setattr(rec, field, value)
    return out


def test_check_records_raises_the_failing_ranks_class() -> None:
    recs = _records(flags=[protocol.HAS_PLAN] * 3)
    for r in (1, 2):
        recs[r].fail(PlanMismatchError("the plan shards table 't4'"))
    with pytest.raises(PlanMismatchError, match=r"ranks \[1, 2\]: PlanMismatchError"):
        protocol.check_records(recs)
    recs[2].fail(ValueError("boom"))
    with pytest.raises(StartupError) as info:
        protocol.check_records(recs)
    assert type(info.value) is StartupError and "ValueError: boom" in str(info.value)


def test_check_records_names_what_differs() -> None:
    with pytest.raises(StartupMismatchError, match=r"ranks \[1\] have"):
        protocol.check_records(_records(structure=[b"a" * 32, b"b" * 32]))
    with pytest.raises(StartupMismatchError, match="planner inputs differ"):
        protocol.check_records(_records(fingerprint=[b"a" * 32, b"b" * 32]))
    flags = [protocol.HAS_PLAN | protocol.EXPLICIT, protocol.HAS_PLAN]
    with pytest.raises(StartupMismatchError, match=r"explicit plan was passed on ranks \[0\]"):
        protocol.check_records(_records(flags=flags))
    flags = [protocol.HAS_PLAN | protocol.INIT_PARAMETERS, protocol.HAS_PLAN]
    with pytest.raises(StartupMismatchError, match="init_parameters"):
        protocol.check_records(_records(flags=flags))
    protocol.check_records(_records(seed=[1, 2]))  # seeds are reconciled, not an error


def test_first_difference_names_the_parameter() -> None:
    a = protocol.structure_of(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    b = protocol.structure_of(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3)))
    c = protocol.structure_of(nn.Sequential(nn.Linear(3, 4)))
    text = protocol._first_difference([a, a, b, c])
    assert text.startswith("'1.bias'"), text
    assert "[2] float32 on ranks [0, 1]" in text and "[3] float32 on ranks [2]" in text
    assert "missing on ranks [3]" in text


# -- digests -----------------------------------------------------------------------------------


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    b = torch.randn(33, 7, generator=g).half()
    c = torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g)
    d = torch.rand(9, generator=g) > 0.5
    e = torch.randn(4, 6, generator=g).t()  # not contiguous
    out = []
    for t in (a, b, c, d, e):
        changed = t.clone()
        changed[0] = ~changed[0] if t.dtype == torch.bool else changed[0] + 1
        out.append((t, changed))
    return out


@pytest.mark.parametrize("index", range(5))
def test_digests_tell_values_apart(index: int) -> None:
    t, changed = _pairs()[index]
    d = protocol.tensor_digests([t, t.clone(), changed])
    assert d[0] == d[1] != d[2]
    c = [protocol.device_checksum(x) for x in (t, t.clone(), changed)]
    assert c[0] == c[1] != c[2]
    assert all(0 < int(x) < (1 << 62) for x in [*d, *c])


def test_device_checksum_sees_order_and_shape() -> None:
    t = torch.arange(64, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert protocol.device_checksum(t) != protocol.device_checksum(swapped)
    assert protocol.device_checksum(t) != protocol.device_checksum(t.reshape(8, 8))
    assert protocol.tensor_digests([torch.empty(3, device="meta")]).tolist() == [0]


def test_setup_takes_every_parameter_of_distributed_model_parallel_in_order() -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from fastinit.startup import setup

    stock = list(inspect.signature(DistributedModelParallel.__init__).parameters)[1:]
    ours = list(inspect.signature(setup).parameters)
    assert ours[: len(stock)] == stock, (ours, stock)
    assert ours[len(stock) :] == ["planner", "plan_cache", "seed", "init_tables"]


def test_plan_key_is_the_key_setup_uses() -> None:
    from fastinit.startup import PlanKey, plan_key
    from fastinit.testing.models import ModelSpec, build_model

    module = build_model(ModelSpec(num_tables=3), device="meta")
    kw: dict[str, Any] = {"world_size": 4, "local_world_size": 2, "device": torch.device("cpu")}
    key = plan_key(module, **kw)
    assert isinstance(key, PlanKey) and len(key.fingerprint) == 32
    assert key.planner is not None and key.sharders
    assert plan_key(module, **kw).fingerprint == key.fingerprint
    assert plan_key(module, **{**kw, "world_size": 8}).fingerprint != key.fingerprint


def test_torchrun_without_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from fastinit import startup

    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(StartupError, match="WORLD_SIZE=2 .*init_process_group"):
        startup._ensure_process_group(torch.device("cpu"))
    assert not dist.is_initialized()


# -- the device messages travel on -------------------------------------------------------------

_DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from fastinit import protocol

    warnings.simplefilter("ignore")
    dist.Backend.register_backend(
        "fakecuda", fake_pg._create_fake_pg, extended_api=True, devices=["cuda"]
    )
    out = {}
    for name, backend, store, world in [
        ("gloo", "gloo", dist.HashStore(), 1),
        ("cpu:gloo", "cpu:gloo", dist.HashStore(), 1),
        ("fake", "fake", FakeStore(), 4),
        ("fakecuda", "fakecuda", FakeStore(), 4),
        ("cpu:gloo,cuda:fakecuda", "cpu:gloo,cuda:fakecuda", dist.HashStore(), 1),
    ]:
        dist.init_process_group(backend, store=store, rank=0, world_size=world)
        pg = dist.group.WORLD
        out[name] = [str(protocol.comm_device(pg, torch.device("cuda", 3)))]
        try:  # with no CUDA device named: the current one (none on this machine)
            out[name].append(str(protocol.comm_device(pg, torch.device("cpu"))))
        except (AssertionError, RuntimeError):
            out[name].append("no current CUDA device")
        if name == "fake":
            ch = protocol.Channel(pg)
            got = ch.all_gather_bytes(b"abc", 4, "t")
            out["fake_all_gather"] = [g.hex() for g in got] + [ch.collectives, ch.bytes]
        dist.destroy_process_group()
    print("@@" + json.dumps(out))
    """
)


def test_messages_travel_on_the_device_the_group_serves() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _DEVICE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("@@")), None)
    assert line is not None, proc.stderr[-3000:]
    out = json.loads(line[2:])
    assert out["gloo"] == ["cpu", "cpu"]
    assert out["cpu:gloo"] == ["cpu", "cpu"]
    assert out["fake"] == ["cpu", "cpu"]
    # A group whose only backend serves CUDA (what init_process_group("nccl") makes): CUDA, on
    # setup's device when it names one.
    assert out["fakecuda"] == ["cuda:3", "no current CUDA device"], out
    assert out["cpu:gloo,cuda:fakecuda"] == ["cpu", "cpu"]
    assert out["fake_all_gather"] == ["61626300"] * 4 + [1, 4]


# -- multi-rank: replicated values verified ----------------------------------------------------


class BareParameter(nn.Module):
    """A dense module with a parameter no ``reset_parameters`` initialises."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(64, device=device))


class RandomInit(nn.Module):
    """``reset_parameters`` draws from Python's ``random`` (no torch generator to give)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(16, device=device))

    def reset_parameters(self) -> None:
        import random

        with torch.no_grad():
            self.w.fill_(random.random())


class Wrapped(nn.Module):
    def __init__(
        self, spec: Any, device: Any, dense: tuple[int, ...] | None = None, rand: bool = False
    ) -> None:
        super().__init__()
        from fastinit.testing.models import RefModel

        if dense is not None:
            import dataclasses

            spec = dataclasses.replace(spec, dense_arch=dense)
        self.ref = RefModel(spec, torch.device(device))
        self.bare = BareParameter(torch.device(device))
        if rand:
            self.rand = RandomInit(torch.device(device))
        self.register_buffer("steps", torch.zeros(3, device=device))


def _replicated_hashes(model: Any) -> dict[str, str]:
    import hashlib

    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            continue
        t = value.detach().cpu().contiguous()
        out[key] = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _agree(model: Any) -> dict[str, Any]:
    """Every replicated value's hash, compared across ranks (test-side, outside setup)."""
    import torch.distributed as dist

    mine = _replicated_hashes(model)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = sorted(k for k in mine if len({json.dumps(e.get(k)) for e in every}) > 1)
    covered = {n for n, _ in protocol.replicated_tensors(model.module, model.plan)}
    return {"n": len(mine), "differ": differ, "uncovered": sorted(set(mine) - covered)}


def _cache_cases(cache_dir: str) -> dict[str, Any]:
    """setup's plan-cache wiring: a foreign plan under this key is a miss, re-planned and replaced;
    a planner input without a canonical description turns the cache off, with a warning."""
    import warnings

    import torch.distributed as dist
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.planner import Topology

    import fastinit
    from fastinit.plan.cache import FastinitCacheWarning, PlanCache
    from fastinit.planner import FastPlanner
    from fastinit.startup import plan_key
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    ws = dist.get_world_size()
    spec = ModelSpec(num_tables=3, rows=64, dims=(8,))
    key = plan_key(
        build_model(spec, device="meta"),
        world_size=ws,
        local_world_size=get_local_size(ws),
        device=torch.device("cpu"),
    ).fingerprint
    cache = PlanCache(cache_dir)
    if dist.get_rank() == 0:
        foreign = build_plan(build_model(ModelSpec(num_tables=5), device="meta"), "table_wise", ws)
        assert cache.put(key, foreign)
    dist.barrier()
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fastinit.setup(build_model(spec, device="meta"), plan_cache=cache_dir, seed=1)
    out["foreign_warned"] = [
        str(w.message) for w in caught if issubclass(w.category, FastinitCacheWarning)
    ]
    dist.barrier()
    replaced = cache.get(key)
    out["replaced"] = replaced is not None and sorted(replaced.plan) == sorted(model.plan.plan)
    topology = Topology(world_size=ws, local_world_size=get_local_size(ws), compute_device="cpu")
    planner = FastPlanner(topology=topology, callbacks=[lambda options: options])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastinit.setup(
            build_model(spec, device="meta"), planner=planner, plan_cache=cache_dir, seed=1
        )
    out["lambda_warned"] = [
        str(w.message) for w in caught if issubclass(w.category, FastinitCacheWarning)
    ]
    dist.barrier()
    out["entries"] = len([f for f in os.listdir(cache_dir) if f.endswith(".fiplan")])
    return out


def _protocol_cases(cache_dir: str) -> dict[str, Any]:
    import random
    import threading
    import warnings

    import torch.distributed as dist

    import fastinit
    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    rank = dist.get_rank()
    ws = dist.get_world_size()
    tracer = trace.active()
    assert tracer is not None
    spec = ModelSpec(num_tables=6, num_ec_tables=2, rows=64, dims=(8,), ec_dim=8)
    types = {
        **{f"t{i}": ("data_parallel", "table_wise", "row_wise")[i // 2] for i in range(6)},
        "e0": "data_parallel",
        "e1": "table_wise",
    }
    out: dict[str, Any] = {}

    def plan_for(model: Any) -> Any:
        return build_plan(model, types, ws)

    def run(name: str, make: Any, **kwargs: Any) -> Any:
        random.seed(rank)  # RandomInit differs per rank
        module = make()
        with warnings.catch_warnings(record=True) as caught, tracer.window() as counts:
            warnings.simplefilter("always")
            try:
                model = fastinit.setup(module, plan=plan_for(module), **kwargs)
            except fastinit.StartupError as e:
                out[name] = {"error": f"{type(e).__name__}: {e}", "ops": None}
                return None
        out[name] = {
            "ops": counts["c10d_ops"],
            "warnings": [
                str(w.message)
                for w in caught
                if issubclass(w.category, protocol.ReplicaMismatchWarning)
            ],
            **_agree(model),
        }
        return model

    # Seeded differently by default: every rank uses rank 0's initial seed.
    torch.manual_seed(rank)
    run("default_seeds", lambda: Wrapped(spec, "meta"))
    # Explicit seeds that differ: reported, rank 0's used.
    run("seed_1000_plus_rank", lambda: Wrapped(spec, "meta"), seed=1000 + rank)
    # Any int seed.
    run("huge_seed", lambda: Wrapped(spec, "meta"), seed=(1 << 64) + 5)
    run("negative_seed", lambda: Wrapped(spec, "meta"), seed=-3)
    # An init function without a torch generator (Python's random, seeded per rank): broadcast.
    run("random_init", lambda: Wrapped(spec, "meta", rand=True), seed=3)
    # Eager dense values that differ (a CPU model built from each rank's own RNG): broadcast.
    torch.manual_seed(rank)
    run("eager_differs", lambda: Wrapped(spec, "cpu", rand=True))
    # A thread drawing from the global RNG during setup.
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            torch.rand(1000)

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        run("concurrent_rng", lambda: Wrapped(spec, "meta"), seed=5)
    finally:
        stop.set()
        thread.join()
    # Different dense layers.
    dense = (32, 16) if rank == 0 else (32, 8)
    run("dense_differs", lambda: Wrapped(spec, "meta", dense=dense), seed=1)
    # A plan for another model: PlanMismatchError itself, on every rank.
    other = build_plan(build_model(ModelSpec(num_tables=9), device="meta"), "table_wise", ws)
    try:
        fastinit.setup(build_model(ModelSpec(num_tables=4), device="meta"), plan=other)
        out["plan_mismatch"] = "no error"
    except PlanMismatchError as e:
        out["plan_mismatch"] = f"{type(e).__name__}: {e}"
    out["cache"] = _cache_cases(cache_dir)
    return out


def test_replicated_values_are_verified_not_assumed(tmp_path: Any) -> None:
    results = run_ranks(
        _protocol_cases, 2, args=(str(tmp_path),), trace=True, timeout=400, backend="cpu:gloo"
    )
    for rank, res in enumerate(results):
        for case in (
            "default_seeds",
            "seed_1000_plus_rank",
            "huge_seed",
            "negative_seed",
            "random_init",
            "eager_differs",
            "concurrent_rng",
        ):
            got = res[case]
            assert "error" not in got, (case, got)
            assert got["n"] >= 10, got
            assert got["differ"] == [], (rank, case, got["differ"])
            assert got["uncovered"] == [], (case, got["uncovered"])
            ops = got["ops"]
            # At most 3 start-up collectives, plus one broadcast where values differed.
            assert sum(ops.values()) - ops.get("broadcast_", 0) <= 2, (case, ops)
        # Values fastinit made itself agree with no tensor broadcast at all.
        for case in ("default_seeds", "seed_1000_plus_rank", "huge_seed", "concurrent_rng"):
            assert res[case]["ops"] == {"allgather_": 1, "allreduce_": 1}, (case, res[case])
        seeds = res["seed_1000_plus_rank"]["warnings"]
        assert any("seed 1000 on ranks [0]" in w and "seed 1001 on ranks [1]" in w for w in seeds)
        assert res["default_seeds"]["warnings"] == []
        random_init = res["random_init"]
        assert random_init["ops"] == {"allgather_": 1, "allreduce_": 1, "broadcast_": 1}
        assert any(": rand.w" in w for w in random_init["warnings"]), random_init
        # Eager values that differ: one broadcast of rank 0's, named in the warning.
        eager = res["eager_differs"]
        assert eager["ops"] == {"allgather_": 1, "allreduce_": 1, "broadcast_": 1}, eager
        assert any("ref.dense_arch.0.weight" in w and "rand.w" in w for w in eager["warnings"])
        # Different dense layers: the same clear error everywhere, naming the first difference.
        err = res["dense_differs"]["error"]
        assert err.startswith("StartupMismatchError: the model differs"), err
        first = "'ref.dense_arch.2.bias': param [16] float32 on ranks [0]; param [8] float32 on ranks [1]"
        assert first in err, err
        assert res["plan_mismatch"].startswith("PlanMismatchError:"), res["plan_mismatch"]
        assert "t4" in res["plan_mismatch"] or "t8" in res["plan_mismatch"]
        cache = res["cache"]
        assert any("does not fit" in w for w in cache["foreign_warned"]), cache
        assert cache["replaced"], cache
        assert len(cache["lambda_warned"]) == 1 and "lambda" in cache["lambda_warned"][0], cache
        assert cache["entries"] == 1, cache  # the uncacheable call wrote nothing
    assert results[0]["dense_differs"] == results[1]["dense_differs"]
    assert results[0]["plan_mismatch"] == results[1]["plan_mismatch"]


def _meta_device() -> list[str]:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model

    spec = ModelSpec(num_tables=4, num_weighted_tables=2)
    ws = dist.get_world_size()

    def plan(m: Any) -> Any:
        topology = Topology(world_size=ws, compute_device="cpu")
        return EmbeddingShardingPlanner(topology=topology).plan(m, get_default_sharders())

    kw: dict[str, Any] = {"init_data_parallel": False, "init_parameters": False}
    m1 = build_model(spec, device="meta")
    stock = DistributedModelParallel(m1, plan=plan(m1), device=torch.device("meta"), **kw)
    m2 = build_model(spec, device="meta")
    fast = fastinit.setup(m2, plan=plan(m2), device=torch.device("meta"), **kw)
    assert list(fast.state_dict()) == list(stock.state_dict())
    return list(fast.state_dict())


def test_meta_device_with_an_explicit_plan_works_as_for_stock() -> None:
    results = run_ranks(_meta_device, 2, timeout=200)
    assert results[0] == results[1] and results[0]


def _log_lines() -> list[str]:
    import logging

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root_handlers = list(logging.getLogger().handlers)
    log = logging.getLogger("fastinit")
    log.addHandler(Keep(logging.DEBUG))
    log.setLevel(logging.DEBUG)
    fastinit.setup(build_model(ModelSpec(num_tables=2), device="meta"), seed=1)
    assert logging.getLogger().handlers == root_handlers
    return [f"{r.levelname} {r.getMessage()}" for r in records if r.name == "fastinit.startup"]


def test_one_info_line_per_setup_on_rank_0() -> None:
    lines = run_ranks(_log_lines, 2, timeout=200)
    info = [[line for line in per_rank if line.startswith("INFO")] for per_rank in lines]
    assert len(info[0]) == 1 and info[1] == [], info
    assert "plan planned" in info[0][0] and "start-up collective(s)" in info[0][0], info[0]
    assert "3 start-up collective(s)" in info[0][0]
    assert all(any(line.startswith("DEBUG") for line in per_rank) for per_rank in lines)


def test_replica_bytes_pack_and_unpack_any_layout() -> None:
    """The tensor broadcast packs tensors of any dtype and layout into one byte buffer and back,
    whatever the alignment of each tensor's slice."""
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(3, generator=g).half(),  # 6 bytes: the next slice is not 4-aligned
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.randint(0, 9, (5,), generator=g),
        torch.rand(3, generator=g) > 0.5,
    ]
    flat = torch.cat([protocol._as_bytes(t) for t in tensors])
    targets = [torch.zeros_like(t) for t in tensors[:1]] + [torch.zeros(4, 6).t()]
    targets += [torch.zeros_like(t) for t in tensors[2:]]
    offset = 0
    for t in targets:
        n = t.numel() * t.element_size()
        protocol._copy_bytes_into(t, flat[offset : offset + n])
        offset += n
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets, strict=True))


def test_record_columns_are_read_from_the_packed_bytes() -> None:
    import random

    from fastinit import protocol

    rng = random.Random(5)
    records = [
        protocol.Record(
            flags=rng.randrange(1 << 16),
            fingerprint=rng.randbytes(32),
            structure=rng.randbytes(32),
            plan_digest=rng.randbytes(32),
            plan_len=rng.randrange(1 << 40),
            structure_len=rng.randrange(1 << 20),
            seed=rng.randrange(1 << 63),
            error="x" * rng.randrange(10),
        )
        for _ in range(7)
    ]
    table = protocol.Records([r.pack() for r in records])
    assert len(table) == 7 and table[3] == records[3] and list(table) == records
    for field in protocol._FIELDS:
        assert table.column(field) == [getattr(r, field) for r in records], field
        assert protocol.column(records, field) == table.column(field)


def test_record_offsets_are_derived_from_the_struct_layout() -> None:
    import struct

    assert protocol._RECORD.size == Record.SIZE == 541
    fmt = "<" + "".join(f for _, f in protocol._LAYOUT)
    assert protocol._RECORD.format == fmt
    for name, (offset, size, is_int) in protocol._FIELDS.items():
        index = [n for n, _ in protocol._LAYOUT].index(name)
        prefix = "<" + "".join(f for _, f in protocol._LAYOUT[:index])
        assert offset == struct.calcsize(prefix), name
        assert is_int == (not protocol._LAYOUT[index][1].endswith("s")), name
        assert size == struct.calcsize("<" + protocol._LAYOUT[index][1]), name
    # and every field a record holds unpacks from where the offsets say
    rec = Record(flags=7, plan_len=3, seed=11, structure_len=5, fingerprint=b"a" * 32)
    data = rec.pack()
    for name, (offset, size, is_int) in protocol._FIELDS.items():
        raw = data[offset : offset + size]
        assert (int.from_bytes(raw, "little") if is_int else raw) == getattr(rec, name), name


def test_build_record_is_the_only_record_setup_fills() -> None:
    structure = b"w\tparam\t[2]\tfloat32"
    rec = protocol.build_record(
        structure=structure,
        init_parameters=True,
        validate=True,
        seed=42,
        seed_given=True,
        fingerprint=b"f" * 32,
        source="cache",
        encoded=b"plan bytes",
    )
    import hashlib

    assert rec.flags == (
        protocol.INIT_PARAMETERS
        | protocol.VALIDATE
        | protocol.SEED_GIVEN
        | protocol.FROM_CACHE
        | protocol.HAS_PLAN
    )
    assert rec.structure == hashlib.sha256(structure).digest()
    assert rec.structure_len == len(structure)
    assert rec.plan_digest == hashlib.sha256(b"plan bytes").digest() and rec.plan_len == 10
    assert (rec.seed, rec.fingerprint) == (42, b"f" * 32)
    assert protocol.plan_source(rec) == "cache"
    # planned on this rank: no plan held yet is impossible; a rank that missed holds none
    missed = protocol.build_record(structure=structure, init_parameters=False)
    assert missed.flags == 0 and protocol.plan_source(missed) == "received"
    planned = protocol.build_record(
        structure=structure, init_parameters=False, source="planned", encoded=b"x"
    )
    assert planned.flags == protocol.PLANNED | protocol.HAS_PLAN
    failed = protocol.build_record(
        structure=structure,
        init_parameters=False,
        source="explicit",
        failure=PlanMismatchError("no fit"),
    )
    assert failed.flags == protocol.EXPLICIT | protocol.FAILED
    assert failed.error_class == "PlanMismatchError"
    assert Record.unpack(failed.pack()) == failed
    with pytest.raises(ValueError, match="plan source"):
        protocol.build_record(structure=b"", init_parameters=False, source="disk")
