"""Any plan is compact once: an explicit plan (TorchRec's ``construct_module_sharding_plan``, a
``torch.load`` of a saved one) is turned into the compact form in one pass, and the model built
from it equals the one built from the same plan given compact — a table whose shards follow no
rule included."""

from __future__ import annotations

import copy
import random
import textwrap
from typing import Any

import pytest

pytest.importorskip("torchrec")

from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec  # noqa: E402

from fastinit.plan import layout  # noqa: E402
from fastinit.plan.codec import decode_plan, encode_plan  # noqa: E402
from fastinit.plan.compact import CompactShardingSpec, compact_plan  # noqa: E402
from fastinit.testing.models import (  # noqa: E402
    SHARDING_TYPES,
    ModelSpec,
    build_model,
    build_plan,
    plan_to_plain,
)

SPEC = ModelSpec(num_tables=8, num_weighted_tables=3, num_ec_tables=4, rows=61)


def _random_shards(rng: random.Random) -> list[Any]:
    n = rng.choice([32, 33, 40, 64, 100])
    mode = rng.randrange(4)
    out = []
    for r in range(n):
        if mode == 0:
            off, sz = [r * 3, 0], [3, 4]
        elif mode == 1:
            off, sz = [rng.choice([0, r * 2, 5]), rng.randrange(3)], [rng.choice([2, 2, 3]), 4]
        elif mode == 2:
            off, sz = [(r // 8) * 4, (r % 8) * 2], [4, 2]
        else:
            off, sz = [r, 0], [1, 2]
        dev = f"cuda:{r % 8}" if mode != 3 else "cpu"
        if rng.random() < 0.3:
            dev = rng.choice(["cpu", f"cuda:{r % 8}", f"cuda:{r % 4}"])
        rank = r if rng.random() < 0.9 else rng.randrange(n)
        placement = f"rank:{rank}/{dev}" if rng.random() < 0.97 else "worker0/cpu"
        out.append(ShardMetadata(off, sz, placement))
    return out


def test_long_shard_lists_find_the_same_runs_with_arrays() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        shards = _random_shards(rng)
        assert layout._runs_of_array(shards) == layout._runs_of_list(shards)
        assert layout.runs_of(shards) == layout._runs_of_list(shards)


def test_placements_read_by_attribute_find_what_their_strings_find() -> None:
    """torch's placements are read without a string each (ranks and devices by attribute);
    placements of other kinds (strings, tampered objects) through their strings; both give the
    runs the list version finds."""
    import torch
    from torch.distributed.remote_device import _remote_device

    rng = random.Random(1)
    devices = ["cpu", "cuda", "cuda:0", "cuda:3", "meta", "cuda:7"]
    for trial in range(300):
        n = rng.choice([32, 48, 64])
        shards = []
        for r in range(n):
            dev = f"cuda:{r % 8}" if trial % 3 else rng.choice(devices)
            rank = r if rng.random() < 0.95 else rng.randrange(n)
            sizes: list[Any] = [3, 4]
            if trial % 7 == 0 and r == n // 2:
                sizes = [3.0, 4]  # compares equal to [3, 4], as in the list version
            shards.append(ShardMetadata([r * 3, 0], sizes, f"rank:{rank}/{dev}"))
        if trial % 5 == 0:  # a placement given as a plain string (set after construction)
            shards[rng.randrange(n)].placement = "rank:2/cpu"  # type: ignore[assignment]
        if trial % 11 == 0:  # a device given as torch.device of a type and an index
            shards[rng.randrange(n)].placement = _remote_device(torch.device("cuda", 2))
        expected = layout._runs_of_list(shards)
        assert layout.runs_of(shards) == expected, trial
    # a tampered placement whose string names no rank, a rank that is a bool, float offsets
    shards = [ShardMetadata([r * 3, 0], [3, 4], f"rank:{r}/cpu") for r in range(40)]
    shards[5].placement._rank = True  # type: ignore[union-attr]
    shards[9].placement._worker_name = "trainer"  # type: ignore[union-attr]
    assert layout.runs_of(shards) == layout._runs_of_list(shards)
    assert layout.runs_of(shards)[1].rank is None  # "rank:True/cpu" names no rank
    shards = [ShardMetadata([r * 3, 0], [3, 4], f"rank:{r}/cpu") for r in range(40)]
    shards[7].shard_offsets = [21.0, 0]  # type: ignore[list-item]
    assert layout._runs_of_array(shards) is None
    assert layout.runs_of(shards) == layout._runs_of_list(shards)


def _irregular(plan: Any, model: Any) -> tuple[str, str]:
    """Make one EBC table column-wise in uneven blocks on ranks in no order: no rule."""
    path = "sparse.ebc"
    mp = plan.plan[path]
    name = next(n for n, ps in mp.items() if ps.sharding_type == "column_wise")
    config = next(c for c in model.sparse.ebc.embedding_bag_configs() if c.name == name)
    rows, dim = config.num_embeddings, config.embedding_dim
    widths = [dim // 4, dim // 2, dim - dim // 4 - dim // 2]
    ranks = [1, 4, 2]
    shards, at = [], 0
    for w, r in zip(widths, ranks, strict=True):
        shards.append(ShardMetadata([0, at], [rows, w], f"rank:{r}/cpu"))
        at += w
    ps = mp[name]
    ps.ranks = ranks
    ps.sharding_spec = EnumerableShardingSpec(shards)
    return path, name


def test_compact_plan_keeps_the_plan_and_its_bytes() -> None:
    model = build_model(SPEC, device="meta")
    plan = build_plan(model, list(SHARDING_TYPES), world_size=16, local_world_size=4)
    path, name = _irregular(plan, model)
    before = encode_plan(plan)
    plain = plan_to_plain(plan)
    compact = compact_plan(plan)
    assert encode_plan(plan) == before and plan_to_plain(plan) == plain  # the given plan: as it was
    kinds = {}
    for p, mp in compact.plan.items():
        for n, ps in mp.items():
            spec = ps.sharding_spec
            given = plan.plan[p][n].sharding_spec
            kinds[(p, n)] = type(spec).__name__
            if spec is None or len(given.shards) == 1:
                assert spec is given  # nothing to compact: the same object
            elif (p, n) == (path, name):
                assert spec is given, "a table whose shards follow no rule keeps its list"
            else:
                assert isinstance(spec, CompactShardingSpec) and not spec.expanded, (p, n)
                assert spec == given
    assert "CompactShardingSpec" in kinds.values()
    assert encode_plan(compact) == before  # the same bytes, so the same digest
    assert plan_to_plain(compact) == plain
    assert plan_to_plain(decode_plan(before)) == plain
    assert compact_plan(compact) is compact  # already compact: nothing to do


_FAKE = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg
    from torch.testing._internal.distributed.fake_pg import FakeStore
    n, rank = int(sys.argv[1]), int(sys.argv[2])
    import os
    os.environ.update({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 4), "RANK": str(rank)})
    dist.Backend.register_backend("fakestate", fake_pg._create_fake_pg, extended_api=True, devices=["cpu"])
    dist.init_process_group("fakestate", store=FakeStore(), rank=rank, world_size=n)
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    import fastinit
    from fastinit.plan.codec import decode_plan, encode_plan
    from fastinit.plan import layout
    from fastinit.testing.models import SHARDING_TYPES, ModelSpec, build_model, build_plan, plan_to_plain
    from tests.plan.test_explicit_plans import SPEC, _irregular

    def built(plan):
        module = build_model(SPEC, device="meta")
        return fastinit.setup(module, device=torch.device("cpu"), plan=plan, seed=3)

    module = build_model(SPEC, device="meta")
    from benchmarks.scale.main import plan_types
    explicit = build_plan(module, plan_types(module, "all7"), world_size=n, local_world_size=4)
    _irregular(explicit, module)
    data = encode_plan(explicit)
    a = built(explicit)
    b = built(decode_plan(data))
    assert encode_plan(explicit) == data, "setup changed the plan it was given"
    assert plan_to_plain(a.plan) == plan_to_plain(b.plan) == plan_to_plain(explicit)

    def describe(sd):
        out = {}
        for k, v in sd.items():
            if isinstance(v, ShardedTensor):
                md = v.metadata()
                out[k] = (
                    [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in md.shards_metadata],
                    list(md.size), str(md.tensor_properties.dtype),
                    [(s.metadata.shard_offsets, s.metadata.shard_sizes, s.tensor.tolist()) for s in v.local_shards()],
                    type(v.sharding_spec()).__name__,
                )
            elif isinstance(v, torch.Tensor):
                out[k] = v.tolist()
            else:
                out[k] = repr(v)
        return out

    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    da, db = describe(sa), describe(sb)
    for k in da:
        assert da[k] == db[k], k
    oa, ob = a.fused_optimizer.state_dict(), b.fused_optimizer.state_dict()
    sta = {k: describe(v) for k, v in oa["state"].items()}
    stb = {k: describe(v) for k, v in ob["state"].items()}
    assert sta == stb
    # the regular tables were built from their rule: their global metadata is held unbuilt
    lazy = [k for k, v in sa.items() if isinstance(v, ShardedTensor) and type(v.metadata().shards_metadata).__name__ == "LazyShards"]
    print("@@" + json.dumps({"tensors": len(da), "lazy": len(lazy), "state": len(sta)}))
    """
)


def test_an_explicit_plan_builds_the_model_its_compact_form_builds() -> None:
    from fastinit.testing.dist import run_script

    got = run_script(_FAKE, 16, 13, timeout=600)
    assert got["tensors"] > 0 and got["state"] > 0
    assert got["lazy"] > 0, got


def test_compact_plan_of_a_torch_saved_plan(tmp_path: Any) -> None:
    import torch

    model = build_model(SPEC, device="meta")
    plan = build_plan(model, ["row_wise", "table_row_wise"], world_size=32, local_world_size=8)
    torch.save(plan, tmp_path / "plan.pt")
    loaded = torch.load(tmp_path / "plan.pt", weights_only=False)
    compact = compact_plan(loaded)
    assert encode_plan(compact) == encode_plan(plan)
    for mp in compact.plan.values():
        for ps in mp.values():
            assert isinstance(ps.sharding_spec, CompactShardingSpec)
    assert copy.deepcopy(compact).plan.keys() == plan.plan.keys()


def test_the_user_factory_plan_compacts_to_itself() -> None:
    """``benchmarks.scale.factories`` (make scale's factory-given model and plan, TorchRec
    modules of its own and a plan built with ``construct_module_sharding_plan``): its regular
    tables compact, and the compact plan is the given one (the same shards, the same bytes)."""
    from benchmarks.scale.factories import user_model, user_plan

    model = user_model()
    plan = user_plan(model, 16, 8)
    compact = compact_plan(plan)
    kinds = set()
    for p, mp in compact.plan.items():
        for n, ps in mp.items():
            given = plan.plan[p][n].sharding_spec
            kinds.add((ps.sharding_type, type(ps.sharding_spec).__name__))
            assert ps.sharding_spec == given, (p, n)
    for kind in ("row_wise", "grid_shard", "table_row_wise", "column_wise"):
        assert (kind, "CompactShardingSpec") in kinds, kind
    assert encode_plan(compact) == encode_plan(plan)
