"""The zygote: a copy of a rank's first worker, made right after its imports, that forks the
workers torchrun restarts on that rank.

Three processes serve one restarted worker:

* the **proxy**: what torchrun started (``python -m fastinit.restart ...``,
  :mod:`fastinit.restart.launch`). It sends its request — arguments, environment, working
  directory, umask, standard streams — over the zygote's socket, passes the signals it gets on to
  the worker's process group, and exits as the worker exited (the same code, or the same signal);
* the **zygote** (:func:`serve`): single-threaded, in a session of its own (torchrun's
  ``killpg`` of a dead attempt's workers does not reach it), it accepts only its own user's
  connections, refuses a request whose interpreter, flags, ``sys.path`` or environment (apart from
  the variables torchelastic sets per attempt) differ from its own, and forks a helper per request.
  It exits when the launcher that started the job is gone, or after a refusal;
* the **helper** forks the worker, reports its pid, and reports its exit status to the proxy; if
  the proxy dies (SIGKILL), it kills the worker's process group.

The worker (:func:`become`) makes itself what a fresh process started by torchrun would be: a
session of its own (as torchrun starts every worker), the proxy's streams on 0, 1 and 2, its
directory, umask and environment, default signal handlers, and fresh random seeds (Python's
``random`` is reseeded by the fork itself; torch's CPU generator and NumPy's global state are
reseeded from the OS, as a new interpreter seeds them). CUDA is never initialised in the zygote,
so the worker initialises it as a fresh process would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import select
import signal
import socket
import struct
import sys
from typing import Any

__all__ = [
    "Request",
    "IGNORED_ENV",
    "incompatible",
    "send",
    "recv",
    "serve",
    "become",
    "peer_uid",
    "start_time",
]

#: What torchelastic sets per worker and per attempt (besides ``TORCHELASTIC_*``): read at run
#: time, never at import, so a zygote made in one attempt serves another with other values.
IGNORED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)

_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 64 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """A restarted worker's request: who it must become."""

    target: Any
    """What to run (:class:`fastinit.restart.launch.Target`)."""
    env: dict[str, str]
    cwd: str
    umask: int
    launcher: int
    """The proxy's parent (torchrun's agent)."""
    identity: tuple[Any, ...]
    """The interpreter as the proxy sees it (:func:`fastinit.restart.launch.identity`)."""
    fds: tuple[int, ...] = ()
    """Stdin, stdout, stderr as received (filled in by :func:`recv`)."""


def send(sock: socket.socket, obj: Any, fds: tuple[int, ...] = ()) -> None:
    """One message: a length-prefixed pickle, with ``fds`` passed along (SCM_RIGHTS)."""
    data = pickle.dumps(obj)
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data))], list(fds))
    else:
        sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def recv(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    """One message of :func:`send` and the file descriptors it carried.

    Raises:
        EOFError: the peer closed the connection.
    """
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
    else:
        head, fds = sock.recv(_HEADER.size), []
    if not head:
        raise EOFError("the peer closed the connection")
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            raise EOFError("the peer closed the connection")
        head += more
    (size,) = _HEADER.unpack(head)
    if size > _MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes")
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection")
        data += chunk
    return pickle.loads(bytes(data)), list(fds)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[2])


def incompatible(request: Request, identity: tuple[Any, ...], env: dict[str, str]) -> str | None:
    """Why a zygote made with ``identity`` and ``env`` cannot serve ``request`` (None: it can)."""
    if request.identity != identity:
        names = ("executable", "version", "flags", "sys.path", "preload", "fastinit")
        diff = [n for n, a, b in zip(names, request.identity, identity, strict=False) if a != b]
        return f"the interpreter differs ({', '.join(diff) or 'identity'})"

    def relevant(e: dict[str, str]) -> dict[str, str]:
        return {
            k: v for k, v in e.items() if k not in IGNORED_ENV and not k.startswith("TORCHELASTIC_")
        }

    ours, theirs = relevant(env), relevant(request.env)
    changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if changed:
        shown = ", ".join(changed[:5]) + (
            f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        )
        return f"the environment differs ({shown})"
    return None


def start_time(pid: int) -> str:
    """``pid``'s start time in clock ticks since boot (``/proc/<pid>/stat``), or "" if it is
    gone: a pid and its start time name a process that a recycled pid cannot impersonate."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return ""
    return fields[19].decode() if len(fields) > 19 else ""


def serve(
    listener: socket.socket,
    path: str,
    launcher: int,
    launcher_start: str,
    identity: tuple[Any, ...],
    env: dict[str, str],
) -> Request:
    """The zygote's loop (in the forked zygote process; ``env``: the environment it was made
    with, before the preload imports). Returns only in a worker it forked; the zygote itself and
    its helpers leave through ``os._exit``."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # helpers are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getuid()
    inode = os.stat(path).st_ino

    def leave(code: int) -> None:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        os._exit(code)

    while True:
        if start_time(launcher) != launcher_start:  # the launcher is gone: so is the job
            leave(0)
        ready, _, _ = select.select([listener], [], [], 0.5)
        if not ready:
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        try:
            if peer_uid(conn) != me:
                raise PermissionError("another user")
            conn.settimeout(10.0)
            request, fds = recv(conn, max_fds=3)
            conn.settimeout(None)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            conn.close()
            continue
        request = dataclasses.replace(request, fds=tuple(fds))
        reason = incompatible(request, identity, env)
        if reason is not None or len(fds) != 3:
            with contextlib.suppress(OSError):
                send(conn, ("refused", reason or "no standard streams"))
            leave(0)
        pid = os.fork()
        if pid == 0:
            listener.close()
            return _help(conn, request)
        conn.close()
        for fd in fds:
            os.close(fd)


def _help(conn: socket.socket, request: Request) -> Request:
    """The helper: fork the worker, report it, wait for it. Returns only in the worker."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    helper = os.getpid()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (wake_r, wake_w):
            os.close(fd)
        conn.close()
        _die_with(helper)
        return request
    for fd in request.fds:
        os.close(fd)
    code: int | None = None
    try:
        send(conn, ("started", pid))
        while code is None:
            ready, _, _ = select.select([conn.fileno(), wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 512)  # SIGCHLD's wake-up bytes
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif conn.fileno() in ready and not conn.recv(64):
                raise EOFError  # the proxy is gone
        send(conn, ("exit", code))
    except (OSError, EOFError):
        if code is None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
    os._exit(0)


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (the helper) dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the helper died before the prctl
        os._exit(137)


def become(request: Request, before_imports: dict[str, str]) -> None:
    """Make this forked process the worker ``request`` describes (see the module docstring).

    Its environment is the request's, with what the preload imports changed in the zygote's
    (``before_imports``: the zygote's environment before them) changed the same way, as those
    imports would have in a fresh worker.
    """
    from fastinit.restart import set_launcher

    now = dict(os.environ)
    set_by_imports = {k: v for k, v in now.items() if before_imports.get(k) != v}
    unset_by_imports = before_imports.keys() - now.keys()
    os.setsid()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.umask(request.umask)
    os.environ.clear()
    os.environ.update(request.env)
    os.environ.update(set_by_imports)
    for key in unset_by_imports:
        os.environ.pop(key, None)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _reseed()
    set_launcher(request.launcher)


def _reseed() -> None:
    """Seed what a new interpreter seeds from the OS and a fork copies: torch's CPU generator
    (CUDA's are made at CUDA's initialisation, after this) and NumPy's global state."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
