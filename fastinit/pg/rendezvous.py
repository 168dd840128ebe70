"""The default process group, made so that every torchrun / torchx restart comes back.

Under torchelastic (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun's c10d and static
rendezvous, torchx's ``dist.ddp``), ``init_process_group`` on ``env://`` connects every worker to
the TCPStore the agent keeps for the whole job and uses it without a per-attempt prefix (torch's
``rendezvous._create_c10d_store``: "We create a new TCPStore for every retry so no need to add
prefix for each attempt", while ``DynamicRendezvousHandler.next_rendezvous`` keeps one store server
for every round). A restarted worker then reads what the dead attempt left: gloo's peer records
(``default_pg/0//cpu//0/<rank>``: host, listening address, pair ids) and, with
``TORCH_DIST_INIT_BARRIER=1``, the store-based barrier's counter and ``last_worker`` key. A peer
whose record is stale is dialled on a dead port ("Gloo connectFullMesh failed ... Connection
refused") or, when gloo's address order makes this side the one that waits to be dialled, waited
for until five times the group's timeout (gloo's ``tcp/pair.h``): a hang torchrun never sees.
``patches/torch/README.md`` has the reproduction and the upstream fix.

:func:`init_process_group` gives every round of the job keys of its own:

1. **A round token every rank agrees on.** ``TORCHELASTIC_RESTART_COUNT`` is not one: it counts
   an agent's own restarts, and an agent whose workers were healthy when another node failed
   restarts them without counting (two agents on one host show ranks 0 and 1 of one round with
   counts 0 and 1). So global rank 0 draws a random token, serves it on a listening socket of its
   own (the *beacon*) and publishes ``{token, host, port}`` under ``fastinit/<run id>/round`` in
   the agent's store. Every other rank reads the record and accepts it only once the beacon at that
   address answers with that token: a record left by a dead attempt names a closed port (its
   process is gone, and a beacon closes once its round agreed), so it is refused and read again.
   Ranks then count themselves in under ``fastinit/<run id>/<token>/``; rank 0 closes the beacon
   once all have, or names the ranks that never came.
2. **The group on those keys.** ``torch.distributed.init_process_group`` with
   ``PrefixStore("fastinit/<run id>/<token>", agent store)``: gloo's records, barrier counters and
   every later ``new_group``'s keys (TorchRec's, DCP's) live under the round's prefix.
3. **Every wait bounded** by ``init_timeout`` (``FASTINIT_INIT_TIMEOUT``, default 600 s): the
   store connection, the agreement (a clear :class:`~fastinit.errors.StartupError` on the rank that
   gives up), and the backend's connections, which torch cannot interrupt: past the bound a
   watchdog prints every thread's stack and ends the worker with exit code
   :data:`EXIT_INIT_TIMEOUT`, so that torchrun sees a failure and restarts the job.

Only reads are retried (the round record and the beacon, with backoff, until the bound).
``torch.distributed.init_process_group`` is called once: a failed backend initialisation leaves
torch's global group state and the peers' half-made connections behind, and repeating it there
would desynchronise the group names that prefix every later group's keys. The worker raises, and
torchrun's ``--max-restarts`` starts the round again, on fresh keys.

Outside torchelastic, or when the agent does not share its store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 then hosts a new store on a new port each
round), it is a plain ``torch.distributed.init_process_group``. On CUDA with NCCL every path passes
``device_id`` (torch 2.15's nccl backend needs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fastinit import knobs
from fastinit.errors import StartupError

if TYPE_CHECKING:
    import torch

__all__ = ["init_process_group", "EXIT_INIT_TIMEOUT", "ROUND_KEY", "round_prefix"]

logger = logging.getLogger(__name__)

#: The exit code of a worker whose backend initialisation outlived ``init_timeout``.
EXIT_INIT_TIMEOUT = 124

#: Where rank 0 publishes the round (``{run_id}`` is ``TORCHELASTIC_RUN_ID``).
ROUND_KEY = "fastinit/{run_id}/round"

_MAGIC = "fastinit-round "
_PROBE_S = 5.0


def round_prefix(run_id: str, token: str) -> str:
    """The store prefix of one round's keys."""
    return f"fastinit/{run_id}/{token}"


