"""The ``fastinit`` command: plan ahead, then a 2-rank job hits the cache; report its traces."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from fastinit.testing.dist import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]

# A user's model module, as docs/usage.md writes it: the trainer and `fastinit plan` share it.
MODEL_PY = textwrap.dedent(
    """
    import torch
    from fastinit.testing.models import ModelSpec, build_model

    def build(num_tables: int = 8, device: str = "meta") -> torch.nn.Module:
        spec = ModelSpec(num_tables=num_tables, num_weighted_tables=2, num_ec_tables=2, rows=64)
        return build_model(spec, device=device)
    """
)


pytestmark = pytest.mark.usefixtures("fastinit_logger_restored")


def _cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout, whatever is installed
    env.pop("FASTINIT_PLAN_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "fastinit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _job(model_ref: str, cache_dir: str) -> dict[str, Any]:
    import torch

    import fastinit
    from fastinit.cli import load_factory
    from fastinit.startup import plan_key

    model = load_factory(model_ref)()
    key = plan_key(model, world_size=2, local_world_size=2, device=torch.device("cpu"))
    dmp = fastinit.setup(model, plan_cache=cache_dir, seed=3)
    plan = {path: sorted(mp) for path, mp in dmp.plan.plan.items()}
    return {"key": key.fingerprint.hex(), "plan": plan}


def test_plan_ahead_then_setup_hits_the_cache_and_report(tmp_path: pathlib.Path) -> None:
    from fastinit import report, trace
    from fastinit.cli import main

    (tmp_path / "my_model.py").write_text(MODEL_PY)
    cache, traces = tmp_path / "plans", tmp_path / "traces"
    # Planned from the model's directory, by module name, as a user would.
    done = _cli("plan", "my_model:build", "-n", "2", "--local-world-size", "2",
                "--cache", str(cache), "--json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "written"
    assert sum(summary["tables_by_type"].values()) == 12
    assert len(summary["rank_bytes"]) == 2 and all(b > 0 for b in summary["rank_bytes"])
    entry = pathlib.Path(summary["entry"])
    assert entry.is_file() and entry.name.startswith(summary["key"])
    described = json.loads((cache / f"{summary['key']}.inputs.json").read_text())
    assert described["inputs"]["consistent"] is True
    assert described["inputs"]["topology.world_size"] == 2
    # Which table got which layout: every table once, its type, kernel, ranks and shards.
    tables = summary["tables"]
    assert len(tables) == 12 and len({(t["module"], t["table"]) for t in tables}) == 12
    by_type: dict[str, int] = {}
    for t in tables:
        by_type[t["sharding_type"]] = by_type.get(t["sharding_type"], 0) + 1
        assert t["compute_kernel"] in summary["tables_by_kernel"]
        if t["sharding_type"] == "data_parallel":
            assert t["shards"] is None and t["ranks"] == [0, 1]
        else:
            assert t["shards"] and sorted({r for r, _, _ in t["shards"]}) == t["ranks"]
            assert all(len(offsets) == len(sizes) == 2 for _, offsets, sizes in t["shards"])
    assert by_type == summary["tables_by_type"]
    before = entry.read_bytes()

    # The job: 2 ranks, same factory, plan_cache pointing at the directory. It traces itself.
    ref = f"{tmp_path / 'my_model.py'}:build"
    env = {"FASTINIT_TRACE_DIR": str(traces)}
    results = run_ranks(_job, 2, args=(ref, str(cache)), env=env, timeout=300)
    assert [r["key"] for r in results] == [summary["key"]] * 2
    assert results[0]["plan"] == results[1]["plan"]
    assert entry.read_bytes() == before, "the job rewrote the entry it hit"
    for rank in (0, 1):
        events = trace.read_jsonl(str(traces / f"trace-rank{rank}.jsonl"))
        counts = trace.summarize(events)
        # A hit on every rank: no plan message. What is left is the start-up record's all_gather
        # and the replicated-value digest check, as with an explicit plan (tests/startup/test_setup.py).
        assert counts["c10d_ops"] == {"allgather_": 1, "allreduce_": 1}, counts["c10d_ops"]
        assert counts["barriers"] == 0 and counts["new_groups"] == 0
        assert "fastinit.setup" in counts["spans_s"]
        assert "fastinit.plan" not in counts["spans_s"], "a rank planned at start-up"

    # The same entry is found again, unchanged, when planned a second time (in process).
    assert main(["plan", ref, "-n", "2", "--cache", str(cache)]) == 0
    assert entry.read_bytes() == before

    # fastinit report on the job's own traces: the benchmark's picture, table and trace.
    out = tmp_path / "report"
    assert main(["report", str(traces), "--out", str(out), "--title", "cli test"]) == 0
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stages = (out / "stages.md").read_text()
    assert "fastinit.setup" in stages and "cli test" in stages
    chrome = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in chrome["traceEvents"]}
    assert "fastinit.setup" in names
    assert report.load(str(traces))[1].rank == 1


def test_a_different_job_misses_and_says_which_input(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from fastinit.cli import load_factory
    from fastinit.errors import PlanCacheError
    from fastinit.plan.cache import PlanCache
    from fastinit.plan.provenance import explain_miss, log_miss
    from fastinit.startup import plan_ahead, plan_key
    from fastinit.testing.models import build_plan

    (tmp_path / "my_model.py").write_text(MODEL_PY)
    build = load_factory(f"{tmp_path / 'my_model.py'}:build")
    cache = tmp_path / "plans"
    cpu = torch.device("cpu")
    assert "none from `fastinit plan`" in explain_miss(
        cache, build(), plan_key(build(), world_size=2, local_world_size=2, device=cpu)
    )
    summary = plan_ahead(build(), cache, world_size=2, local_world_size=2, device=cpu)
    planned = summary.key

    def miss(model: torch.nn.Module, world_size: int = 2, local: int = 2) -> str:
        key = plan_key(model, world_size=world_size, local_world_size=local, device=cpu)
        assert key.fingerprint.hex() != planned
        assert PlanCache(cache).get(key.fingerprint) is None
        return explain_miss(cache, model, key)

    with caplog.at_level(logging.INFO, logger="fastinit"):
        key4 = plan_key(build(), world_size=4, local_world_size=2, device=cpu)
        log_miss(cache, build(), key4)
    ours = [r for r in caplog.records if r.name.startswith("fastinit")]
    assert [r.levelno for r in ours] == [logging.WARNING]
    line = miss(build(), world_size=4)
    assert ours[0].getMessage() == line
    assert f"nearest entry {planned[:12]}" in line and "fastinit plan" in line
    assert "topology.world_size: planned 2, now 4" in line
    assert "topology.other" not in line and "planner.settings" not in line
    assert "topology.local_world_size: planned 2, now 1" in miss(build(), world_size=2, local=1)
    assert "table sparse.ebc.t8: not planned for, now 101x16 float32 meta" in miss(
        build(num_tables=9)
    )
    # Built on the CPU instead of "meta": the tables are named with both devices.
    line = miss(build(device="cpu"))
    assert "12 tables (sparse.ebc.t0, sparse.ebc.t1, ...): device planned meta, now cpu" in line

    # An entry of the same key holding another plan is not overwritten without --force.
    key = plan_key(build(), world_size=2, local_world_size=2, device=cpu)
    other = build_plan(build(), "row_wise", world_size=2)
    assert PlanCache(cache).put(key.fingerprint, other)
    with pytest.raises(PlanCacheError, match="different plan"):
        plan_ahead(build(), cache, world_size=2, local_world_size=2, device=cpu)
    again = plan_ahead(build(), cache, world_size=2, local_world_size=2, device=cpu, force=True)
    assert again.status == "replaced" and again.key == planned


def _fill_cache(model_ref: str, cache_dir: str) -> bool:
    import fastinit
    from fastinit.cli import load_factory

    fastinit.setup(load_factory(model_ref)(), plan_cache=cache_dir, seed=3)
    return True


def test_a_job_describes_the_entry_it_writes_as_fastinit_plan_does(
    tmp_path: pathlib.Path,
) -> None:
    import torch

    from fastinit.cli import load_factory
    from fastinit.plan.provenance import explain_miss
    from fastinit.startup import plan_ahead, plan_key

    (tmp_path / "my_model.py").write_text(MODEL_PY)
    ref = f"{tmp_path / 'my_model.py'}:build"
    cpu = torch.device("cpu")
    planned = plan_ahead(
        load_factory(ref)(), tmp_path / "planned", world_size=2, local_world_size=2, device=cpu
    )
    assert planned.inputs is not None
    # A job on a cold cache plans, fills the cache, and describes the entry as `plan` does.
    job_cache = tmp_path / "job"
    run_ranks(_fill_cache, 2, args=(ref, str(job_cache)), timeout=300)
    assert (job_cache / f"{planned.key}.fiplan").is_file()
    by_job = json.loads((job_cache / f"{planned.key}.inputs.json").read_text())
    by_plan = json.loads(pathlib.Path(planned.inputs).read_text())
    assert by_job["key"] == by_plan["key"] == planned.key
    assert by_job["inputs"] == by_plan["inputs"] and by_job["inputs"]["consistent"] is True
    assert by_job["written_by"] == "fastinit.setup"
    # So a later job that differs is told which input, from the job-written entry.
    build = load_factory(ref)
    key4 = plan_key(build(), world_size=4, local_world_size=2, device=cpu)
    line = explain_miss(job_cache, build(), key4)
    assert "(fastinit.setup," in line and "topology.world_size: planned 2, now 4" in line


PLANNER_PY = textwrap.dedent(
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    def planner(topology, world_size):
        assert topology.world_size == world_size
        return EmbeddingShardingPlanner(topology=topology, batch_size=world_size * 64)

    def sharders(**shape):
        return [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.5})]
    """
)


