"""``fastinit.init_process_group``: every torchrun restart on keys of its own, every wait bounded.

Unit tests run the round agreement on threads against a real ``TCPStore`` (standing in for the
agent's), seeded with what a dead attempt leaves: a round record whose beacon is gone, gloo peer
records. The torchrun tests (``restart_job.py`` beside this file) kill a rank under ``--max-restarts 1`` and
make the race a restart loses deterministic: the killed rank's gloo record points at a dead port
that makes its peer the dialler, and the restarted rank comes back after rank 0 has looked for it.
Stock ``env://`` then fails in the restart ("Connection refused"); fastinit's path trains. With two
torchrun agents (slow), the restart counts of one round differ between ranks, and a prefix per
``TORCHELASTIC_RESTART_COUNT`` fails where fastinit's round token does not.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from fastinit import knobs
from fastinit.errors import StartupError
from fastinit.pg import rendezvous
from fastinit.testing.dist import free_port

HERE = pathlib.Path(__file__).resolve()
JOB = HERE.with_name("restart_job.py")  # beside this file, wherever tests/ is arranged
REPO = next(p for p in HERE.parents if (p / "pyproject.toml").exists())


def _server() -> Any:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))


def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agree(port: int, world: int, ranks: list[int], seconds: float, delay: dict[int, float]):
    """Run ``agree_on_round`` for ``ranks`` on threads; each rank's token or exception."""
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        time.sleep(delay.get(rank, 0.0))
        try:
            out[rank] = rendezvous.agree_on_round(
                _client(port), rank, world, "job", time.monotonic() + seconds
            )
        except Exception as e:  # recorded for the assertions
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)
    return out


def test_round_agreement_ignores_a_dead_rounds_record() -> None:
    server = _server()
    stale = {"token": "0" * 32, "host": "127.0.0.1", "port": _closed_port()}
    server.set(rendezvous.ROUND_KEY.format(run_id="job"), json.dumps(stale))
    # Rank 0 comes last: ranks 1 and 2 read the dead attempt's record first.
    tokens = _agree(server.port, 3, [0, 1, 2], 30.0, {0: 0.5})
    assert all(isinstance(t, str) for t in tokens.values()), tokens
    assert len(set(tokens.values())) == 1 and tokens[0] != stale["token"]
    prefix = rendezvous.round_prefix("job", tokens[0])
    assert server.add(f"{prefix}/joined", 0) == 2
    # The beacon is closed once the round agreed: the record it leaves is a dead one.
    record = json.loads(server.get(rendezvous.ROUND_KEY.format(run_id="job")))
    assert record["token"] == tokens[0]
    assert rendezvous._probe("127.0.0.1", record["port"], timedelta(seconds=2)) is None


def test_a_live_listener_with_another_token_is_not_the_round() -> None:
    server = _server()
    with rendezvous._Beacon("f" * 32) as other:  # another job's (or round's) live beacon
        stale = {"token": "0" * 32, "host": "127.0.0.1", "port": other.port}
        server.set(rendezvous.ROUND_KEY.format(run_id="job"), json.dumps(stale))
        tokens = _agree(server.port, 2, [1], 1.5, {})
    assert isinstance(tokens[1], StartupError) and "no live restart round" in str(tokens[1])
    assert "0" * 32 in str(tokens[1])  # says which record it last saw


def test_leader_names_the_ranks_that_never_join() -> None:
    server = _server()
    t0 = time.monotonic()
    out = _agree(server.port, 4, [0, 2], 2.0, {})
    assert time.monotonic() - t0 < 20
    assert isinstance(out[2], str)  # rank 2 joined the round
    assert isinstance(out[0], StartupError)
    assert "rank(s) [1, 3] of 4 did not join" in str(out[0])


def test_init_timeout_is_checked_before_any_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastinit

    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_closed_port()),
    }.items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    for bad in ("nan", "inf", "0", "1e999", "soon"):
        with knobs.override(FASTINIT_INIT_TIMEOUT=bad), pytest.raises(ValueError) as info:
            fastinit.init_process_group("gloo")
        assert "FASTINIT_INIT_TIMEOUT" in str(info.value) and repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="init_timeout"):
        fastinit.init_process_group("gloo", init_timeout=-1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="default process group twice"):
            fastinit.init_process_group("gloo")
    finally:
        dist.destroy_process_group()
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_ADDR not set"):
        fastinit.init_process_group("gloo")
    assert time.monotonic() - t0 < 10  # no store connection was tried
    assert not dist.is_initialized()


def test_device_id_on_cuda_with_nccl_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rendezvous._device_id("nccl", None) == torch.device("cuda", 3)
    assert rendezvous._device_id(None, None) == torch.device("cuda", 3)  # default: cuda:nccl
    assert rendezvous._device_id("cpu:gloo,cuda:nccl", None) == torch.device("cuda", 3)
    assert rendezvous._device_id("gloo", None) is None
    assert rendezvous._device_id("nccl", 1) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rendezvous._device_id(None, None) is None


_WORKER = """
import json, os, sys, torch, torch.distributed as dist
import fastinit
fastinit.init_process_group("gloo", init_timeout=60)
t = torch.ones(1); dist.all_reduce(t)
print(json.dumps({"sum": t.item(), "world": dist.get_world_size()}), flush=True)
dist.destroy_process_group()
"""


