"""Stands in for torchrun's agent, for tests/restart (one rank, no rendezvous).

    python tests/restart/agent.py ATTEMPTS OUT

Runs ``python -u -m fastinit.restart worker.py OUT`` once per attempt, each after the previous
one exited, in a session of its own as torchrun starts workers, with torchelastic's variables
(``TORCHELASTIC_RESTART_COUNT`` the attempt) plus ``RESTART_TEST_ATTEMPT_ENV``'s entry for the
attempt (JSON: ``{"2": {"FOO": "1"}}``). It writes each proxy's pid to ``OUT/proxy-a<N>.pid``
and prints ``{"attempt": N, "code": C}`` per attempt, then waits until its stdin closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")

attempts, out = int(sys.argv[1]), sys.argv[2]
extra = json.loads(os.environ.get("RESTART_TEST_ATTEMPT_ENV", "{}"))
for attempt in range(attempts):
    env = {
        **os.environ,
        "TORCHELASTIC_RUN_ID": "restart-test",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
        **extra.get(str(attempt), {}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "fastinit.restart", WORKER, out],
        env=env,
        start_new_session=True,
    )
    with open(os.path.join(out, f"proxy-a{attempt}.pid"), "w") as f:
        f.write(str(proc.pid))
    print(json.dumps({"attempt": attempt, "code": proc.wait()}), flush=True)
sys.stdin.read()