def test_plan_with_the_jobs_planner_sharders_and_factory_args(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from fastinit.cli import load_factory, main
    from fastinit.startup import plan_key

    (tmp_path / "my_model.py").write_text(MODEL_PY)
    (tmp_path / "my_planner.py").write_text(PLANNER_PY)
    model_ref, planner_py = f"{tmp_path / 'my_model.py'}:build", tmp_path / "my_planner.py"
    argv = ["plan", model_ref, "--arg", "num_tables=3", "-n", "4", "--nproc-per-node", "2",
            "--planner", f"{planner_py}:planner", "--sharders", f"{planner_py}:sharders",
            "--cache", str(tmp_path / "plans"), "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["planner"].endswith("EmbeddingShardingPlanner")
    assert summary["world_size"] == 4 and summary["local_world_size"] == 2
    assert len(summary["rank_bytes"]) == 4
    # What the job computes with the same planner and sharders: the same key.
    topology = Topology(world_size=4, local_world_size=2, compute_device="cpu")
    key = plan_key(
        load_factory(model_ref)(num_tables=3),
        world_size=4,
        local_world_size=2,
        device=torch.device("cpu"),
        sharders=load_factory(f"{planner_py}:sharders")(),
        planner=EmbeddingShardingPlanner(topology=topology, batch_size=256),
    )
    assert key.fingerprint.hex() == summary["key"]
    # A different factory argument is a different model, hence another key.
    assert main([*argv[:3], "num_tables=4", *argv[4:]]) == 0
    assert json.loads(capsys.readouterr().out)["key"] != summary["key"]


def test_command_errors_are_one_line_and_root_logging_is_left_alone(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastinit.cli import main

    monkeypatch.delenv("FASTINIT_PLAN_CACHE", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    cases = [
        (["plan", "nocolon", "-n", "2", "--cache", str(tmp_path)], "module:function"),
        (["plan", "no_such_module_xyz:f", "-n", "2", "--cache", str(tmp_path)], "no module"),
        (["plan", "os:path", "-n", "2"], "FASTINIT_PLAN_CACHE"),
        (["plan", "os:getcwd", "-n", "2", "--cache", str(tmp_path)], "not a torch.nn.Module"),
        (["report", str(tmp_path)], "FASTINIT_TRACE_DIR"),
        (["report", str(tmp_path / "missing")], "not a directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert root.handlers == handlers and root.level == level
    assert logging.getLogger("fastinit").propagate is False


def test_the_command_and_provenance_import_light() -> None:
    code = (
        "import sys, fastinit.cli, fastinit.plan.provenance\n"
        "try:\n    fastinit.cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(','.join(m for m in ('torch', 'torchrec') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import fastinit

    # The version, then the heavy modules loaded: none.
    assert out.stdout.splitlines() == [f"fastinit {fastinit.__version__}", ""], out.stdout
