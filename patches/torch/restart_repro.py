"""Minimal reproduction, stock torch only: a torchrun restart reads the previous attempt's keys.

    python patches/torch/restart_repro.py                      # 5 jobs, 2 ranks, the race as it falls
    python patches/torch/restart_repro.py --delay 3            # rank 1 restarts 3 s late: deterministic
    python patches/torch/restart_repro.py --delay 3 --isolate  # the same, keys prefixed per attempt
    python patches/torch/restart_repro.py --plain              # literally init_process_group("gloo")
    python patches/torch/restart_repro.py --rdzv static        # torchrun's default rendezvous
    python patches/torch/restart_repro.py --torch-overlay DIR  # torch with the upstream fix

Each job is ``torchrun --standalone --nproc-per-node N --max-restarts 1`` of this file. Every
worker calls ``init_process_group("gloo")`` on ``env://`` (torchrun's ``MASTER_ADDR`` /
``MASTER_PORT``: with ``TORCHELASTIC_USE_AGENT_STORE=True`` that is the TCPStore the agent keeps
for the whole job), runs one ``all_reduce``; in attempt 0 the last rank then SIGKILLs itself, the
agent stops the others and starts every worker again (``TORCHELASTIC_RESTART_COUNT=1``).

Before it initialises, each restarted worker lists the keys already in the agent's store (from a
plain ``TCPStore`` client, as ``env://`` opens it) and decodes gloo's peer address in each
``default_pg/0//cpu//0/<rank>`` key. By default the store handed to ``init_process_group`` is
the same ``env://`` store wrapped in ``PrefixStore("default_pg", ...)`` exactly as
``init_process_group`` wraps it itself, with a recording shim in between, so the record also
shows every key gloo read and the port it found there (``--plain``: no shim, torch's own call).
``--delay S`` holds back rank ``--delay-rank`` (default: the last) for S seconds in the restart,
so the other ranks surely reach gloo's rendezvous first and read what the dead attempt left.
``--isolate`` gives ``init_process_group`` a ``PrefixStore(f"{run_id}/{attempt}", store)``
instead (the cure). Records go to ``--out`` (JSON per worker and attempt); a summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

GLOO_KEY = "default_pg/0//cpu//0/{rank}"  # PrefixStore("default_pg") / group "0/" / "cpu/" / gloo ctx "0"


def _port(value: bytes) -> int | None:
    """The TCP port in gloo's ``tcp::Rank`` record (hostname, then a sockaddr_storage)."""
    try:
        (host_len,) = struct.unpack_from("<Q", value, 0)
        off = 8 + host_len + 8  # hostname, then the address's length
        family = struct.unpack_from("<H", value, off)[0]
        if family not in (2, 10):  # AF_INET, AF_INET6
            return None
        return struct.unpack_from(">H", value, off + 2)[0]
    except struct.error:
        return None


def _swap(port: int | None) -> int:
    """``sin_port`` as gloo compares it: the network-order bytes read as a host (x86) uint16."""
    return -1 if port is None else ((port & 0xFF) << 8) | (port >> 8)


def _recording_store(inner, log):
    import torch.distributed as dist

    class Recording(dist.Store):
        def __init__(self) -> None:
            super().__init__()

        def set(self, key, value):
            log.append({"op": "set", "key": key, "port": _port(bytes(value))})
            inner.set(key, value)

        def get(self, key):
            value = inner.get(key)
            log.append({"op": "get", "key": key, "port": _port(value), "t": time.time()})
            return value

        def wait(self, keys, timeout=None):
            log.append({"op": "wait", "keys": list(keys)})
            return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def check(self, keys):
            return inner.check(keys)

        def add(self, key, value):
            return inner.add(key, value)

        def compare_set(self, key, expected, desired):
            return inner.compare_set(key, expected, desired)

        def delete_key(self, key):
            return inner.delete_key(key)

        def num_keys(self):
            return inner.num_keys()

        def set_timeout(self, timeout):
            inner.set_timeout(timeout)

        @property
        def timeout(self):
            return inner.timeout

        def has_extended_api(self):
            return inner.has_extended_api()

        def multi_get(self, keys):
            return inner.multi_get(keys)

        def multi_set(self, keys, values):
            inner.multi_set(keys, values)

        def append(self, key, value):
            inner.append(key, value)

    return Recording()


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = timedelta(seconds=args.timeout)
    rec: dict = {
        "rank": rank,
        "attempt": attempt,
        "pid": os.getpid(),
        "torch": torch.__version__,
        "torch_file": torch.__file__,
        "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
        "store": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }
    # A client of the agent's store, opened as env:// opens it (rendezvous._create_c10d_store).
    probe = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout
    )
    try:
        rec["keys_before_init"] = sorted(probe.list_keys())
    except (AttributeError, RuntimeError) as e:  # list_keys is recent
        rec["keys_before_init"] = f"list_keys unavailable: {e}"
    rec["gloo_keys_before_init"] = {
        GLOO_KEY.format(rank=r): _port(probe.get(GLOO_KEY.format(rank=r)))
        for r in range(world)
        if probe.check([GLOO_KEY.format(rank=r)])
    }
    delay_rank = world - 1 if args.delay_rank is None else args.delay_rank
    if attempt > 0 and rank == delay_rank and args.delay:
        time.sleep(args.delay)
    log: list = []
    t0 = time.time()
    rec["t_init"] = t0
    try:
        if args.isolate:
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
            store = dist.PrefixStore(f"{run_id}/{attempt}", probe)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        elif args.plain:
            dist.init_process_group("gloo", timeout=timeout)
        else:
            shim = _recording_store(probe, log)
            store = dist.PrefixStore("default_pg", shim)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        t = torch.ones(1)
        dist.all_reduce(t)
        rec["outcome"] = "ok" if t.item() == world else f"wrong sum {t.item()}"
    except Exception as e:  # noqa: BLE001 - recorded, then the worker fails
        rec["outcome"] = "error"
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    rec["init_s"] = time.time() - t0
    rec["store_ops"] = log
    rec["own_port"] = (
        _port(probe.get(GLOO_KEY.format(rank=rank)))
        if not args.isolate and probe.check([GLOO_KEY.format(rank=rank)])
        else None
    )
    with open(os.path.join(args.out, f"a{attempt}-r{rank}.json"), "w") as f:
        json.dump(rec, f)
    if rec["outcome"] != "ok":
        return 1
    if attempt == 0:
        if rank == world - 1:
            time.sleep(1.0)  # every rank has recorded attempt 0
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # the agent stops this worker
    return 0


