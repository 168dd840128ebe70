"""Run a function on N real gloo processes on 127.0.0.1, for tests and benchmarks.

The parent hosts a ``TCPStore`` on an ephemeral port; each child is a fresh ``spawn`` process that
sets the usual torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK),
optionally starts a :class:`fastinit.trace.Tracer` (its store wrapped so store operations are
counted), joins the gloo process group, calls the function and sends its return value back.

Every child is reaped on success, failure and timeout. On failure or timeout the raised
:class:`RanksFailed` carries every rank's traceback; on timeout, the Python stacks of the ranks that
were still running (dumped with ``faulthandler`` just before they are killed), so a hang says
where it hung.

Example::

    def check(n):
        import torch.distributed as dist
        return dist.get_rank() * n

    assert run_ranks(check, 2, args=(10,)) == [0, 10]
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import importlib
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from fastinit.errors import FreshProcessError, RanksFailed
from fastinit.trace import Tracer

__all__ = ["run_ranks", "on_ranks", "RankResult", "RanksFailed", "free_port"]


@dataclasses.dataclass(slots=True)
class RankResult:
    """What one rank returned, or how it failed."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    log: str = ""
    trace: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """Whether the rank returned (no error)."""
        return self.error is None


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(slots=True, kw_only=True)
class _Job:
    fn_ref: tuple[str, str]
    args: tuple
    kwargs: dict
    rank: int
    world_size: int
    local_world_size: int
    port: int
    backend: str
    init_pg: bool
    trace: bool
    pg_timeout_s: float
    env: dict[str, str]
    log_path: str


def _resolve(ref: tuple[str, str]) -> Callable[..., Any]:
    module, qualname = ref
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__fastinit_rank_fn__", obj)


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    fn = getattr(fn, "__fastinit_rank_fn__", fn)
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise ValueError(
            f"{fn.__qualname__} must be a module-level function so spawned ranks can import it"
        )
    module = fn.__module__
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        if spec is None:
            raise ValueError("functions defined in a __main__ script cannot be sent to ranks")
        module = spec.name
    return module, fn.__qualname__


def _device_id(job: _Job) -> Any:
    """This rank's CUDA device for an NCCL group (torch 2.15's ``nccl`` needs it); else None."""
    if "nccl" not in job.backend:
        return None
    import torch

    return torch.device("cuda", job.rank % job.local_world_size)


def _child(job: _Job, conn: Connection) -> None:
    log = open(job.log_path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    faulthandler.enable(file=log, all_threads=True)  # a crash (SIGSEGV, SIGABRT) shows where
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(job.port),
            "RANK": str(job.rank),
            "WORLD_SIZE": str(job.world_size),
            "LOCAL_RANK": str(job.rank % job.local_world_size),
            "LOCAL_WORLD_SIZE": str(job.local_world_size),
            "GROUP_RANK": str(job.rank // job.local_world_size),
            **job.env,
        }
    )
    result = RankResult(rank=job.rank)
    tracer = None
    store: Any = None
    try:
        import torch.distributed as dist

        fn = _resolve(job.fn_ref)
        if job.trace:
            tracer = Tracer(rank=job.rank).start()
        if job.init_pg:
            timeout = timedelta(seconds=job.pg_timeout_s)
            store = dist.TCPStore(
                "127.0.0.1", job.port, job.world_size, is_master=False, timeout=timeout
            )
            if tracer is not None:
                store = tracer.wrap_store(store)
            dist.init_process_group(
                job.backend,
                store=store,
                rank=job.rank,
                world_size=job.world_size,
                timeout=timeout,
                device_id=_device_id(job),
            )
        try:
            result.value = fn(*job.args, **job.kwargs)
        finally:
            if tracer is not None:
                tracer.stop()
                result.trace = tracer.summary()
            if job.init_pg and dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result.error = traceback.format_exc()
        result.value = None
    if store is not None:
        # Leave together: a rank that exits while a peer is still connecting its gloo mesh
        # breaks that peer. Bounded, so a dead peer delays the others by seconds only.
        try:
            store.add("fastinit/harness/exited", 1)
            deadline = time.monotonic() + 10.0
            while store.add("fastinit/harness/exited", 0) < job.world_size:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store's host (the parent) may be gone
            pass
    try:
        conn.send(result)
    except Exception:  # noqa: BLE001 - an unpicklable value is a test bug worth reporting
        conn.send(RankResult(rank=job.rank, error=traceback.format_exc()))
    conn.close()
    log.flush()
    sys.stdout.flush()
    # Skip interpreter teardown: torch's atexit hooks can block on a peer that already left.
    os._exit(0)


