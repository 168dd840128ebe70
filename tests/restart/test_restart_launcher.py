"""``python -m fastinit.restart``: a restarted worker forked by its rank's zygote is the worker a
fresh interpreter would have been, and nothing of the zygote outlives its job.

The torchrun test runs real torchrun (``--max-restarts 2``, 2 ranks) with rank 1 killed in the
first two attempts. The others use ``agent.py`` (beside this file) as the launcher of one rank,
so the test can signal and kill each process: the proxy passes signals on, a killed proxy takes
its worker with it, exit codes come through, a changed environment is refused and served again
by a new zygote, and the zygote exits when its launcher does.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from fastinit.restart import zygote
from fastinit.restart.launch import Target

HERE = pathlib.Path(__file__).resolve().parent
REPO = next(p for p in HERE.parents if (p / "pyproject.toml").exists())
WORKER = HERE / "worker.py"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

pytestmark = pytest.mark.timeout(240)


def _tmpdir(tmp_path: pathlib.Path) -> pathlib.Path:
    """The workers' TMPDIR: deeper than a socket path may be (108 bytes), as CI's can be."""
    return tmp_path / ("tmp-" + "d" * 100)


def _env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    tmpdir = _tmpdir(tmp_path)
    tmpdir.mkdir(exist_ok=True)
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(tmpdir),  # the zygotes' sockets live in a directory of this test
        "FASTINIT_RESTART_PRELOAD": "torch,numpy",
        **extra,
    }


def _records(out: pathlib.Path) -> dict[tuple[int, int], dict[str, Any]]:
    found = {}
    for path in out.glob("r*-a*.json"):
        rank, attempt = path.stem[1:].split("-a")
        found[int(rank), int(attempt)] = json.loads(path.read_text())
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read() and _alive(int(entry)):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _none_left(text: str, seconds: float = 5.0) -> bool:
    """Whether every process naming ``text`` is gone within ``seconds`` (a zygote checks for
    its launcher twice a second)."""
    deadline = time.monotonic() + seconds
    while _processes_naming(text) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _processes_naming(text)


def _sockets(tmp_path: pathlib.Path) -> list[str]:
    return sorted(str(p) for p in _tmpdir(tmp_path).glob("fastinit-restart-*/*.sock"))


def test_torchrun_restarts_are_forked_by_the_zygote_as_fresh_workers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    plan = {"1:0": "kill", "1:1": "kill"}
    cmd = [TORCHRUN, "--max-restarts", "2", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1"]
    cmd += ["-m", "fastinit.restart", str(WORKER), str(out)]
    env = _env(tmp_path, RESTART_TEST_PLAN=json.dumps(plan), LOGLEVEL="WARNING")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    records = _records(out)
    assert sorted(records) == [(r, a) for r in (0, 1) for a in (0, 1, 2)], log[-4000:]
    agent = records[0, 0]["ppid"]
    for (rank, attempt), rec in records.items():
        assert rec["served"] == (attempt > 0), (rank, attempt, log[-3000:])
        assert rec["launcher"] == agent  # what checkpoints ask: torchrun's agent, always
        assert rec["restart_count"] == str(attempt)
        assert rec["sid"] == rec["pid"]  # a session of its own, as torchrun starts workers
        assert rec["preloaded"] == ["numpy", "torch"]
        assert rec["argv"] == [str(WORKER), str(out)]
        assert rec["path0"] == str(HERE)
        assert rec["cwd"] == str(tmp_path)
        assert rec["umask"] == records[0, 0]["umask"]
        assert rec["sigint_default"] and rec["sigchld_default"]
        if attempt:
            assert rec["ppid"] != agent  # forked: its parent is the zygote's helper
            assert f"worker rank {rank} attempt {attempt} says hello" in log  # the proxy's stdout
    for draw in ("torch_seed", "random", "numpy"):  # every worker seeded afresh, as a new process
        values = [rec[draw] for rec in records.values()]
        assert len(set(values)) == len(values), (draw, values)
    assert log.count("exitcode: -9") == 2, log[-4000:]  # a forked worker's death reads the same
    assert _none_left(str(out)), "a zygote outlived torchrun"
    assert not _sockets(tmp_path)


def _agent(tmp_path: pathlib.Path, attempts: int, plan: dict[str, str], **env: Any):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    extra = {"RESTART_TEST_PLAN": json.dumps(plan)}
    if "attempt_env" in env:
        extra["RESTART_TEST_ATTEMPT_ENV"] = json.dumps(env.pop("attempt_env"))
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "agent.py"), str(attempts), str(out)],
        env=_env(tmp_path, **extra, **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    return proc, out


def _codes(proc: subprocess.Popen, attempts: int) -> dict[int, int]:
    """Every attempt's exit code (as the agent saw the proxy's), once the last one ended."""
    assert proc.stdout is not None
    codes: dict[int, int] = {}
    while len(codes) < attempts:
        line = proc.stdout.readline()
        assert line, "the agent ended early"
        if line.startswith("{"):
            msg = json.loads(line)
            codes[msg["attempt"]] = msg["code"]
    return codes


def _wait_for(path: pathlib.Path, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.02)


def _end(proc: subprocess.Popen) -> str:
    """Close the agent (as torchrun ends) and return its stderr."""
    _, err = proc.communicate(input="", timeout=30)
    return err


def test_exit_codes_come_through_and_a_changed_environment_gets_a_new_zygote(tmp_path):
    attempt_env = {"2": {"FOO": "1"}, "3": {"FOO": "1"}}
    proc, out = _agent(tmp_path, 4, {"0:1": "exit:3"}, attempt_env=attempt_env)
    try:
        codes = _codes(proc, 4)
        sockets = _sockets(tmp_path)
    finally:
        err = _end(proc)
    assert codes == {0: 0, 1: 3, 2: 0, 3: 0}, err
    records = _records(out)
    assert [records[0, a]["served"] for a in range(4)] == [False, True, False, True], err
    assert "the zygote refused this restart (the environment differs (FOO))" in err
    assert len(sockets) == 1  # the refused zygote left, attempt 2 made the one that served 3
    assert _gone(records[0, 3]["grandparent"])  # the zygote (the helper's parent)
    deadline = time.monotonic() + 5
    while _sockets(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _sockets(tmp_path), "the zygote outlived its launcher"
    assert _none_left(str(out))


def test_the_proxy_passes_signals_on_and_a_killed_proxy_takes_its_worker(tmp_path):
    proc, out = _agent(tmp_path, 3, {"0:1": "term", "0:2": "sleep:60"})
    try:
        _wait_for(out / "r0-a1.waiting")
        os.kill(int((out / "proxy-a1.pid").read_text()), signal.SIGTERM)  # what torchrun sends
        _wait_for(out / "r0-a2.json")
        worker = _records(out)[0, 2]["pid"]
        os.kill(int((out / "proxy-a2.pid").read_text()), signal.SIGKILL)
        codes = _codes(proc, 3)
        assert _gone(worker), "the worker outlived its killed proxy"
    finally:
        err = _end(proc)
    assert (out / "r0-a1.term").read_text() == str(int(signal.SIGTERM)), err
    assert codes == {0: 0, 1: 7, 2: -int(signal.SIGKILL)}, err
    assert _none_left(str(out))


def _two_fresh_attempts(tmp_path: pathlib.Path, **env: str) -> str:
    """Two attempts that both succeed, neither forked by a zygote; the agent's stderr."""
    proc, out = _agent(tmp_path, 2, {}, **env)
    try:
        codes = _codes(proc, 2)
    finally:
        err = _end(proc)
    assert codes == {0: 0, 1: 0}, err
    records = _records(out)
    assert not records[0, 0]["served"] and not records[0, 1]["served"], err
    return err


