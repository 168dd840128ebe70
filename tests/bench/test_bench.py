"""The time-to-first-batch benchmark: its analysis on recorded traces, its scenario rules, and
one small end-to-end run so it cannot rot.

Recorded traces: ``benchmarks/ttfb/testdata/tiny-cold`` (a real 2-rank run of the trainer, tiny model,
eager dense arch). End to end: two ranks (gloo, 127.0.0.1), the tiny model with an eager dense
arch, one repeat, every mode, cold and same-hosts, the floor, launched through torchrun.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from benchmarks.ttfb.trainer import STAGES

FIXTURE = (
    pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "ttfb" / "testdata" / "tiny-cold"
)


def _paths(mode: str) -> list[str]:
    return [str(FIXTURE / mode / f"trace-rank{r}.jsonl") for r in (0, 1)]


def test_analyse_run_on_recorded_traces() -> None:
    from benchmarks.ttfb.analysis import TIMELINE, analyse_run

    stock, fast = analyse_run(_paths("stock")), analyse_run(_paths("fastinit"))
    # Recorded values: time to first batch is the slower rank's.
    assert stock["ttfb_s"] == pytest.approx(17.740, abs=1e-3)
    assert fast["ttfb_s"] == max(r["ttfb_s"] for r in fast["ranks"])
    for res in (stock, fast):
        assert set(res["stages_s"]) == set(TIMELINE)
        for rank in res["ranks"]:
            assert set(STAGES) <= set(rank["stages_s"])
            end = max(rank["stage_start_s"][s] + rank["stages_s"][s] for s in STAGES)
            assert rank["ttfb_s"] >= end - 0.05
    # Exact counts: stock plans with 2 broadcasts and gathers per table in DMP; fastinit's whole
    # set-up is one record exchange (+ at most one plan message); its warm-up's training
    # collectives are counted apart.
    s, f = stock["setup"], fast["setup"]
    assert s["c10d_ops"] == 13 and 1 <= f["c10d_ops"] <= 2
    assert f["c10d_bytes"] < s["c10d_bytes"] and f["barriers"] == 0
    assert fast["warmup"]["c10d_ops"] > 0 and stock["warmup"]["c10d_ops"] == 0
    assert set(stock["setup_by_op"]) >= {"broadcast_", "allgather_"}


def test_analyse_floor_and_stock_best_on_recorded_traces() -> None:
    from benchmarks.ttfb.analysis import analyse_floor, analyse_run, floor_of

    data = FIXTURE.parent
    for scenario in ("tiny-cold", "tiny-same-hosts"):
        paths = [str(data / scenario / "floor" / f"trace-rank{r}.jsonl") for r in (0, 1)]
        floor = analyse_floor(paths)
        assert floor["floor_s"] == max(r["floor_s"] for r in floor["ranks"])
        for rank in floor["ranks"]:
            assert set(rank["seconds"]) == {
                "launch",
                "build",
                "process_group_init",
                "get_first_batch_data",
                "first_step",
            }
            assert rank["floor_s"] == floor_of(rank["seconds"])[0]
            assert rank["floor_s"] < sum(rank["seconds"].values())
    # Recorded: rank 1 of the cold floor is the slower, 10.858 s, through the model's chain.
    cold = analyse_floor(
        [str(data / "tiny-cold" / "floor" / f"trace-rank{r}.jsonl") for r in (0, 1)]
    )
    assert cold["floor_s"] == pytest.approx(10.858, abs=1e-3)
    assert cold["chain"] == ["launch", "process_group_init", "build", "first_step"]
    # stock-best restarting with its saved plan: no planning messages, but DMP's still go out.
    paths = [str(data / "tiny-same-hosts" / "stock-best" / f"trace-rank{r}.jsonl") for r in (0, 1)]
    best = analyse_run(paths)
    assert best["ranks"][0]["info"]["saved_plan"] == "loaded"
    assert best["setup"]["c10d_ops"] == 11
    assert analyse_run(_paths("stock"))["setup"]["c10d_ops"] == 13


def test_analyse_run_rejects_other_traces(tmp_path: pathlib.Path) -> None:
    from benchmarks.ttfb.analysis import analyse_floor, analyse_run

    path = tmp_path / "trace-rank0.jsonl"
    path.write_text(json.dumps({"kind": "meta", "rank": 0}) + "\n")
    with pytest.raises(ValueError, match="not a trainer trace"):
        analyse_run([str(path)])
    with pytest.raises(ValueError, match="not a floor trace"):
        analyse_floor([str(path)])


def test_floor_is_launch_plus_longest_chain() -> None:
    from benchmarks.ttfb.analysis import floor_of

    pieces = {
        "launch": 2.0,
        "process_group_init": 0.1,
        "build": 1.0,
        "first_step": 3.0,
        "get_first_batch_data": 0.5,
    }
    assert floor_of(pieces) == (
        pytest.approx(6.1),
        ["launch", "process_group_init", "build", "first_step"],
    )
    slow_data = {**pieces, "get_first_batch_data": 9.0}
    assert floor_of(slow_data) == (pytest.approx(11.0), ["launch", "get_first_batch_data"])


def _fake_mode(ttfb: float, ops: int = 1) -> dict[str, Any]:
    from benchmarks.ttfb.analysis import TIMELINE

    counts = dict.fromkeys(
        ("c10d_ops", "c10d_bytes", "barriers", "new_groups", "store_ops", "store_bytes"), ops
    )
    return {
        "ttfb_s": ttfb,
        "stages_s": dict.fromkeys(TIMELINE, 0.1),
        "setup": counts,
        "warmup": counts,
        "peak_rss_mb": 100.0,
    }


def test_table_rows_and_targets() -> None:
    from benchmarks.ttfb.analysis import table_rows
    from benchmarks.ttfb.report import (
        format_first_step,
        format_nth_batch,
        format_table,
        format_targets,
        targets,
    )

    results = {
        "large": {
            "cold": {
                "stock": _fake_mode(100.0),
                "stock-best": _fake_mode(99.0),
                "fastinit": _fake_mode(29.0),
            },
            "new-hosts": {
                "stock": _fake_mode(100.0),
                "stock-best": _fake_mode(20.0) | {"nth_batch_s": 30.0},
                "fastinit": _fake_mode(17.0) | {"steady_step_s": 0.05, "nth_batch_s": 21.0},
            },
        }
    }
    floors = {"large": {"cold": {"floor_s": 26.0, "chain": ["launch"], "pieces_s": {}}}}
    rows = table_rows(results, floors)
    cold, restart = rows
    assert cold["vs_stock"] == pytest.approx(0.29) and cold["vs_floor"] == pytest.approx(29 / 26)
    assert restart["vs_best"] == pytest.approx(0.85) and math.isnan(restart["vs_floor"])
    met = {(t.what, t.limit): t.met for t in targets(rows, nproc=4)}
    assert met == {
        ("large / cold, 4 ranks: fastinit / floor", 1.15): True,
        ("large / cold, 4 ranks: fastinit / stock", 0.3): True,
        ("large / new-hosts, 4 ranks: fastinit / stock-best", 0.8): False,
        # issue 32 item 5: the 20th batch, not the first step against a steady one
        ("large / new-hosts, 4 ranks: time to the 20th batch, fastinit / stock-best", 0.8): True,
    }
    assert restart["nth_vs_best"] == pytest.approx(0.7)
    assert "| large | new-hosts | – | 30.0 | 21.0 | **0.70** |" in format_nth_batch(rows)
    assert restart["first_vs_steady"] == pytest.approx(2.0)  # still reported, as information
    assert "| large | new-hosts | 0.10 | 0.05 | **2.00** |" in format_first_step(rows)
    assert not any(t.limit == 0.3 for t in targets(rows, nproc=2))  # large cold: 4 ranks only
    restart = [t for t in targets(rows, nproc=2) if t.what.endswith("fastinit / stock-best")]
    assert [(t.limit, t.met) for t in restart] == [(0.8, False), (0.8, True)]
    assert "| large | new-hosts | 100.0 | 20.0 | 17.0 | – | **0.85** |" in format_table(rows)
    assert "**no**" in format_targets(targets(rows, nproc=4))


def test_scenario_rules(tmp_path: pathlib.Path) -> None:
    from benchmarks.ttfb.scenarios import Layout, is_primed, prepare, snapshot_primed

    layouts = {
        m: Layout(root=str(tmp_path / m), mode=m) for m in ("stock", "stock-best", "fastinit")
    }
    assert layouts["stock"].cache_dir is None
    assert layouts["stock-best"].inductor_dir.startswith(layouts["stock-best"].shared)
    assert layouts["fastinit"].inductor_dir.startswith(layouts["fastinit"].host)
    for layout in layouts.values():
        prepare(layout, "cold")
        for d in (layout.shared, layout.host):
            pathlib.Path(d, "from-prime").write_text("x")
        assert not is_primed(layout)
        snapshot_primed(layout)
        assert is_primed(layout)
        pathlib.Path(layout.shared, "written-later").write_text("y")
        prepare(layout, "same-hosts")  # everything kept
        assert {"from-prime", "written-later"} <= set(os.listdir(layout.shared))
        assert "from-prime" in os.listdir(layout.host)
        prepare(layout, "new-hosts")  # shared as primed, host-local empty
        assert "from-prime" in os.listdir(layout.shared)
        assert "written-later" not in os.listdir(layout.shared)
        assert [p for p in os.listdir(layout.host) if p != "inductor"] == []
        prepare(layout, "cold")
        assert [p for p in os.listdir(layout.shared) if p != "inductor"] == []
    with pytest.raises(ValueError, match="unknown scenario"):
        prepare(layouts["stock"], "warm")


@pytest.mark.timeout(600)
def test_bench_end_to_end(tmp_path: Any) -> None:
    from benchmarks.ttfb import main as bench

    out = str(tmp_path / "bench-out")
    summary = bench.main(
        [
            "--models", "tiny",
            "--scenarios", "cold,same-hosts",
            "--repeats", "1",
            "--nproc", "2",
            "--no-compile",
            "--launcher", "torchrun",
            "--out", out,
        ]
    )  # fmt: skip
    for name in ("summary.json", "report.md", "timeline.png", "trace.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "summary.json")) as f:
        on_disk = json.load(f)
    assert on_disk["results"].keys() == summary["results"].keys() == {"tiny"}
    res = on_disk["results"]["tiny"]
    for scenario in ("cold", "same-hosts"):
        for mode in ("stock", "stock-best", "fastinit"):
            assert res[scenario][mode]["ttfb_s"] > 0
        floor = on_disk["floors"]["tiny"][scenario]
        assert floor["floor_s"] > 0 and floor["chain"][0] == "launch"
    # stock-best restarted from its saved plan: no planning messages; stock planned again.
    best, stock = res["same-hosts"]["stock-best"], res["same-hosts"]["stock"]
    assert best["info"]["saved_plan"] == "loaded"
    assert best["setup"]["c10d_ops"] < stock["setup"]["c10d_ops"]
    assert res["cold"]["stock-best"]["info"]["saved_plan"] == "none"
    assert 1 <= res["same-hosts"]["fastinit"]["setup"]["c10d_ops"] <= 2
    import torchrec

    assert on_disk["versions"]["torchrec"] == torchrec.__version__  # the installed one
    with open(os.path.join(out, "report.md")) as f:
        report = f.read()
    assert "fastinit / stock-best" in report and "| tiny | same-hosts |" in report
    assert "## Targets" in report and "floor pieces" in report
    assert "First compiled step against a steady-state compiled step" in report
    assert res["same-hosts"]["fastinit"]["steady_step_s"] > 0  # the steps after the first

    # make prime, then make ttfb twice: each one run, starting from the primed state.
    args = ["--out", out, "--no-compile", "--launcher", "torchrun"]
    with pytest.raises(SystemExit, match="make prime"):
        bench.main(["--one", "stock-best", "tiny", "new-hosts", "2", *args])
    bench.main(["--prime", "stock-best", "tiny", "new-hosts", "2", *args])
    for _ in range(2):
        one = bench.main(["--one", "stock-best", "tiny", "new-hosts", "2", *args])
        assert one["ranks"][0]["info"]["saved_plan"] == "loaded"


def test_cold_single_run_needs_no_prime(tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """``make ttfb CACHE=cold`` runs without ``make prime`` (there is nothing to prime); a restart
    scenario still asks for it."""
    from benchmarks.ttfb import main as bench

    ran: list[str] = []
    monkeypatch.setattr(bench, "_ensure_data", lambda config, model: ran.append("data"))
    monkeypatch.setattr(bench, "run_trainer", lambda spec: ran.append("run") or spec)
    monkeypatch.setattr(
        bench,
        "analyse_run",
        lambda run: {"ttfb_s": 1.0, "stages_s": dict.fromkeys(bench.TIMELINE, 0.1), "setup": {}},
    )
    config = bench.BenchConfig(out=str(tmp_path), nproc=4)
    result = bench.run_single("stock", "large", "cold", config)
    assert result["ttfb_s"] == 1.0 and ran == ["data", "run"]
    with pytest.raises(SystemExit, match="make prime"):
        bench.run_single("stock", "large", "same-hosts", config)


def test_first_step_once_every_rank_is_in_it(tmp_path: Any) -> None:
    """A rank that enters the first step early waits there for the others: the plain first step
    (max over ranks) counts that wait, the synced one starts when the last rank enters."""
    import json

    from benchmarks.ttfb.analysis import analyse_run

    paths = []
    for rank, (start, end) in enumerate([(10.0, 11.0), (10.8, 11.0)]):
        events = [
            {"kind": "meta", "rank": rank},
            {"kind": "span", "name": "first_step", "ts": start * 1e6, "dur": (end - start) * 1e6},
            {"kind": "span", "name": "step", "step": 2, "ts": 11e6, "dur": 0.1e6},
            {"kind": "bench", "process_start": 0.0, "ttfb_s": end, "peak_rss_mb": 1.0},
        ]
        path = tmp_path / f"trace-rank{rank}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        paths.append(str(path))
    out = analyse_run(paths)
    assert out["stages_s"]["first_step"] == pytest.approx(1.0)
    assert out["first_step_synced_s"] == pytest.approx(0.2)
    assert out["steady_step_s"] == pytest.approx(0.1)
    assert math.isnan(out["nth_batch_s"])  # not 20 batches


def test_steps_as_the_tracer_records_them_and_the_20th_batch(tmp_path: Any) -> None:
    """The tracer keeps a span's keywords under ``attrs``: every step is its own (the steady
    step is the median of them, max over ranks per step), and the 20th batch ends with the 19th
    step after the first, the slower rank's."""
    from benchmarks.ttfb.analysis import analyse_run

    paths = []
    for rank in (0, 1):
        events: list[dict[str, Any]] = [
            {"kind": "span", "name": "first_step", "ts": 9e6, "dur": 1e6},
            {"kind": "bench", "process_start": 0.0, "ttfb_s": 10.0, "peak_rss_mb": 1.0},
        ]
        for step in range(2, 21):  # steps 2..20, 0.1 s each (rank 1: step 2 takes 1 s)
            dur = 1.0 if (rank, step) == (1, 2) else 0.1
            start = 10.0 + (step - 2) * 0.1 + (0.9 if rank == 1 and step > 2 else 0.0)
            events.append(
                {"kind": "span", "name": "step", "ts": start * 1e6, "dur": dur * 1e6,
                 "attrs": {"step": step}}
            )  # fmt: skip
        path = tmp_path / f"trace-rank{rank}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        paths.append(str(path))
    out = analyse_run(paths)
    assert out["steady_step_s"] == pytest.approx(0.1)  # not the last step alone, not step 2's 1 s
    assert out["ranks"][0]["steps_s"].keys() == set(range(2, 21))
    assert out["nth_batch_s"] == pytest.approx(10.0 + 18 * 0.1 + 0.9 + 0.1)


