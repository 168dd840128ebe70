"""The host-memory tier: a committed save's staging buffers, found again after a restart.

Each rank's staging buffer of a save is a file in ``/dev/shm`` named by the save and the rank
(:func:`~fastinit.checkpoint.staging.segment_name`), and the latest committed save's stays
there (``FASTINIT_CHECKPOINT_TIER``). A worker restarted on the same host (torchrun restarts
every worker after one failed) loading that checkpoint maps the buffer of each source rank it
needs instead of reading storage: :func:`open_segment` opens it only if it is a regular file of
this user that no one else can read or write, named by the committed save and rank, whose header
says the same; every item read from it is then checked against the digest the commit proves, and
anything that does not match is read from storage instead. A replaced host simply has no buffer.

Buffers outlive their trainer on purpose (that is the tier) and are released when a job ends
cleanly (``fastinit.checkpoint.close``, or a clean interpreter exit). A job that ends otherwise
leaves them; :func:`reclaim` (run when a process first saves or loads) removes this user's
buffers whose trainer and launcher are both gone, and :func:`adoptable` hands a restarted worker
the buffers its predecessor (same job, launcher and rank) left, so its next save reuses them.

A trainer killed right after its ``save`` returned leaves its writer process finishing that save
(writing, then rank 0's writer committing it): a worker restarted by the same launcher comes
back in about a second, the writers need several. :func:`await_predecessor_writers` waits
(bounded) for the writers of this launcher's dead trainers on this host, so the restart resumes
from the save the loop already paid for instead of the one before it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from fastinit.checkpoint.staging import PREFIX, Segment, segment_name, shm_dir
from fastinit.restart import launcher_pid

__all__ = [
    "open_segment",
    "reclaim",
    "adoptable",
    "remember_loaded",
    "last_loaded",
    "predecessor_writers",
    "await_predecessor_writers",
]

#: What a writer process's command line holds (``python -m fastinit.checkpoint._writer_main``).
_WRITER_MODULE = b"fastinit.checkpoint._writer_main"

_LOADED: list[str] = []


def remember_loaded(save_id: str) -> None:
    """This process loaded save ``save_id`` (its buffer, if adopted, is the tier)."""
    _LOADED[:] = [save_id]


def last_loaded() -> str | None:
    return _LOADED[0] if _LOADED else None


def open_segment(save_id: str, rank: int, named: str | None) -> tuple[Segment | None, str]:
    """Rank ``rank``'s buffer of save ``save_id`` on this host, or None and why not.

    Args:
        save_id: the committed save.
        rank: the rank that staged it.
        named: the buffer the rank's manifest names (None: it staged in private memory).
    """
    directory = shm_dir()
    if directory is None:
        return None, "no /dev/shm"
    name = segment_name(save_id, rank)
    if named != name:
        return None, "the save was not staged in shared memory by this user"
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        return None, "not on this host"
    try:
        segment = Segment.open(path, writable=False)
    except OSError as e:
        return None, f"refused: {e}"
    header = segment.read_header()
    if header.get("save_id") != save_id or header.get("rank") != rank:
        segment.close()
        return None, "its header names another save or rank"
    return segment, ""


def _alive(pid: object) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no /proc: kill(0) is all there is
    return state != [b"Z"]


def _writer_alive(pid: object) -> bool:
    """Whether ``pid`` is a running writer process (not a recycled pid)."""
    if not _alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return _WRITER_MODULE in f.read()
    except OSError:
        return True  # no /proc (or gone meanwhile: the next look sees it dead)


def _mine() -> list[str]:
    directory = shm_dir()
    if directory is None:
        return []
    prefix = f"{PREFIX}.{os.getuid()}."
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names if n.startswith(prefix)]


def _headers() -> list[tuple[str, dict[str, Any]]]:
    """``(path, header)`` of this user's buffers (read-only, unmapped again)."""
    out = []
    for path in _mine():
        try:
            segment = Segment.open(path, writable=False)
        except OSError:
            continue
        out.append((path, segment.read_header()))
        segment.close()
    return out


def _creator(path: str) -> int | None:
    """The pid a spare buffer's name holds (``...free-<pid>-<random>.r<rank>``), or None."""
    _, _, rest = os.path.basename(path).partition(".free-")
    pid = rest.split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def reclaim(*, launcher: int | None = None) -> list[str]:
    """Remove this user's buffers whose trainer, writer and launcher are all gone (and, with
    ``launcher``, those whose trainer and writer are gone and whose launcher is that process: a
    test session ending, other sessions' buffers untouched); their paths."""
    removed = []
    for path, header in _headers():
        if not header:  # a spare buffer of an older fastinit (the header came with a save)
            creator = _creator(path)
            if creator is None or _alive(creator):
                continue
        elif _alive(header.get("pid")) or _alive(header.get("writer")):
            continue
        if header.get("ppid") != launcher and _alive(header.get("ppid")):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed


def adoptable(rank: int, job: str) -> list[tuple[Segment, str | None]]:
    """Buffers of rank ``rank`` that a predecessor of this process left (the same job and
    launcher, its trainer and writer gone), mapped writable for reuse, with the save each
    holds."""
    out: list[tuple[Segment, str | None]] = []
    suffix = f".r{rank}"
    for path in _mine():
        if not path.endswith(suffix):
            continue
        try:
            segment = Segment.open(path, writable=True)
        except OSError:
            continue
        header = segment.read_header()
        if (
            header.get("rank") == rank
            and header.get("job") == job
            and header.get("ppid") == launcher_pid()
            and header.get("pid") != os.getpid()
            and not _alive(header.get("pid"))
            and not _alive(header.get("writer"))
        ):
            out.append((segment, header.get("save_id")))
        else:
            segment.close()
    return out


def predecessor_writers() -> list[int]:
    """Writer processes on this host of this launcher's earlier trainers that are gone (a
    restarted worker's predecessors), still running: finishing a save."""
    pids: set[int] = set()
    for _, header in _headers():
        writer = header.get("writer")
        if (
            header.get("ppid") == launcher_pid()
            and header.get("pid") != os.getpid()
            and not _alive(header.get("pid"))
            and isinstance(writer, int)
            and _writer_alive(writer)
        ):
            pids.add(writer)
    return sorted(pids)


def await_predecessor_writers(timeout: float) -> tuple[list[int], float]:
    """Wait at most ``timeout`` seconds for :func:`predecessor_writers` to finish; the writers
    still running then (none, normally) and the seconds waited."""
    t0 = time.monotonic()
    pids = predecessor_writers()
    while pids and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
        pids = [p for p in pids if _writer_alive(p)]
    return pids, time.monotonic() - t0
