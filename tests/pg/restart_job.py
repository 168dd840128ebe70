"""A tiny job for ``tests/pg/test_restart.py``, run by torchrun with ``--max-restarts 1``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/pg/restart_job.py --path fastinit --out DIR

Attempt 0: the process group (``--path stock``: ``torch.distributed.init_process_group("gloo")``
on ``env://``; ``fastinit``: ``fastinit.init_process_group("gloo")``; ``count``: the agent's store
behind ``PrefixStore(f"{run id}/{TORCHELASTIC_RESTART_COUNT}")``, the isolation fastinit does not
use), two training steps, then the
last rank leaves its gloo peer records in the agent's store as a dead worker leaves them, with the
dead port made 256 (so that a peer reading one dials it and is refused at once, rather than waits
to be dialled: gloo picks the side that dials by comparing the two addresses), and SIGKILLs
itself. torchrun stops the others and restarts every worker.

Attempt 1: the last rank holds back until rank 0 has entered the process group's initialisation
and either finished it or spent ``--hold`` seconds in it, so that rank 0 surely looks for the last
rank's record before the last rank writes a new one (the race a restart loses when the last rank
is slower to come back); then every rank initialises and trains two steps. Each worker writes
``a<attempt>-r<rank>.json`` (outcome, error, losses, ``TORCHELASTIC_RESTART_COUNT``) to
``--out``, and a copy per process (``log-a<attempt>-r<rank>-p<pid>.json``: a restart round that
fails and is restarted again keeps its record); the job's exit code is torchrun's. The same job
runs under two torchrun agents (``--nnodes 2``, one rank each), where only the killed rank's
agent counts the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import time
from datetime import timedelta

DEAD_PORT = 256


def _write(out: str, name: str, record: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, name))


def _wait_for(path: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path):
            return True
        time.sleep(0.02)
    return False


def _poison(store, rank: int) -> list[str]:
    """Point this rank's gloo records (wherever its path keyed them) at port 256."""
    done = []
    for key in store.list_keys():
        if not key.endswith(f"/cpu//0/{rank}"):
            continue
        value = bytearray(store.get(key))
        (host_len,) = struct.unpack_from("<Q", value, 0)
        off = 8 + host_len + 8  # hostname, then the address's length: a sockaddr follows
        struct.pack_into(">H", value, off + 2, DEAD_PORT)
        store.set(key, bytes(value))
        done.append(key)
    return done


def _train(steps: int) -> list[float]:
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 4, generator=gen))
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen) + dist.get_rank()
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        losses.append(float(loss))
    return losses


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--path", choices=("stock", "fastinit", "count"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hold", type=float, default=5.0)
    p.add_argument("--init-timeout", type=float, default=60.0)
    args = p.parse_args()

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The round, from the kill's record: TORCHELASTIC_RESTART_COUNT counts an agent's own restarts
    # only (with two agents, the survivor's rank restarts with its count still 0).
    attempt = 1 if os.path.exists(os.path.join(args.out, "killed.json")) else 0
    last = world - 1
    rec: dict = {
        "rank": rank,
        "attempt": attempt,
        "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "path": args.path,
        "pid": os.getpid(),
    }
    if attempt > 0 and rank == last:
        rec["rank0_entered"] = _wait_for(os.path.join(args.out, "a1-r0.entering"), 120.0)
        rec["rank0_done_first"] = _wait_for(os.path.join(args.out, "a1-r0.json"), args.hold)
    if attempt > 0 and rank == 0:
        _write(args.out, "a1-r0.entering", {})
    t0 = time.monotonic()
    try:
        if args.path == "stock":
            dist.init_process_group("gloo", timeout=timedelta(seconds=args.init_timeout))
        elif args.path == "count":
            agent = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                False,
                timeout=timedelta(seconds=args.init_timeout),
            )
            prefix = f"{os.environ['TORCHELASTIC_RUN_ID']}/{rec['restart_count']}"
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(prefix, agent),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=args.init_timeout),
            )
        else:
            import fastinit

            fastinit.init_process_group("gloo", init_timeout=args.init_timeout)
        rec["init_s"] = time.monotonic() - t0
        rec["losses"] = _train(2)
        rec["outcome"] = "trained"
    except Exception as e:  # recorded, then the worker fails as it would
        rec["init_s"] = time.monotonic() - t0
        rec["outcome"] = "error"
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    if attempt == 0 and rank == last and rec["outcome"] == "trained":
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False
        )
        rec["poisoned"] = _poison(agent, rank)
    _write(args.out, f"a{attempt}-r{rank}.json", rec)
    _write(args.out, f"log-a{attempt}-r{rank}-p{os.getpid()}.json", rec)  # every round's
    if rec["outcome"] != "trained":
        return 1
    if attempt == 0:
        if rank == last:
            _write(args.out, "killed.json", {"rank": rank, "time": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # torchrun stops this worker
    return 0


if __name__ == "__main__":
    sys.exit(main())