def test_a_socket_directory_others_can_use_is_never_used(tmp_path):
    shared = _tmpdir(tmp_path) / f"fastinit-restart-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o755)
    err = _two_fresh_attempts(tmp_path)
    assert "is not a directory only this user can use" in err
    assert not list(shared.iterdir())


def test_a_socket_directory_that_cannot_be_made_means_a_fresh_interpreter(tmp_path, monkeypatch):
    from fastinit.errors import RestartWarning
    from fastinit.restart import launch

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setattr(launch.tempfile, "tempdir", str(not_a_dir))
    with pytest.warns(RestartWarning, match="cannot be made"):
        assert launch.socket_path(1234, "5678", "0") is None


def test_a_socket_path_of_any_length_is_bound_and_reached(tmp_path, monkeypatch):
    from fastinit.restart import launch

    for tmpdir in (tmp_path / "t", _tmpdir(tmp_path)):
        tmpdir.mkdir()
        monkeypatch.setattr(launch.tempfile, "tempdir", str(tmpdir))
        path = launch.socket_path(1234, "5678", "0")
        assert path is not None and path.startswith(str(tmpdir))
        listener = launch._listen(path)
        assert listener is not None
        with listener:
            assert os.stat(path).st_mode & 0o777 == 0o600
            with launch._address(path) as address, socket.socket(socket.AF_UNIX) as client:
                client.connect(address)
                assert zygote.peer_uid(client) == os.getuid()


