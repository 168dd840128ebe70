"""``python -m fastinit.restart``: run a training script, and under torchrun let a zygote start
its restarts (see :mod:`fastinit.restart`).

The first attempt (``TORCHELASTIC_RESTART_COUNT`` 0, or anything not under torchelastic) runs
the script in this process, as ``python -m``/``python SCRIPT`` would; under torchelastic it first
imports the preload modules and forks the zygote (:mod:`fastinit.restart.zygote`). A restart
asks that zygote for a worker and proxies it; where there is no zygote (a new host, a launcher
started afresh), the zygote refuses (another interpreter or environment) or the knob is ``off``,
the restart runs the script itself and leaves a new zygote, so the next restart is served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import runpy
import signal
import socket
import stat
import sys
import tempfile
import threading
import warnings
from typing import TYPE_CHECKING, NoReturn

from fastinit.errors import RestartWarning
from fastinit.restart import zygote
from fastinit.restart.zygote import start_time

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fastinit.restart.zygote import Request

__all__ = ["Target", "parse", "run", "identity", "socket_path", "main"]

_USAGE = "usage: python -m fastinit.restart (-m MODULE | SCRIPT) [ARGS...]"

#: The signals the proxy passes on to the worker it stands for.
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """What to run: a module (``-m``) or a script path, with its arguments."""

    module: str | None
    path: str | None
    args: tuple[str, ...]


def parse(argv: list[str]) -> Target:
    """The target of ``python -m fastinit.restart`` 's arguments.

    Raises:
        SystemExit: no target (the usage, exit code 2).
    """
    if argv[:1] == ["-m"] and len(argv) >= 2:
        return Target(module=argv[1], path=None, args=tuple(argv[2:]))
    if argv and not argv[0].startswith("-"):
        return Target(module=None, path=argv[0], args=tuple(argv[1:]))
    print(_USAGE, file=sys.stderr)
    raise SystemExit(2)


def run(target: Target) -> None:
    """Run ``target`` as ``__main__`` in this process, as the interpreter's ``-m`` or script
    argument would (``sys.argv``, ``sys.path[0]``)."""
    if target.module is not None:
        sys.argv = [target.module, *target.args]
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.path is not None
        sys.argv = [target.path, *target.args]
        sys.path[0] = os.path.dirname(os.path.abspath(target.path))
        runpy.run_path(target.path, run_name="__main__")


_INITIAL_PATH = tuple(sys.path)


def identity() -> tuple[object, ...]:
    """What a zygote and a restarted worker must share: the interpreter, its flags, the module
    search path it started with, the preload list and this package."""
    return (
        sys.executable,
        sys.version,
        tuple(sys.flags),
        _INITIAL_PATH,
        _preload_list(),
        os.path.dirname(os.path.abspath(__file__)),
    )


def _preload_list() -> tuple[str, ...]:
    from fastinit import knobs

    return knobs.get_restart_preload()


def _private_dir() -> str | None:
    """This user's directory for zygote sockets (created 0700), or None if it is not private."""
    path = os.path.join(tempfile.gettempdir(), f"fastinit-restart-{os.getuid()}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.lstat(path)
    except OSError as e:
        problem = f"cannot be made ({e})"
    else:
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return path
        problem = "is not a directory only this user can use"
    warnings.warn(
        f"fastinit.restart: {path} {problem}; restarts start a fresh interpreter",
        RestartWarning,
        stacklevel=2,
    )
    return None


def socket_path(launcher: int, launcher_start: str, local_rank: str) -> str | None:
    """The socket of the zygote of ``local_rank`` under this launcher, or None (no private
    directory)."""
    base = _private_dir()
    if base is None:
        return None
    return os.path.join(base, f"z-{launcher}-{launcher_start}-{local_rank}.sock")


#: The longest socket path the kernel takes (``sun_path`` is 108 bytes, one for the NUL).
_SUN_PATH_MAX = 107


@contextlib.contextmanager
def _address(path: str) -> Iterator[str]:
    """An address for ``path`` that fits ``sun_path``: the path itself, or (a deep ``TMPDIR``) the
    same file reached through ``/proc/self/fd`` of its directory, open while the body runs."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def _ask(path: str, target: Target, launcher: int) -> int | None:
    """A worker forked by the zygote at ``path``, proxied to its end: its exit code (negative:
    the signal that killed it), or None when no zygote answers or it refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _address(path) as address:
            sock.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError as e:  # never let the way to a zygote stop a restart: start afresh instead
        sock.close()
        warnings.warn(
            f"fastinit.restart: cannot reach a zygote at {path} ({e}); this restart starts a "
            "fresh interpreter",
            RestartWarning,
            stacklevel=2,
        )
        return None
    with sock:
        if zygote.peer_uid(sock) != os.getuid():
            warnings.warn(
                f"fastinit.restart: {path} belongs to another user", RestartWarning, stacklevel=2
            )
            return None
        request = zygote.Request(
            target=target,
            env=dict(os.environ),
            cwd=os.getcwd(),
            umask=_umask(),
            launcher=launcher,
            identity=identity(),
        )
        try:
            zygote.send(sock, request, fds=(0, 1, 2))
            (kind, value), _ = zygote.recv(sock)
        except (EOFError, OSError):  # the zygote left before it forked: start afresh
            return None
        if kind == "refused":
            warnings.warn(
                f"fastinit.restart: the zygote refused this restart ({value}); it starts a "
                "fresh interpreter and a new zygote",
                RestartWarning,
                stacklevel=2,
            )
            return None
        return _proxy(sock, int(value))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _proxy(sock: socket.socket, pid: int) -> int:
    """Pass signals on to worker ``pid`` until its helper reports its exit."""

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:  # not yet a group leader
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        (kind, code), _ = zygote.recv(sock)
    except (EOFError, OSError):
        return -int(signal.SIGKILL)  # the helper died, and the kernel killed the worker with it
    return int(code) if kind == "exit" else 1


def _exit_as(code: int) -> NoReturn:
    """Exit as the worker did: its code, or killed by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's and SIGSTOP's stay default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _preload() -> None:
    for name in _preload_list():
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _listen(path: str) -> socket.socket | None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _address(path) as address:
            sock.bind(address)
        os.chmod(path, 0o600)
        sock.listen(8)
    except OSError as e:
        sock.close()
        warnings.warn(
            f"fastinit.restart: cannot listen at {path} ({e}); no zygote is forked, and "
            "restarts start a fresh interpreter",
            RestartWarning,
            stacklevel=2,
        )
        return None
    return sock


def _fork_zygote(
    path: str, launcher: int, launcher_start: str, env: dict[str, str]
) -> Request | None:
    """Fork the zygote of this rank (``env``: the environment before the preload imports).
    Returns None here, and the request in a worker the zygote forks (its ``become`` done)."""
    if threading.active_count() > 1 or _cuda_initialized():
        # A fork keeps only the calling thread, and CUDA does not survive a fork: never then.
        warnings.warn(
            "fastinit.restart: the preload imports started a thread or CUDA; no zygote is "
            "forked, and restarts start a fresh interpreter",
            RestartWarning,
            stacklevel=2,
        )
        return None
    listener = _listen(path)
    if listener is None:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:  # out of processes or memory: this attempt runs on without a zygote
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        warnings.warn(
            f"fastinit.restart: cannot fork a zygote ({e}); restarts start a fresh interpreter",
            RestartWarning,
            stacklevel=2,
        )
        return None
    if pid:
        listener.close()
        return None
    try:
        request = zygote.serve(listener, path, launcher, launcher_start, identity(), env)
    except BaseException:  # the zygote (or a helper) failed: never run the script from here
        os._exit(70)
    zygote.become(request, env)
    return request


def main(argv: list[str] | None = None) -> None:
    """Run the target (see the module docstring)."""
    from fastinit import knobs

    target = parse(sys.argv[1:] if argv is None else argv)
    local_rank = os.environ.get("LOCAL_RANK")
    if knobs.get_restart_zygote() and "TORCHELASTIC_RUN_ID" in os.environ and local_rank:
        launcher = os.getppid()
        launcher_start = start_time(launcher)
        path = socket_path(launcher, launcher_start, local_rank) if launcher_start else None
        if path is not None:
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
                code = _ask(path, target, launcher)
                if code is not None:
                    _exit_as(code)
            env = dict(os.environ)
            _preload()
            request = _fork_zygote(path, launcher, launcher_start, env)
            if request is not None:
                target = request.target
    run(target)
