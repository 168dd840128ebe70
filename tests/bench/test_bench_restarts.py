"""The kill-and-restart driver's analysis and report (``benchmarks/restarts/``), on records."""

from __future__ import annotations

import math

import pytest

from benchmarks.restarts import main as restarts


def _rec(mode: str, nproc: int, cycle: int, outcome: str, recover_s: float = 0.0) -> dict:
    rec = {"mode": mode, "nproc": nproc, "cycle": cycle, "outcome": outcome, "load_avg": [3.0]}
    if outcome == "recovered":
        rec.update(recover_s=recover_s, losses_equal=True)
    else:
        rec["detail"] = "run fastinit/small/recover failed (exit code 1; log x)\nmore"
    return rec


def test_summarize_and_report() -> None:
    records = [
        _rec("stock-best", 2, 0, "recovered", 9.0),
        _rec("stock-best", 2, 1, "failed"),
        _rec("stock-best", 2, 2, "hang"),
        _rec("fastinit", 2, 0, "recovered", 7.0),
        _rec("fastinit", 2, 1, "recovered", 8.0),
        _rec("fastinit", 2, 2, "recovered", 6.0),
        _rec("fastinit", 4, 0, "failed"),
    ]
    rows = {(r["nproc"], r["mode"]): r for r in restarts.summarize(records)}
    best = rows[(2, "stock-best")]
    assert (best["cycles"], best["recovered"], best["failed"], best["hung"]) == (3, 1, 1, 1)
    assert best["recover_median_s"] == 9.0
    fast = rows[(2, "fastinit")]
    assert fast["recovered"] == 3 and fast["recover_median_s"] == 7.0
    assert (fast["recover_min_s"], fast["recover_max_s"]) == (6.0, 8.0)
    assert rows[(4, "fastinit")]["recovered"] == 0
    assert math.isnan(rows[(4, "fastinit")]["recover_median_s"])
    summary = {
        "date": "2026-12-03",
        "machine": {"cpus": 2, "platform": "linux"},
        "versions": {"torch": "2.13.0"},
        "config": {"model": "small", "timeout_s": 600.0, "compile": True},
        "rows": restarts.summarize(records),
        "cycles": records,
        "command": "python -m benchmarks.restarts",
        "wall_s": 3600.0,
    }
    text = restarts.format_report(summary)
    assert "| 2 | stock-best | **1/3** | 1 | 1 | 9.0 | 9.0 | 9.0 |" in text
    assert "| 4 | fastinit | **0/1** | 1 | 0 | – | – | – | – |" in text
    records[4]["losses_equal"] = False
    text = restarts.format_report({**summary, "rows": restarts.summarize(records)})
    assert (
        "| 2 | fastinit | **3/3** | 0 | 0 | 7.0 | 6.0 | 8.0 | bit-equal in 2 of 3; **differ** in 1 |"
        in text
    )
    assert "not equal to before the kill:\n\n- fastinit, 2 ranks, cycle 1\n" in text
    assert "stock-best, 2 ranks, cycle 2: hang (run fastinit/small/recover failed" in text


def _launcher(pidfile) -> str:
    """A stand-in for torchrun: it starts a worker in a session of its own (as torchrun does),
    writes the worker's pid and waits."""
    return (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(300)\n"
    )


def _assert_gone(pid: int) -> None:
    import os
    import time

    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie of init's: gone
                return
        time.sleep(0.1)
    raise AssertionError(f"worker {pid} outlived its run")


def _spec(tmp_path, timeout_s: float):
    from benchmarks.ttfb.launch import RunSpec

    return RunSpec(
        mode="fastinit",
        model="tiny",
        cache="cold",
        out=str(tmp_path),
        inductor_dir="",
        timeout_s=timeout_s,
    )