def test_trainer_flags_for_background_compile_and_prefetch() -> None:
    from benchmarks.ttfb.trainer import TrainerConfig, _parse

    config = _parse(["--compile-in-background", "--compile-prefetch", "on"])
    assert config.compile_in_background and config.compile_prefetch == "on"
    default = _parse([])
    assert not default.compile_in_background and default.compile_prefetch == "auto"
    with pytest.raises(ValueError, match="compile_prefetch"):
        TrainerConfig(compile_prefetch="sometimes")
    assert _parse(["--pipeline-fill", "startup"]).pipeline_fill == "startup"
    assert default.pipeline_fill == "first-step"
    with pytest.raises(ValueError, match="pipeline_fill"):
        TrainerConfig(pipeline_fill="later")


def _trainer_losses(tmp_path: pathlib.Path, *flags: str) -> tuple[dict[str, Any], list[str]]:
    """Rank 0's losses (4 steps, tiny model, eager, 2 ranks) and the start-up stages it ran."""
    from benchmarks.ttfb.data import DatasetConfig, ensure_dataset
    from benchmarks.ttfb.trainer import model_spec
    from fastinit.testing.dist import free_port

    data = str(tmp_path / "data")
    ensure_dataset(DatasetConfig(spec=model_spec("tiny")), data)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "benchmarks.ttfb.trainer", "--mode", "fastinit", "--model", "tiny", "--no-compile",
        "--steps", "4", "--data-dir", data, "--out", str(out), *flags,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    events = [json.loads(line) for line in (out / "trace-rank0.jsonl").read_text().splitlines()]
    (bench,) = (e for e in events if e.get("kind") == "bench")
    return bench["losses"], [e["name"] for e in events if e.get("kind") == "span"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[str]]:
    """The fastinit trainer with its defaults (every part), shared by the tests that compare."""
    return _trainer_losses(tmp_path_factory.mktemp("plain"))