def init_process_group(
    backend: str | None = None,
    *,
    timeout: timedelta | None = None,
    device_id: torch.device | int | None = None,
    pg_options: Any | None = None,
    init_timeout: float | None = None,
) -> None:
    """Initialise the default process group; under torchrun or torchx, on keys of this round only.

    Call it where you called ``torch.distributed.init_process_group``: in every worker, before
    ``fastinit.setup`` (or ``DistributedModelParallel``). Under torchelastic with the agent's
    shared store, rank 0 and every other rank first agree on a fresh token for this restart round
    (module docstring), and the group is made on ``PrefixStore("fastinit/<run id>/<token>",
    agent store)``, so nothing a dead attempt left in the store is ever read. Elsewhere it is
    ``torch.distributed.init_process_group(backend, timeout=..., device_id=..., pg_options=...)``
    on ``env://``.

    Args:
        backend: as for ``torch.distributed.init_process_group`` (None: torch's default for the
            devices present, ``cpu:gloo,cuda:nccl`` where CUDA is).
        timeout: the process group's timeout, torch's meaning (how long its collectives and
            store operations may wait); None: torch's default for the backend. Keep it above
            ``FASTINIT_COLLECTIVE_TIMEOUT``, which bounds fastinit's own start-up collectives.
        device_id: the device to bind the group to; None: on CUDA with an NCCL backend (or the
            default one), ``cuda:<LOCAL_RANK>``, and nothing elsewhere.
        pg_options: backend options, passed to torch as they are.
        init_timeout: seconds this call may take in all under torchelastic (agreeing on the round,
            connecting to the store and the backend's connections); None:
            ``FASTINIT_INIT_TIMEOUT`` (default 600). A rank that gives up during the agreement
            raises; a backend connection still running past it ends the worker with exit code
            :data:`EXIT_INIT_TIMEOUT` (torch cannot interrupt it), stacks printed first, so that
            torchrun restarts the job instead of waiting for ever.

    Raises:
        ValueError: ``init_timeout`` (or ``FASTINIT_INIT_TIMEOUT``) is not a finite number of
            seconds in (0, 86400], the torchelastic environment lacks ``RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR`` or ``MASTER_PORT``, or the default group exists already (torch's
            message); raised before any connection.
        fastinit.StartupError: the ranks did not agree on a round within ``init_timeout`` (rank
            0 names the ranks that never joined; another rank says whose record it last saw).
        RuntimeError: whatever torch raises while making the group.

    Example::

        import fastinit

        fastinit.init_process_group()  # torchrun --nproc-per-node 2 --max-restarts 3 train.py
        model = fastinit.setup(build(), device=device, sharders=sharders())
    """
    import torch.distributed as dist

    bound = (
        knobs.get_init_timeout()
        if init_timeout is None
        else knobs.check_seconds("init_timeout", init_timeout)
    )
    device = _device_id(backend, device_id)
    extra: dict[str, Any] = {}
    if timeout is not None:
        extra["timeout"] = timeout
    if pg_options is not None:
        extra["pg_options"] = pg_options
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, device_id=device, **extra)
        return
    if dist.is_initialized():  # torch's own error, before this rank joins (or leads) a round
        raise ValueError("trying to initialize the default process group twice!")
    env = _ElasticEnv.from_environ()
    deadline = time.monotonic() + bound
    t0 = time.perf_counter()
    agent = _agent_store(env, bound)
    token = agree_on_round(agent, env.rank, env.world_size, env.run_id, deadline)
    t_agree = time.perf_counter() - t0
    store = dist.PrefixStore(round_prefix(env.run_id, token), agent)
    with _watchdog(deadline, bound, f"the {backend or 'default'} group of round {token[:8]}"):
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            device_id=device,
            **extra,
        )
    # Later store waits (new_group, DCP) as torch's env:// path bounds them: the group's timeout.
    agent.set_timeout(timeout if timeout is not None else _default_timeout(backend))
    if env.rank == 0:
        logger.info(
            "fastinit.init_process_group: %d ranks on round %s (restart %s of run %s): agreed in "
            "%.2f s, group in %.2f s",
            env.world_size,
            token[:8],
            env.restart_count,
            env.run_id,
            t_agree,
            time.perf_counter() - t0 - t_agree,
        )


