"""The upstream patch series for the installed torchrec (patches/torchrec/v<release>: 1.8.0 or
1.9.2, picked by patches/apply.py) applies cleanly and does what it claims.

The stock path (``collective_plan`` + ``DistributedModelParallel``, no fastinit) is run twice, each
time in a fresh interpreter: once on the installed torchrec, once on a patched copy first on
``PYTHONPATH``. Spawned ranks inherit ``sys.path`` from their parent, not ``PYTHONPATH``, so the
copy must be on the path of the parent itself; hence the subprocess. Both runs must give the same
plans, ShardedTensor metadata, state_dict keys and losses over 3 TrainPipelineSparseDist steps from
the same state; the patched run must issue the start-up ops the patches claim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastinit.testing.models import SHARDING_TYPES

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent
ALL_TYPES = list(SHARDING_TYPES)
# (name, ModelSpec kwargs, plan: "planner" or sharding types for build_plan, train?)
CASES_2 = [
    ("ebc-planner", {"num_tables": 8}, "planner", True),
    (
        "ec-fp16",
        {"num_tables": 0, "num_ec_tables": 6, "fp16_every": 2},
        ["table_wise", "column_wise", "row_wise"],
        True,
    ),
    (
        "ec-tw-24",
        {"num_tables": 0, "num_ec_tables": 24, "rows": 64, "dims": (8,)},
        ["table_wise"],
        False,
    ),
    ("ebc-dp", {"num_tables": 6, "fp16_every": 3}, ["data_parallel", "table_wise"], True),
]
CASES_4 = [("mixed", {"num_tables": 7, "num_weighted_tables": 2}, ALL_TYPES, True)]


# -- what runs on the ranks (in the subprocess) ------------------------------------------------


def _set_state(model: Any) -> None:
    """Give every parameter and buffer a value that depends only on its key (any torchrec)."""
    import hashlib

    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = model.state_dict()
    for key, value in state.items():
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")
        gen = torch.Generator().manual_seed(seed)
        if isinstance(value, ShardedTensor):
            full = torch.rand(tuple(value.size()), generator=gen) * 0.2 - 0.1
            for shard in value.local_shards():
                index = tuple(
                    slice(o, o + s)
                    for o, s in zip(
                        shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True
                    )
                )
                shard.tensor.detach().copy_(full[index])
        elif value.is_floating_point():
            value.detach().copy_(torch.rand(value.shape, generator=gen) * 0.2 - 0.1)
    model.load_state_dict(state)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


def _stock_report(cases: list[tuple[str, dict[str, Any], Any, bool]]) -> dict[str, Any]:
    """Per case: plan, metadata, keys, losses and start-up counts of the stock path."""
    import torch.distributed as dist
    import torchrec

    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup
    from tests.startup.test_setup import _plan_fields, _st_metadata, _train

    tracer = trace.active()
    assert tracer is not None
    out: dict[str, Any] = {"torchrec": torchrec.__file__}
    for name, spec_kwargs, types, train in cases:
        spec = ModelSpec(**spec_kwargs)
        model = build_model(spec, device="meta")
        plan = None if types == "planner" else build_plan(model, types, dist.get_world_size())
        phases: dict[str, Any] = {}
        with tracer.window() as total:
            dmp = stock_setup(model, plan, phases=phases)
        report = {
            "plan": _plan_fields(dmp.plan),
            "metadata": _st_metadata(dmp),
            "keys": list(dmp.state_dict()),
            "phases": phases,
            "total": total,
            "losses": [],
        }
        if train:
            _set_state(dmp)
            report["losses"] = _train(dmp, spec, dist.get_rank())
        out[name] = _jsonable(report)
    return out


def _job(out_path: str) -> None:
    """Subprocess entry: run both rank jobs on the torchrec first on sys.path, write JSON."""
    from fastinit.testing.dist import run_ranks

    two = run_ranks(_stock_report, 2, args=(CASES_2,), trace=True, timeout=300)
    four = run_ranks(
        _stock_report,
        4,
        args=(CASES_4,),
        trace=True,
        local_world_size=2,
        timeout=300,
        env={"TORCHREC_VALIDATE_COLLECTIVES": "0"},
    )
    Path(out_path).write_text(json.dumps({"2": two, "4": four}))


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def patched_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the installed torchrec with the series applied, via patches/apply.py."""
    target = tmp_path_factory.mktemp("patched-torchrec")
    result = subprocess.run(
        [sys.executable, str(REPO / "patches" / "apply.py"), "--target", str(target)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def _series_dir() -> Path:
    from patches import apply

    return apply.series_dir(apply.installed_version())


def test_series_applies_cleanly(patched_site: Path) -> None:
    import importlib.metadata

    series = _series_dir()
    assert series.name == "v" + importlib.metadata.version("torchrec").split("+")[0]
    names = sorted(p.name for p in series.glob("*.patch"))
    assert len(names) >= 7, names
    assert (patched_site / "torchrec" / "distributed" / "comm.py").is_file()
    # apply.py applied them in order with `git apply`, which accepts no fuzz: check the files
    # each patch touches are in the copy, patched.
    for name in names:
        text = (series / name).read_text()
        assert text.startswith("From ") and "\n---\n" in text, name
        for line in text.splitlines():
            if line.startswith("+++ b/"):
                assert line[6:].startswith("torchrec/"), (name, line)


def _run_job(out: Path, torchrec_dir: Path | None) -> dict[str, Any]:
    path = [str(TESTS), str(REPO)]
    if torchrec_dir is not None:
        path.insert(0, str(torchrec_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = f"import test_patches; test_patches._job({str(out)!r})"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return json.loads(out.read_text())


def test_patched_stock_path_is_equivalent_and_cheaper(patched_site: Path, tmp_path: Path) -> None:
    stock = _run_job(tmp_path / "stock.json", None)
    patched = _run_job(tmp_path / "patched.json", patched_site)
    for world in ("2", "4"):
        for rank, (s, p) in enumerate(zip(stock[world], patched[world], strict=True)):
            assert str(patched_site) in p["torchrec"] and str(patched_site) not in s["torchrec"]
            for case in s:
                if case == "torchrec":
                    continue
                for field in ("plan", "metadata", "keys", "losses"):
                    assert p[case][field] == s[case][field], (world, rank, case, field)
                if s[case]["losses"]:
                    assert all(x == x for x in s[case]["losses"]), (case, s[case]["losses"])

    for s, p in zip(stock["2"], patched["2"], strict=True):
        planned = p["ebc-planner"]
        # 0003: collective_plan = one all_gather of fixed records + one broadcast of the plan.
        assert s["ebc-planner"]["phases"]["plan"]["c10d_ops"] == {"broadcast_": 2}
        assert planned["phases"]["plan"]["c10d_ops"] == {"_allgather_base_": 1, "broadcast_": 1}
        # 0005 (TORCHREC_VALIDATE_COLLECTIVES unset): 1 broadcast instead of 2. The dense DDP
        # wrap (1 all_gather + 2 broadcasts) is not part of the series.
        assert planned["phases"]["dmp"]["c10d_ops"] == {"broadcast_": 3, "allgather_": 1}
        assert s["ebc-planner"]["total"]["c10d_total"] == 7
        assert planned["total"]["c10d_total"] == 6
        # 0001: EmbeddingCollection: no all_gather per table (stock: 2 per table).
        ec_stock = s["ec-tw-24"]["phases"]["dmp"]["c10d_ops"]
        ec = p["ec-tw-24"]["phases"]["dmp"]["c10d_ops"]
        assert ec_stock["allgather_"] == 1 + 2 * 24
        assert ec == {"broadcast_": 2, "allgather_": 1}, ec  # the dense DDP wrap only
        assert p["ec-fp16"]["phases"]["dmp"]["c10d_ops"] == ec
        # 0004: data-parallel tables (fp32 and fp16): one coalesced broadcast per dtype (stock:
        # DDP verify all_gather + coalesced broadcast, then one broadcast per table).
        dp = p["ebc-dp"]["phases"]["dmp"]["c10d_ops"]
        assert dp == {"broadcast_": 2 + 2, "allgather_": 1}, dp
        assert s["ebc-dp"]["phases"]["dmp"]["c10d_ops"] == {"broadcast_": 8, "allgather_": 2}

    for rank, (s, p) in enumerate(zip(stock["4"], patched["4"], strict=True)):
        stock_dmp, dmp = s["mixed"]["phases"]["dmp"], p["mixed"]["phases"]["dmp"]
        # 0002: TWRW/GRID node groups: only this rank's two groups, member-only, no barrier.
        assert stock_dmp["new_groups"] == 4 and stock_dmp["barriers"] == 2
        assert dmp["barriers"] == 0
        assert dmp["new_groups"] == 2 == dmp["member_groups"], dmp["groups"]
        assert all(g["local_sync"] for g in dmp["groups"]), dmp["groups"]
        host, local = divmod(rank, 2)
        assert [g["ranks"] for g in dmp["groups"]] == [
            [2 * host, 2 * host + 1],
            [local, local + 2],
        ]
        # 0005 with TORCHREC_VALIDATE_COLLECTIVES=0: no validation broadcast; 0004: one
        # coalesced broadcast for the data-parallel table; the dense DDP wrap: 3 ops.
        assert stock_dmp["c10d_ops"] == {"broadcast_": 10, "allgather_": 3, "barrier": 2}
        assert dmp["c10d_ops"] == {"broadcast_": 4, "allgather_": 1}, dmp["c10d_ops"]


def _dense_sequence_rank() -> list[float]:
    """EmbeddingCollection tables with the "dense" kernel on CPU: 3 training steps."""
    import torch.distributed as dist

    from fastinit.testing.models import ModelSpec, build_model, build_plan
    from fastinit.testing.stock import stock_setup
    from tests.startup.test_setup import _train

    spec = ModelSpec(num_tables=0, num_ec_tables=3, fp16_every=2)
    types = ["table_wise", "row_wise", "column_wise"]
    plan = build_plan(build_model(spec, device="meta"), types, 2, compute_kernel="dense")
    dmp = stock_setup(build_model(spec, device="meta"), plan)
    return _train(dmp, spec, dist.get_rank())


def _dense_job(out_path: str) -> None:
    from fastinit.testing.dist import run_ranks

    results = run_ranks(_dense_sequence_rank, 2, timeout=200, grace=10, return_failures=True)
    report = [{"ok": r.ok, "exitcode": r.exitcode, "losses": r.value} for r in results]
    Path(out_path).write_text(json.dumps(report))


def _run_dense(out: Path, torchrec_dir: Path | None) -> list[dict[str, Any]]:
    path = (
        [str(TESTS), str(REPO)]
        if torchrec_dir is None
        else [str(torchrec_dir), str(TESTS), str(REPO)]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = f"import test_patches; test_patches._dense_job({str(out)!r})"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return json.loads(out.read_text())


def test_dense_sequence_kernel_on_cpu_trains_instead_of_corrupting_the_heap(
    patched_site: Path, tmp_path: Path
) -> None:
    # Stock 1.8.0: fbgemm's CPU dense lookup pools despite PoolingMode.NONE and the sequence
    # all-to-all writes past its output: the ranks abort ("corrupted size vs. prev_size").
    stock = _run_dense(tmp_path / "stock.json", None)
    assert not any(r["ok"] for r in stock), stock
    patched = _run_dense(tmp_path / "patched.json", patched_site)
    assert all(r["ok"] for r in patched), patched
    for r in patched:
        assert len(r["losses"]) == 3 and all(loss == loss for loss in r["losses"])