def test_a_timed_out_run_takes_its_workers_with_it(tmp_path) -> None:
    """torchrun starts workers in sessions of their own; a run killed on timeout must not leave
    them behind (a hung restart's workers otherwise wait for hours)."""
    import os
    import sys

    from benchmarks.ttfb.launch import _run

    pidfile = tmp_path / "worker.pid"
    ok, detail = _run(
        [sys.executable, "-c", _launcher(pidfile)], dict(os.environ), _spec(tmp_path, 5)
    )
    assert not ok and "timed out" in detail
    _assert_gone(int(pidfile.read_text()))


def test_an_interrupted_run_takes_its_workers_with_it(tmp_path) -> None:
    """A run interrupted while it waits (Ctrl-C, a test's own timeout) kills what it started
    before the interruption goes on: torchrun and its workers must not outlive the caller."""
    import os
    import signal
    import sys

    from benchmarks.ttfb.launch import _run

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    pidfile = tmp_path / "worker.pid"
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(4)
    try:
        with pytest.raises(Interrupted):
            _run([sys.executable, "-c", _launcher(pidfile)], dict(os.environ), _spec(tmp_path, 60))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    _assert_gone(int(pidfile.read_text()))


def _write(path, records) -> None:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_missing_cycles_in_the_order_a_full_run_takes_them() -> None:
    done = [_rec("fastinit", 4, 0, "recovered", 1.0), _rec("stock-best", 4, 1, "failed")]
    done += [_rec(m, 2, c, "recovered", 1.0) for m in restarts.MODES for c in range(3)]
    assert restarts.missing_cycles(done, 3, 2) == []
    assert restarts.missing_cycles(done, 3, 4) == [
        (0, "stock-best"),
        (1, "fastinit"),
        (2, "stock-best"),
        (2, "fastinit"),
    ]