# -- the environment ---------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class _ElasticEnv:
    """What torchelastic tells a worker."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: str

    @classmethod
    def from_environ(cls) -> _ElasticEnv:
        missing = [
            v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)
        ]
        if missing:
            raise ValueError(
                "fastinit.init_process_group: TORCHELASTIC_USE_AGENT_STORE=True but "
                f"{', '.join(missing)} not set: not a torchelastic worker?"
            )
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            port = int(os.environ["MASTER_PORT"])
        except ValueError as e:
            raise ValueError(
                f"fastinit.init_process_group: malformed torchelastic variable: {e}"
            ) from e
        if not 0 <= rank < world:
            raise ValueError(f"fastinit.init_process_group: RANK={rank}, WORLD_SIZE={world}")
        return cls(
            rank=rank,
            world_size=world,
            master_addr=os.environ["MASTER_ADDR"],
            master_port=port,
            run_id=os.environ.get("TORCHELASTIC_RUN_ID") or "none",
            restart_count=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )


def _agent_store(env: _ElasticEnv, bound: float) -> Any:
    """A client of the agent's store (as ``env://`` opens it), counted by an active tracer."""
    import torch.distributed as dist

    from fastinit import trace

    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=False,
        timeout=timedelta(seconds=bound),
    )
    tracer = trace.active()
    if tracer is not None and tracer.comm:
        store = tracer.wrap_store(store)
    return store


def _device_id(backend: str | None, device_id: Any) -> Any:
    """The device to bind the group to: the given one; else ``cuda:<LOCAL_RANK>`` where an NCCL
    backend (or torch's default, which picks NCCL for CUDA) meets a CUDA device; else None."""
    if device_id is not None:
        return device_id
    if backend is not None and "nccl" not in backend.lower():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _default_timeout(backend: str | None) -> timedelta:
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if backend is not None and backend.lower() == "nccl" and nccl is not None:
        return nccl
    return constants.default_pg_timeout


# -- the round ---------------------------------------------------------------------------------


def agree_on_round(store: Any, rank: int, world_size: int, run_id: str, deadline: float) -> str:
    """The token of this restart round, the same on every rank (module docstring, step 1).

    ``store`` is the agent's store (unprefixed); ``deadline`` a ``time.monotonic()`` value.

    Raises:
        fastinit.StartupError: no agreement before ``deadline``.
    """
    if world_size == 1:
        return secrets.token_hex(16)
    key = ROUND_KEY.format(run_id=run_id)
    if rank == 0:
        return _lead(store, key, world_size, run_id, deadline)
    return _follow(store, key, rank, world_size, run_id, deadline)


def _lead(store: Any, key: str, world_size: int, run_id: str, deadline: float) -> str:
    token = secrets.token_hex(16)
    prefix = round_prefix(run_id, token)
    with _Beacon(token) as beacon:
        host = beacon.reachable_host(_host_candidates())
        store.set(key, json.dumps({"token": token, "host": host, "port": beacon.port}))
        try:
            store.wait([f"{prefix}/all"], _remaining(deadline))
        except RuntimeError as e:  # torch's DistStoreError: the wait timed out
            missing = [r for r in range(1, world_size) if not store.check([f"{prefix}/joined/{r}"])]
            raise StartupError(
                f"fastinit.init_process_group: rank(s) {missing} of {world_size} did not join "
                f"restart round {token[:8]} within the bound (FASTINIT_INIT_TIMEOUT; "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
    return token


def _follow(store: Any, key: str, rank: int, world_size: int, run_id: str, deadline: float) -> str:
    last: dict[str, Any] | None = None
    pause = 0.02
    while True:
        if time.monotonic() >= deadline:
            raise StartupError(
                f"fastinit.init_process_group: rank {rank} found no live restart round within the "
                f"bound (FASTINIT_INIT_TIMEOUT): rank 0 never published one, or the one it read "
                f"({last}) is not answered by rank 0's beacon"
            )
        record: Any = None
        try:
            store.wait([key], _remaining(deadline))
            record = json.loads(store.get(key))
        except RuntimeError:  # the wait timed out (the check above ends the loop), or the store
            pass  # failed: read again after the pause
        except ValueError:  # not JSON: not fastinit's record
            pass
        record = record if isinstance(record, dict) else {}
        last = record or last
        token = record.get("token")
        if (
            isinstance(token, str)
            and _probe(str(record.get("host")), record.get("port"), _remaining(deadline, _PROBE_S))
            == token
        ):
            prefix = round_prefix(run_id, token)
            store.set(f"{prefix}/joined/{rank}", b"1")
            if store.add(f"{prefix}/joined", 1) == world_size - 1:
                store.set(f"{prefix}/all", b"1")
            return token
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.5)