def _summary(out: str, world: int) -> dict:
    recs = {}
    for name in os.listdir(out):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                r = json.load(f)
            recs[(r["attempt"], r["rank"])] = r
    lines = []
    for rank in range(world):
        r = recs.get((1, rank))
        if r is None:
            lines.append(f"  rank {rank}: no record of the restart (hung or never started)")
            continue
        stale = {
            k: p
            for k, p in r["gloo_keys_before_init"].items()
            if p is not None and recs.get((0, int(k.rsplit("/", 1)[1])), {}).get("own_port") == p
        }
        reads = []
        for op in r["store_ops"]:
            if op["op"] != "get" or not op["key"].startswith("default_pg/"):
                continue
            peer = int(op["key"].rsplit("/", 1)[1])
            text = f"{op['key']} -> port {op['port']}"
            if peer == rank:
                reads.append(text + " (its own)")
            elif recs.get((0, peer), {}).get("own_port") == op["port"]:
                # gloo's Device::isInitiator: the side whose sin_port (compared as the raw
                # network-order uint16) is larger dials, the other waits to be dialled.
                role = (
                    "dials the dead port: refused"
                    if _swap(r["own_port"]) > _swap(op["port"])
                    else "waits to be dialled"
                )
                reads.append(text + f" (attempt 0's, dead; this rank {role})")
            else:
                reads.append(text + " (this attempt's)")
        lines.append(
            f"  rank {rank}: {r['outcome']} in {r['init_s']:.1f} s; attempt 0's gloo keys still in "
            f"the store before init: {stale or 'none'}"
            + (f"; read {', '.join(reads)}" if reads else "")
            + (f"; {r['error']}" if "error" in r else "")
        )
    return {"lines": lines, "recovered": all(recs.get((1, r), {}).get("outcome") == "ok" for r in range(world))}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def driver(args: argparse.Namespace) -> int:
    results = []
    for job in range(args.runs):
        out = tempfile.mkdtemp(prefix=f"restart-repro-{job}-", dir=args.out)
        rdzv = (
            ["--standalone"]
            if args.rdzv == "standalone"
            else ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rdzv,
            "--nproc-per-node",
            str(args.nproc),
            "--max-restarts",
            "1",
            os.path.abspath(__file__),
            "--worker",
            "--out",
            out,
            "--timeout",
            str(args.timeout),
            "--delay",
            str(args.delay),
            *(["--delay-rank", str(args.delay_rank)] if args.delay_rank is not None else []),
            *(["--isolate"] if args.isolate else []),
            *(["--plain"] if args.plain else []),
        ]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "LOGLEVEL": "ERROR"}
        if args.torch_overlay:  # a torch with the upstream patch applied (see README.md)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (args.torch_overlay, env.get("PYTHONPATH", "")) if p
            )
        t0 = time.time()
        try:
            with open(os.path.join(out, "torchrun.log"), "w") as log:
                rc = subprocess.run(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.job_timeout
                ).returncode
            how = f"torchrun exit {rc}"
        except subprocess.TimeoutExpired:
            rc, how = None, f"HUNG (no exit in {args.job_timeout:.0f} s)"
        s = _summary(out, args.nproc)
        verdict = "recovered" if rc == 0 and s["recovered"] else ("hang" if rc is None else "failed")
        results.append(verdict)
        print(f"job {job}: {verdict} ({how}, {time.time() - t0:.1f} s; records in {out})")
        print("\n".join(s["lines"]), flush=True)
    print(
        f"{results.count('recovered')}/{len(results)} recovered, {results.count('failed')} failed, "
        f"{results.count('hang')} hung"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--delay", type=float, default=0.0, help="seconds rank --delay-rank waits in the restart")
    p.add_argument("--delay-rank", type=int, default=None)
    p.add_argument("--isolate", action="store_true", help="prefix the keys per attempt (the cure)")
    p.add_argument("--plain", action="store_true", help='literally init_process_group("gloo")')
    p.add_argument("--timeout", type=float, default=30.0, help="init_process_group timeout, s")
    p.add_argument("--job-timeout", type=float, default=180.0, help="outer bound per job, s")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--rdzv",
        choices=("standalone", "static"),
        default="standalone",
        help="torchrun --standalone (c10d rendezvous) or its default static one",
    )
    p.add_argument(
        "--torch-overlay",
        default=None,
        help="a directory whose torch/ is the installed one with the patch applied (overlay.py)",
    )
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.out = args.out or tempfile.mkdtemp(prefix="restart-repro-")
    os.makedirs(args.out, exist_ok=True)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
