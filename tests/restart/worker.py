"""A worker for tests/restart: records who it is, then does what ``RESTART_TEST_PLAN`` says.

    python -m fastinit.restart tests/restart/worker.py OUT

It writes ``OUT/r<rank>-a<attempt>.json``: whether a zygote forked it, its pid, parent, session,
launcher, the modules it found imported, its arguments, directory, ``sys.path[0]``, umask, and
draws from torch's, Python's and NumPy's global generators. ``RESTART_TEST_PLAN`` (JSON) maps
``"<rank>:<attempt>"`` to an action: ``kill`` (SIGKILL itself once every rank of that attempt has
recorded itself), ``exit:N``, ``term`` (wait for SIGTERM, record it, exit 7) or ``sleep:S``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

preloaded = sorted(m for m in ("torch", "numpy") if m in sys.modules)

import numpy  # noqa: E402
import torch  # noqa: E402

import fastinit.restart  # noqa: E402

out = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


mask = os.umask(0)
os.umask(mask)
record = {
    "served": fastinit.restart.served(),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "grandparent": _parent_of(os.getppid()),
    "sid": os.getsid(0),
    "launcher": fastinit.restart.launcher_pid(),
    "preloaded": preloaded,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "umask": mask,
    "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    "torch_seed": torch.initial_seed(),
    "random": random.random(),
    "numpy": float(numpy.random.random()),
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigchld_default": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
}
print(f"worker rank {rank} attempt {attempt} says hello", flush=True)
path = os.path.join(out, f"r{rank}-a{attempt}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)

action = json.loads(os.environ.get("RESTART_TEST_PLAN", "{}")).get(f"{rank}:{attempt}", "")
if action == "kill":
    peers = [os.path.join(out, f"r{r}-a{attempt}.json") for r in range(world)]
    while not all(os.path.exists(p) for p in peers):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
elif action.startswith("exit:"):
    sys.exit(int(action.split(":")[1]))
elif action == "term":

    def on_term(signum: int, _frame: object) -> None:
        with open(os.path.join(out, f"r{rank}-a{attempt}.term"), "w") as f:
            f.write(str(signum))
        sys.exit(7)

    signal.signal(signal.SIGTERM, on_term)
    with open(os.path.join(out, f"r{rank}-a{attempt}.waiting"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    sys.exit(1)
elif action.startswith("sleep:"):
    time.sleep(float(action.split(":")[1]))