def test_pipeline_fill_at_startup_trains_the_same(
    tmp_path: pathlib.Path, plain_run: tuple[dict[str, Any], list[str]]
) -> None:
    """``--pipeline-fill startup``: TorchRec's fill runs as the last start-up stage; the steps
    train exactly what they train with the fill inside the first step."""
    plain, plain_spans = plain_run
    early, early_spans = _trainer_losses(tmp_path, "--pipeline-fill", "startup")
    assert "pipeline_fill" in early_spans and "pipeline_fill" not in plain_spans
    assert len(plain) == 4 and early == plain, (plain, early)


def test_the_one_line_change_alone_trains_the_same(
    tmp_path: pathlib.Path, plain_run: tuple[dict[str, Any], list[str]]
) -> None:
    """``--fastinit-parts setup``: stock's sequential trainer with ``fastinit.setup`` (no plan
    cache, no stage graph, no warm-up): the same losses as all of fastinit."""
    from benchmarks.ttfb.trainer import TrainerConfig, _parse

    assert _parse([]).fastinit_parts == "all"
    assert _parse(["--fastinit-parts", "plan-cache"]).fastinit_parts == "plan-cache"
    with pytest.raises(ValueError, match="fastinit_parts"):
        TrainerConfig(fastinit_parts="some")
    with pytest.raises(ValueError, match="needs mode fastinit"):
        TrainerConfig(mode="stock", fastinit_parts="setup")
    plain, _ = plain_run
    alone, spans = _trainer_losses(tmp_path, "--fastinit-parts", "setup")
    assert "fastinit.setup" in spans and "fastinit.plan" in spans  # it planned: no cache
    assert len(plain) == 4 and alone == plain, (plain, alone)