def _remaining(deadline: float, cap: float | None = None) -> timedelta:
    left = max(0.001, deadline - time.monotonic())
    return timedelta(seconds=left if cap is None else min(left, cap))


def _host_candidates() -> Iterator[str]:
    """Addresses other ranks may reach rank 0 at: torchelastic's ``MASTER_ADDR`` (rank 0 runs on
    the agent that hosts the store), then this host's names (looked up only if needed: a reverse
    DNS lookup can take seconds)."""
    seen: set[str] = set()
    for lookup in (lambda: os.environ.get("MASTER_ADDR"), socket.getfqdn, socket.gethostname):
        host = lookup()
        if host and host not in seen:
            seen.add(host)
            yield host


def _probe(host: str, port: Any, timeout: timedelta) -> str | None:
    """The token the beacon at ``host:port`` serves, or None (refused, silent, not a beacon)."""
    if not isinstance(port, int):
        return None
    data = b""
    try:
        with socket.create_connection((host, port), timeout=timeout.total_seconds()) as conn:
            while not data.endswith(b"\n") and len(data) < 256:
                chunk = conn.recv(256)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    text = data.decode("utf-8", "replace")
    if not text.startswith(_MAGIC) or not text.endswith("\n"):
        return None
    return text[len(_MAGIC) : -1]


class _Beacon:
    """Rank 0's proof of life for one round: a listening socket that answers with the token."""

    def __init__(self, token: str) -> None:
        if socket.has_dualstack_ipv6():
            sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            sock = socket.create_server(("", 0))
        sock.settimeout(0.5)  # the stop flag's poll, where shutdown() does not wake accept()
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        self.token = token
        self._payload = f"{_MAGIC}{token}\n".encode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fastinit-round-beacon")
        self._thread.daemon = True
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.sendall(self._payload)

    def reachable_host(self, candidates: Iterable[str]) -> str:
        """The first of ``candidates`` at which this beacon answers (checked from here)."""
        tried = []
        for host in candidates:
            if _probe(host, self.port, timedelta(seconds=2.0)) == self.token:
                return host
            tried.append(host)
        raise StartupError(
            f"fastinit.init_process_group: rank 0 cannot reach its own round beacon (port "
            f"{self.port}) at any of {tried}: no address to give the other ranks"
        )

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):  # wakes a blocked accept() at once (Linux)
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)
        self._sock.close()

    def __enter__(self) -> _Beacon:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the bound on what torch cannot interrupt --------------------------------------------------


@contextlib.contextmanager
def _watchdog(deadline: float, bound: float, what: str) -> Iterator[None]:
    """Run the body; if it is still running at ``deadline``, print every thread's stack and end
    the process with :data:`EXIT_INIT_TIMEOUT` (a worker stuck in C++ never returns to torchrun)."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(max(0.0, deadline - time.monotonic())):
            return
        msg = (
            f"fastinit.init_process_group: {what} still running after {bound:g} s "
            f"(FASTINIT_INIT_TIMEOUT); torch cannot interrupt it, so this worker exits with code "
            f"{EXIT_INIT_TIMEOUT} for the launcher to restart the job. Its threads:"
        )
        logger.error(msg)
        print(msg, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_INIT_TIMEOUT)

    thread = threading.Thread(target=watch, name="fastinit-init-watchdog")
    thread.daemon = True
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