def _tail(path: str, limit: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 120.0,
    local_world_size: int | None = None,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    init_pg: bool = True,
    trace: bool = False,
    pg_timeout: float = 60.0,
    grace: float = 20.0,
    return_failures: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes joined in a gloo group.

    Args:
        fn: a module-level function (spawned ranks import it by name).
        world_size: number of ranks.
        args: positional arguments, the same on every rank (picklable).
        kwargs: keyword arguments, the same on every rank (picklable).
        timeout: seconds for the whole job; ranks still running then are dumped and killed.
        local_world_size: ranks per simulated host (LOCAL_WORLD_SIZE); default world_size.
        env: extra environment variables for every rank.
        backend: the process-group backend.
        init_pg: join the default process group before calling ``fn``.
        trace: run a :class:`fastinit.trace.Tracer` around ``fn`` (and the group's creation); its
            summary comes back in :attr:`RankResult.trace`.
        pg_timeout: the process group's (and store's) own timeout, in seconds.
        grace: once one rank has failed, seconds the others get to finish before they are killed.
        return_failures: return a :class:`RankResult` per rank instead of raising on failure.

    Returns:
        The per-rank return values, in rank order (or the :class:`RankResult` objects).

    Raises:
        RanksFailed: a rank raised, died or timed out (unless ``return_failures``).
    """
    import torch.distributed as dist

    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(f"world_size {world_size} is not a multiple of {local_world_size}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=pg_timeout),
    )
    port = store.port
    ref = _fn_ref(fn)
    logdir = tempfile.mkdtemp(prefix="fastinit-ranks-")
    procs: list[Any] = []
    conns: list[Connection] = []
    results: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    cut_short = False  # killed after a peer failed, before the job's own timeout
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            job = _Job(
                fn_ref=ref,
                args=tuple(args),
                kwargs=dict(kwargs or {}),
                rank=rank,
                world_size=world_size,
                local_world_size=local_world_size,
                port=port,
                backend=backend,
                init_pg=init_pg,
                trace=trace,
                pg_timeout_s=pg_timeout,
                env=dict(env or {}),
                log_path=os.path.join(logdir, f"rank{rank}.log"),
            )
            proc = ctx.Process(target=_child, args=(job, child), name=f"fastinit-rank{rank}")
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        pending = {conns[r]: r for r in range(world_size)}
        sentinels = {procs[r].sentinel: r for r in range(world_size)}
        while pending:
            now = time.monotonic()
            if any(r.error for r in results.values()) and now + grace < deadline:
                deadline = now + grace
                cut_short = True
            if now >= deadline:
                timed_out = True
                break
            ready = wait(list(pending) + list(sentinels), timeout=min(1.0, deadline - now))
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        results[rank] = obj.recv()
                    except EOFError:  # it exited without sending a result
                        procs[rank].join(5)
                        results[rank] = RankResult(
                            rank=rank,
                            error=f"rank {rank} died (exit code {procs[rank].exitcode})",
                        )
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = conns[rank]
                    if conn in pending and conn.poll(0.5):
                        continue  # its result is waiting in the pipe
                    if conn in pending:
                        pending.pop(conn)
                        procs[rank].join(1)
                        results[rank] = RankResult(
                            rank=rank,
                            error=f"rank {rank} died (exit code {procs[rank].exitcode})",
                            exitcode=procs[rank].exitcode,
                        )
        if timed_out:
            for rank, proc in enumerate(procs):
                if proc.is_alive() and rank not in results:
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        for conn in conns:
            conn.close()
        del store
    out: list[RankResult] = []
    for rank in range(world_size):
        res = results.get(rank)
        if res is None:
            why = (
                f"still running {grace:.0f}s after a peer failed (killed)"
                if cut_short
                else f"timed out after {timeout:.0f}s (killed)"
            )
            res = RankResult(rank=rank, error=f"rank {rank} {why}")
        res.exitcode = procs[rank].exitcode
        res.log = _tail(os.path.join(logdir, f"rank{rank}.log"))
        out.append(res)
    if return_failures:
        return out
    failed = [r for r in out if not r.ok]
    if failed:
        parts = [f"{len(failed)} of {world_size} ranks failed running {ref[0]}.{ref[1]}"]
        for r in out:
            if r.ok:
                continue
            parts.append(f"\n===== rank {r.rank} (exit code {r.exitcode}) =====\n{r.error}")
            if r.log.strip():
                parts.append(f"----- rank {r.rank} output (tail) -----\n{r.log}")
        raise RanksFailed("\n".join(parts), out)
    return [r.value for r in out]


def on_ranks(
    world_size: int, **options: Any
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorator: the test body runs on ``world_size`` ranks; the test fails if any rank fails.

    The decorated function's return values are discarded; use :func:`run_ranks` to get them.
    Options are those of :func:`run_ranks`.

    Example::

        @on_ranks(2, timeout=60)
        def test_allreduce():
            ...  # runs on every rank, with the default group joined
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper() -> None:
            run_ranks(fn, world_size, **options)

        wrapper.__fastinit_rank_fn__ = fn  # type: ignore[attr-defined]
        # pytest must not see the rank function's own parameters.
        wrapper.__signature__ = __import__("inspect").Signature()  # type: ignore[attr-defined]
        return wrapper

    return decorate


def call_fresh(
    module: str, fn: str, args: Sequence[Any] = (), timeout: float = 300, cwd: str | None = None
) -> Any:
    """``module.fn(*args)`` in a fresh interpreter, its JSON-able result returned (for a
    measurement that must not share a process, or one rank on the fake backend, which
    initialises the default process group of its own process).

    Raises:
        FreshProcessError: with the end of its stderr when it fails, prints no result or runs
            past ``timeout`` seconds.
    """
    code = (
        f"import json, sys; from {module} import {fn} as f; "
        "print('@@' + json.dumps(f(*json.loads(sys.argv[1]))))"
    )
    return _fresh(code, [json.dumps(list(args))], timeout, cwd, f"{module}.{fn}{tuple(args)}")


def _fresh(code: str, argv: Sequence[str], timeout: float, cwd: str | None, what: str) -> Any:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired:
        raise FreshProcessError(f"{what}: timed out after {timeout:.0f} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    if proc.returncode != 0 or not lines:
        raise FreshProcessError(f"{what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][2:])


def run_script(code: str, *args: object, timeout: float = 300) -> Any:
    """Run ``code`` in a fresh interpreter (``sys.argv[1:]`` = ``args``) and return the JSON
    value of its last stdout line starting ``@@``. Raises ``AssertionError`` with the end of
    stderr when the script fails or prints no result (for tests)."""
    try:
        return _fresh(code, [str(a) for a in args], timeout, None, "script")
    except FreshProcessError as e:
        raise AssertionError(str(e)) from None