def test_parts_rows_ratios_and_projection() -> None:
    from benchmarks.parts.report import VARIANTS, format_parts, parts_rows, project_parts, variant

    def runs(*seconds: float, ops: int = 2) -> list[dict[str, Any]]:
        stages = {"launch": 1.0, "device_init": 2.0, "pre_train": 5.0}
        return [
            {"ttfb_s": t, "load_avg": 1.5, "setup": {"c10d_ops": ops}, "stages_s": stages}
            for t in seconds
        ]

    measured = {
        "stock-best-eager": runs(10.0, 12.0, 11.0, ops=17),
        "setup": runs(9.0, 8.0, 10.0, ops=3),
        "plan-cache": runs(7.7, 7.7),
        "stock-best": runs(8.0),
        "all": runs(6.0),
    }
    rows = {r["variant"]: r for r in parts_rows(measured)}
    assert "stock-eager" not in rows  # not measured, not shown
    assert rows["setup"]["ttfb_s"] == 9.0 and rows["setup"]["vs_baseline"] == pytest.approx(9 / 11)
    # per repeat: 9/10, 8/12, 10/11 -> the median of the ratios
    assert rows["setup"]["vs_baseline_paired"] == pytest.approx(9 / 10)
    assert rows["setup"]["imports_s"] == pytest.approx(3.0)  # launch + device_init
    assert rows["plan-cache"]["vs_baseline"] == pytest.approx(0.7)
    assert rows["all"]["vs_baseline"] == pytest.approx(0.75)  # against the compiled stock-best
    assert (
        math.isnan(rows["stock-best"]["vs_baseline"]) and rows["stock-best-eager"]["c10d_ops"] == 17
    )
    assert [v.name for v in VARIANTS if v.name in rows] == list(rows)  # the table's order
    with pytest.raises(ValueError, match="unknown variant"):
        variant("nope")

    # The projection: planning only where a variant plans at every start, each side's local work.
    def summary(ttfb: float, ops: int) -> dict[str, Any]:
        return {
            "ttfb_s": ttfb,
            "stages_s": {"process_group_init": 1.0, "train_module_creation": 2.0},
            "setup": {"store_ops": 10},
            "setup_by_op": {"allgather_": {"count": ops, "bytes": 100 * ops}},
        }

    measurements = {
        "store_op_s": 1e-5,
        "sizes": {"1024": {"pickle": 1000, "codec": 100}, "4096": {"pickle": 4000, "codec": 100}},
        "planning": {"stock": {"2": 1.0, "8": 4.0}, "fastinit": {"2": 0.1, "8": 0.2}},
    }
    fits = {"stock": (0.01, 1.0), "fastinit": (0.3, 0.0)}
    projected = project_parts(
        {
            "setup": summary(9.0, 1),
            "plan-cache": summary(7.7, 1),
            "stock-best-eager": summary(11, 5),
        },
        measurements=measurements,
        local_fits=fits,
    )
    at = {(p["variant"], p["ranks"]): p for p in projected}
    assert set(at) == {
        (v, n) for v in ("setup", "plan-cache", "stock-best-eager") for n in (1024, 4096)
    }
    assert at[("setup", 4096)]["planning_s"] > 0 and at[("plan-cache", 4096)]["planning_s"] == 0
    assert at[("stock-best-eager", 4096)]["local_s"] == pytest.approx(0.01 * 4096)
    assert at[("plan-cache", 4096)]["local_s"] == pytest.approx(0.3)
    assert at[("plan-cache", 1024)]["single_host_fixed_s"] == pytest.approx(7.7 - 3.0)
    text = format_parts(list(rows.values()), projected, title="tiny")
    assert "### tiny" in text and "| fastinit: + plan cache | 7.7 |" in text and "| 0.70 |" in text
    assert "at 4,096 ranks: scale-dependent s" in text and "(planning " in text