def test_resume_runs_only_the_missing_cycles_and_render_reads_them_all(
    tmp_path, monkeypatch
) -> None:
    """``--resume`` appends the missing cycles (priming only a layout that has no caches) and the
    summary is built from the whole file; ``--render`` runs nothing and writes the same table."""
    import json

    import benchmarks.ttfb.main as ttfb

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    settings = {"model": "tiny", "timeout_s": 60.0, "compile": False}
    old = [_rec("stock-best", 2, 0, "hang"), _rec("fastinit", 2, 0, "recovered", 5.0)]
    old.append({**_rec("fastinit", 2, 1, "recovered", 7.0), **settings})  # a later record
    _write(work / "cycles.jsonl", old)
    (work / "one" / "fastinit-tiny-2" / "shared.primed").mkdir(parents=True)
    ran, primed = [], []

    def fake_recover(config, layout, model, out_dir, label):
        assert (config.nproc, config.timeout_s, config.compile) == (2, 60.0, False)
        ran.append((layout.mode, label))
        return {"recovered": False, "outcome": "failed", "detail": "refused"}

    monkeypatch.setattr(ttfb, "run_recover", fake_recover)
    monkeypatch.setattr(ttfb, "prime", lambda mode, *a: primed.append(mode))
    common = ["--cycles", "2", "--nproc", "2", "--model", "tiny", "--timeout", "60"]
    common += ["--no-compile", "--work", str(work), "--out", str(out)]
    summary = restarts.main(["--resume", *common])
    assert ran == [("stock-best", "c1")] and primed == ["stock-best"]
    lines = (work / "cycles.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["timeout_s"] == 60.0
    row = {r["mode"]: r for r in summary["rows"]}
    assert (row["stock-best"]["cycles"], row["stock-best"]["hung"]) == (2, 1)
    assert (row["fastinit"]["recovered"], row["fastinit"]["recover_median_s"]) == (2, 6.0)
    assert summary["command"] == "python -m benchmarks.restarts " + " ".join(common)
    report = (out / "report.md").read_text()

    ran.clear()
    again = restarts.main(["--render", *common, "--note", "Cycle 1 ran later."])
    assert ran == [] and json.dumps(again["rows"]) == json.dumps(summary["rows"])
    rendered = (out / "report.md").read_text()
    assert "\nNote: Cycle 1 ran later.\n" in rendered
    undated = [line for line in report.splitlines() if not line.startswith(summary["date"])]
    rendered = rendered.replace("\nNote: Cycle 1 ran later.\n", "").replace(again["date"], "")
    assert [line for line in rendered.splitlines() if not line.startswith(",")] == undated
    assert again["command"] == summary["command"]
    assert json.loads((out / "summary.json").read_text())["cycles"] == summary["cycles"]


def test_render_refuses_other_settings_and_an_empty_file(tmp_path) -> None:
    import pytest

    work = tmp_path / "work"
    work.mkdir()
    args = ["--render", "--work", str(work), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="nothing to render"):
        restarts.main(args)
    _write(work / "cycles.jsonl", [{**_rec("fastinit", 2, 0, "hang"), "timeout_s": 60.0}])
    with pytest.raises(SystemExit, match="timeout_s=60.0, not 600.0"):
        restarts.main(args)


def test_failure_cause_is_the_workers_first_error() -> None:
    log = (
        "W1203 05:03:31.512000 9225 torch/distributed/run.py:874] Setting OMP_NUM_THREADS\n"
        "[E1203 03:50:18.919020837 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with "
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out "
        "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:17327$1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert restarts.failure_cause(log, "failed") == (
        "Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection refused, "
        "remote=[127.0.0.1]:17327$1"
    )
    assert restarts.failure_cause(log.splitlines()[-1], "failed").startswith("torch.distributed")
    assert "outlived the timeout" in restarts.failure_cause(log.splitlines()[0], "hang")
    assert restarts.failure_cause("", "failed") == ""


def _failing_runs(monkeypatch, *modules) -> list:
    """The ``RunSpec`` of every run the ``run_trainer`` of ``modules`` is asked for; each fails,
    as a restart that did not come back."""
    specs = []

    def fake_run(spec):
        specs.append(spec)
        raise RuntimeError("run failed (exit code 1)")

    for module in modules:
        monkeypatch.setattr(module, "run_trainer", fake_run)
    return specs


def test_the_recover_scenario_runs_with_max_restarts_1_on_both_launchers(
    tmp_path, monkeypatch
) -> None:
    """``make bench``'s recover scenario (and so every cycle) launches as users write it:
    ``torchrun --max-restarts 1``, also through the torchx component."""
    import benchmarks.ttfb.main as ttfb
    from benchmarks.ttfb.components import ttfb as component
    from benchmarks.ttfb.launch import _torchrun
    from benchmarks.ttfb.scenarios import Layout

    specs = _failing_runs(monkeypatch, ttfb)
    for launcher in ("torchrun", "torchx"):
        config = ttfb.BenchConfig(models=("tiny",), out=str(tmp_path), launcher=launcher)
        layout = Layout(root=str(tmp_path / launcher), mode="fastinit")
        res = ttfb.run_recover(config, layout, "tiny", str(tmp_path / "out"), "")
        assert res["outcome"] == "failed"
    assert [s.max_restarts for s in specs] == [1, 1]
    cmd = " ".join(_torchrun(2, specs[0].max_restarts))
    assert "--max-restarts 1 " in cmd
    app = component(mode="fastinit", model="tiny", max_restarts=specs[1].max_restarts)
    assert "torchrun --max_restarts 1 " in " ".join(app.roles[0].args)


def test_resume_refuses_other_settings_before_running_anything(tmp_path, monkeypatch) -> None:
    import pytest

    import benchmarks.ttfb.main as ttfb

    work = tmp_path / "work"
    work.mkdir()
    _write(work / "cycles.jsonl", [{**_rec("fastinit", 2, 0, "hang"), "compile": False}])
    monkeypatch.setattr(ttfb, "run_recover", lambda *a: pytest.fail("a cycle ran"))
    monkeypatch.setattr(ttfb, "prime", lambda *a: pytest.fail("a layout was primed"))
    with pytest.raises(SystemExit, match="compile=False, not True"):
        restarts.main(["--resume", "--cycles", "1", "--nproc", "2", "--work", str(work)])
    assert len((work / "cycles.jsonl").read_text().splitlines()) == 1


def test_an_interrupted_torchx_run_takes_torchrun_and_its_workers_with_it(tmp_path) -> None:
    """The same through torchx's local scheduler (``--launcher torchx``, the default): leaving
    the runner's context on an interruption terminates the app's process group, real torchrun
    included, and torchrun its workers."""
    import os
    import signal
    import socket
    import sys

    from torchx import specs

    from benchmarks.ttfb.launch import _run_torchx

    pidfile = tmp_path / "worker.pid"
    script = tmp_path / "worker.py"
    script.write_text(
        f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
    ]  # fmt: skip
    role = specs.Role(name="sleeper", image=str(tmp_path), entrypoint=sys.executable, args=torchrun)
    app = specs.AppDef(name="sleeper", roles=[role])

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        if not pidfile.exists():
            signal.alarm(1)  # the worker is not up yet
            return
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    try:
        with pytest.raises(Interrupted):
            _run_torchx(app, _spec(tmp_path, 120), dict(os.environ))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    _assert_gone(int(pidfile.read_text()))


def test_stock_restarts_get_a_store_per_round_unless_told_otherwise(tmp_path, monkeypatch) -> None:
    """``make bench``'s stock-best restarts (recover, checkpoint-heavy) run with torch's own
    workaround, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set in the workers' launch environment;
    fastinit mode never (its ``init_process_group`` would fall back to torch's); the restarts
    benchmark measures stock as written, on torchrun's shared store."""
    import pytest

    import benchmarks.ttfb.heavy as heavy
    import benchmarks.ttfb.launch as launch
    import benchmarks.ttfb.main as ttfb
    from benchmarks.restarts import main as restarts_main
    from benchmarks.ttfb.launch import RunSpec, _env
    from benchmarks.ttfb.scenarios import Layout

    specs = _failing_runs(monkeypatch, ttfb, launch)
    for choice in ("store-per-round", "shared-store"):
        config = ttfb.BenchConfig(models=("tiny",), out=str(tmp_path), stock_restart=choice)
        for mode in ("stock-best", "fastinit"):
            layout = Layout(root=str(tmp_path / choice / mode), mode=mode)
            ttfb.run_recover(config, layout, "tiny", str(tmp_path / "out"), "")
    var = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    assert [(s.mode, _env(s).get(var)) for s in specs] == [
        ("stock-best", "1"),
        ("fastinit", None),
        ("stock-best", None),
        ("fastinit", None),
    ]
    # the checkpoint-heavy scenario: the same choice per checkpointer
    specs.clear()
    config = ttfb.BenchConfig(models=(), out=str(tmp_path / "h"), heavy_repeats=1)
    out = heavy.run(config, labels=["stock-best", "fastinit"], model="tiny")
    assert set(out["not_recovered"]) == {"stock-best", "fastinit"}
    assert [(s.mode, _env(s).get(var)) for s in specs] == [("stock-best", "1"), ("fastinit", None)]
    with pytest.raises(ValueError, match="stock_restart"):
        ttfb.BenchConfig(stock_restart="per-attempt")
    with pytest.raises(ValueError, match="store_per_round"):
        RunSpec(
            mode="fastinit", model="tiny", cache="recover", out="o", inductor_dir="i",
            store_per_round=True,
        )  # fmt: skip
    # the restarts benchmark: stock as written
    configs = []
    monkeypatch.setattr(ttfb, "prime", lambda *a, **k: None)
    monkeypatch.setattr(
        ttfb,
        "run_recover",
        lambda config, *a: configs.append(config) or {"recovered": False, "outcome": "failed"},
    )
    (tmp_path / "r").mkdir()
    restarts_main.run_cycles(1, [2], "tiny", str(tmp_path / "r"), 60.0, False, ("stock-best",))
    assert [c.stock_restart for c in configs] == ["shared-store"]