def test_a_zygote_gone_before_the_request_means_a_fresh_interpreter(tmp_path, monkeypatch):
    from fastinit.restart import launch

    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))
    path = launch.socket_path(1234, "5678", "0")
    assert path is not None
    listener = launch._listen(path)
    assert listener is not None

    def broken(*args: Any, **kwargs: Any) -> None:
        raise BrokenPipeError("the zygote closed the connection")

    monkeypatch.setattr(zygote, "send", broken)
    with listener:
        assert launch._ask(path, Target(None, "x.py", ()), launcher=1234) is None


def test_a_fork_that_fails_leaves_no_socket_and_runs_on(tmp_path, monkeypatch):
    from fastinit.errors import RestartWarning
    from fastinit.restart import launch

    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launch.threading, "active_count", lambda: 1)  # pytest's threads aside
    path = launch.socket_path(1234, "5678", "0")
    assert path is not None

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(launch.os, "fork", no_fork)
    with pytest.warns(RestartWarning, match="cannot fork a zygote"):
        assert launch._fork_zygote(path, 1234, "5678", dict(os.environ)) is None
    assert not os.path.exists(path)


def _request(env: dict[str, str], ident: tuple = ("py",)) -> zygote.Request:
    return zygote.Request(
        target=Target(None, "x.py", ()), env=env, cwd="/", umask=0o22, launcher=1, identity=ident
    )


def test_what_torchelastic_sets_per_attempt_is_ignored_and_nothing_else():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    same = {**base, "RANK": "3", "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert zygote.incompatible(_request(same), ("py",), base) is None
    assert "OMP_NUM_THREADS" in str(
        zygote.incompatible(_request({**base, "OMP_NUM_THREADS": "4"}), ("py",), base)
    )
    assert "PATH" in str(
        zygote.incompatible(_request({k: v for k, v in base.items() if k != "PATH"}), ("py",), base)
    )
    assert "interpreter" in str(zygote.incompatible(_request(base, ("other",)), ("py",), base))


def test_no_zygote_is_forked_from_a_process_with_threads(tmp_path):
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    env = {"FASTINIT_RESTART_PRELOAD": "torch,numpy,threaded"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{tmp_path}"
    err = _two_fresh_attempts(tmp_path, **env)
    assert err.count("the preload imports started a thread or CUDA") == 2, err
    assert not _sockets(tmp_path)


def test_a_forked_restart_resumes_from_host_memory_bit_equal(tmp_path):
    """The checkpoint's host-memory tier under the zygote: the restarted workers (forked, so
    their parent is not the agent) find their predecessors' writers by ``launcher_pid()``, wait
    for the save those were still writing (step 2, not step 1), load it with 0 bytes from
    storage, and hold what was saved."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [TORCHRUN, "--max-restarts", "1", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1"]
    cmd += ["-m", "fastinit.restart", str(HERE / "checkpoint_job.py"), str(out)]
    env = _env(tmp_path, LOGLEVEL="WARNING", FASTINIT_RESTART_PRELOAD="torch,torchrec")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for rank in (0, 1):
        got = json.loads((out / f"resumed-rank{rank}.json").read_text())
        assert got["served"] and got["step"] == 2, got
        assert got["storage_bytes"] == 0 and got["memory_bytes"] > 0, got
        assert got["compared"] > 0 and got["differ"] == [], got
    assert _none_left(str(out))