def test_unsharded_model_is_the_trainers_model_on_the_cpu() -> None:
    # the factory `fastinit publish --model benchmarks.ttfb.trainer:unsharded_model` loads the trainer's
    # checkpoints into: the model the trainer shards (built on meta there), real tensors here
    from benchmarks.ttfb.trainer import model_spec, unsharded_model
    from fastinit.testing.models import build_model

    model = unsharded_model("small")
    meta = build_model(model_spec("small"), device="meta")
    got = {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in model.state_dict().items()}
    want = {k: (tuple(v.shape), v.dtype, "cpu") for k, v in meta.state_dict().items()}
    assert got == want and len(got) > 10


@pytest.mark.parametrize("workers", [1, 3])
def test_data_resumes_at_a_batch_without_building_the_skipped_ones(
    tmp_path: pathlib.Path, workers: int
) -> None:
    """A loader started at batch K yields what a loader from 0 yields after K batches, whatever
    K is modulo the workers (the DataLoader takes batch n from worker n % workers)."""
    import itertools

    import torch

    from benchmarks.ttfb.data import DataConfig, DatasetConfig, ensure_dataset, make_loader
    from benchmarks.ttfb.trainer import model_spec

    spec = model_spec("tiny")
    path = ensure_dataset(DatasetConfig(spec=spec, rows_per_file=256), str(tmp_path))
    config = DataConfig(batch_size=64, num_workers=workers, context="fork")

    def batches(start: int, n: int) -> list[tuple[Any, ...]]:
        it = iter(make_loader(path, spec, config, rank=1, world_size=2, start=start))
        return [
            (b.dense, b.sparse.values(), b.sparse.lengths(), b.labels)
            for b in itertools.islice(it, n)
        ]

    whole = batches(0, 40)
    for start in (1, 5, 8, 29):  # 29: whole files (4 batches each) skipped unread, cycling
        got = batches(start, 40 - start)
        assert len(got) == 40 - start
        for a, b in zip(got, whole[start:], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), start
    assert not all(torch.equal(x, y) for x, y in zip(whole[0], whole[1], strict=True))