def _gloo_record(port: int) -> bytes:
    """A gloo ``tcp::Rank`` record (hostname, sockaddr, sequence, pair ids) naming ``port``."""
    host = socket.gethostname().encode()
    sockaddr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + bytes([127, 0, 0, 1])
    address = sockaddr + bytes(128 - len(sockaddr)) + struct.pack("<q", 0)
    return struct.pack("<Q", len(host)) + host + struct.pack("<Q", len(address)) + address


def test_the_group_lives_under_the_rounds_prefix(tmp_path: pathlib.Path) -> None:
    """Two workers under a torchelastic-like environment, the store seeded as a dead attempt
    leaves it (gloo records pointing at a dead port, a round record whose beacon is gone): both
    make the group, and every key it wrote is under ``fastinit/<run id>/<token>/``."""
    server = _server()
    stale = {f"default_pg/0//cpu//0/{r}": _gloo_record(256) for r in range(2)}
    stale[rendezvous.ROUND_KEY.format(run_id="job")] = json.dumps(
        {"token": "0" * 32, "host": "127.0.0.1", "port": _closed_port()}
    ).encode()
    for k, v in stale.items():
        server.set(k, v)
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": "job",
            "TORCHELASTIC_RESTART_COUNT": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(server.port),
            "GLOO_SOCKET_IFNAME": "lo",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out, _ in outs:
        assert json.loads(out.strip().splitlines()[-1]) == {"sum": 2.0, "world": 2}
    token = json.loads(server.get(rendezvous.ROUND_KEY.format(run_id="job")))["token"]
    prefix = rendezvous.round_prefix("job", token) + "/"
    new = [k for k in server.list_keys() if k not in stale and not k.startswith("fastinit/job/")]
    assert new == [], new
    assert {f"{prefix}0//cpu//0/0", f"{prefix}0//cpu//0/1"} <= set(server.list_keys())
    for k, v in stale.items():
        if k.startswith("default_pg/"):
            assert server.get(k) == v  # never overwritten (and so never stock's keys)


def test_watchdog_ends_a_worker_stuck_past_the_bound() -> None:
    code = (
        "import time\n"
        "from fastinit.pg.rendezvous import _watchdog\n"
        "with _watchdog(time.monotonic() + 0.5, 0.5, 'a stuck connection'):\n"
        "    time.sleep(60)\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == rendezvous.EXIT_INIT_TIMEOUT
    assert time.monotonic() - t0 < 30
    assert "a stuck connection still running after 0.5 s" in proc.stderr
    assert "FASTINIT_INIT_TIMEOUT" in proc.stderr and 'File "<string>", line 4' in proc.stderr


def _torchrun(path: str, out: pathlib.Path, extra: list[str]) -> list[subprocess.Popen]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "LOGLEVEL": "WARNING"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1", *extra]
    job = [str(JOB), "--path", path, "--out", str(out), "--init-timeout", "60"]
    return [
        subprocess.Popen(
            [*cmd, *job], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    ]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, end - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def _records(out: pathlib.Path, attempt: int) -> dict[int, dict[str, Any]]:
    """The last record of each rank in ``attempt`` (0: before the kill, 1: after)."""
    recs = {}
    for path in out.glob(f"a{attempt}-r*.json"):
        rec = json.loads(path.read_text())
        recs[int(rec["rank"])] = rec
    return recs


def _every_round(out: pathlib.Path, attempt: int) -> list[dict[str, Any]]:
    """Every process's record in ``attempt`` (a restart round that failed, then the next)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"log-a{attempt}-r*-p*.json"))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ["fastinit", "stock"])
def test_a_killed_rank_comes_back_under_torchrun(tmp_path: pathlib.Path, path: str) -> None:
    out = tmp_path / path
    out.mkdir()
    (code,) = _wait(_torchrun(path, out, ["--standalone", "--nproc-per-node", "2"]), 500)
    before, after = _records(out, 0), _records(out, 1)
    assert {r["outcome"] for r in before.values()} == {"trained"}, before
    assert before[1]["poisoned"], "the killed rank left no gloo record to go stale"
    if path == "stock":  # the control: the race lost, deterministically
        assert code != 0
        assert "Connection refused" in after[0]["error"], after
        return
    assert code == 0, after
    assert after[1]["rank0_entered"] and not after[1]["rank0_done_first"]
    for rank in (0, 1):
        assert after[rank]["outcome"] == "trained", after
        assert after[rank]["losses"] == before[rank]["losses"]  # the same training, resumed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", ["fastinit", "count"])
def test_a_killed_node_comes_back_with_two_agents(tmp_path: pathlib.Path, path: str) -> None:
    """Two torchrun agents (``--nnodes 2``, one rank each, one host): only the killed rank's
    agent counts the restart, so a prefix per ``TORCHELASTIC_RESTART_COUNT`` splits the round;
    fastinit's round token does not."""
    out = tmp_path / path
    out.mkdir()
    port = free_port()
    nodes = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"two-agents-{path}",
        "--local-addr",
        "127.0.0.1",
    ]
    codes = _wait(_torchrun(path, out, nodes) + _torchrun(path, out, nodes), 800)
    after = _every_round(out, 1)
    if path == "count":  # the first restart round fails (a later one may come back)
        assert any(r["outcome"] != "trained" for r in after), (codes, after)
        return
    assert codes == [0, 0], after
    assert [r["outcome"] for r in after] == ["trained", "trained"], after  # one round, trained
    assert len({r["restart_count"] for r in after}) == 2, after  # whose ranks' counts differ
