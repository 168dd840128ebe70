"""The writer: a process per rank that writes, checksums and commits what ``save`` staged.

``save`` copies the state into a staging buffer (:mod:`fastinit.checkpoint.staging`) and sends
the writer a :class:`WriteJob`: where the tensors lie in the buffer, DCP's save plan for them
(computed by the trainer, which holds the live ShardedTensors), the pickled small objects, and on
rank 0 the index. The writer writes each part as DCP's ``FileSystemWriter`` would (the files
are DCP's: ``.metadata`` + ``__0_0.distcp``), but with the disk reading the tensors straight from
the staging buffer (:mod:`fastinit.checkpoint.direct`), hashing every file as it is written and
every tensor's staged bytes, then the part's manifest, last and atomically, and answers
``("written", ...)``.

The writer is a separate process (``python -m fastinit.checkpoint.writer``) in a session of its
own, so it neither competes with the training loop for the interpreter nor dies when torchrun
kills the trainer's process group: once a job is handed over, it is finished. When its trainer is
gone (its pipe closes), the writer finishes the jobs it has; rank 0's writer then commits them
from the files (:func:`fastinit.checkpoint.commit.gather_manifests`), and every writer exits.
It imports torch at its first job (not while its trainer starts up) and never touches CUDA.

Where no shared memory is available the same code runs on a thread of the trainer
(:class:`WriterThread`): it then dies with the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

from fastinit import _faults
from fastinit.checkpoint import commit as commits
from fastinit.checkpoint import direct
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint.digest import digest, file_digest
from fastinit.checkpoint.priority import lower_priority
from fastinit.checkpoint.staging import Segment, Slot

__all__ = ["Part", "WriteJob", "Written", "WriterProcess", "WriterThread", "write_job", "main"]


@dataclasses.dataclass(slots=True)
class Part:
    """One DCP checkpoint to write: a rank's shards, or the replicated values."""

    subdir: str
    """``rank_<r>`` or ``replicated``."""
    plan: Any
    """DCP's final ``SavePlan`` of the part (write items, storage prefix)."""
    metadata: Any
    """DCP's ``Metadata`` of the part (as its planner made it; storage data comes from the write)."""
    slots: dict[tuple[str, tuple[int, ...]], Slot]
    """(fqn, chunk offsets) -> where the tensor lies in the staging buffer."""
    objects: dict[str, bytes]
    """fqn -> the bytes DCP writes for a non-tensor value (``torch.save`` of it)."""
    extra: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """Other files of the part (``layouts.json``), written before the manifest."""


@dataclasses.dataclass(slots=True)
class WriteJob:
    """One rank's share of one save."""

    save_id: str
    checkpoint_dir: str
    rank: int
    world_size: int
    segment_path: str | None
    """The staging buffer's /dev/shm file, named by the save (what a restart on this host
    opens); None when it is the trainer's private memory."""
    parts: list[Part]
    index: bytes | None = None
    """Rank 0: the index's bytes."""
    timeout: float = 300.0
    job: str = ""
    torch_version: str = ""
    faults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The fault actions a test installed in the trainer (the writer honours them too)."""
    rate: float | None = None
    """Bytes per second the data files are written at while the trainer runs and does not wait
    for this save (``FASTINIT_CHECKPOINT_WRITE_RATE``); None: as fast as the disk goes."""


@dataclasses.dataclass(slots=True)
class Written:
    """What a writer reports for a job."""

    save_id: str
    ok: bool
    manifest: str = ""
    """This rank's manifest digest."""
    replicated: str = ""
    index: str = ""
    error: str = ""
    seconds: float = 0.0
    bytes: int = 0
    digest_s: float = 0.0
    """Seconds spent computing digests of the staged items (the files hash as they stream)."""
    cpu_s: float = 0.0
    """CPU seconds (user and system) the write took: what it took from the host's trainers."""
    paced_s: float = 0.0
    """Seconds the write slept to keep to its rate (in ``seconds``)."""


# -- writing one job -------------------------------------------------------------------------


def _resolve(part: Part, segment: Segment) -> Any:
    """Each item's data for :func:`direct.write_items`, from the staging buffer."""
    from torch.distributed.checkpoint.planner import WriteItemType

    def resolve(item: Any) -> tuple[Any, memoryview | None, int]:
        if item.type == WriteItemType.BYTE_IO:
            return part.objects[item.index.fqn], None, 0
        slot = part.slots[(item.index.fqn, tuple(item.index.offset))]
        return segment.slot(slot), segment.bytes_at(slot.offset, slot.nbytes), slot.offset

    return resolve


def _write_part(
    job: WriteJob, part: Part, segment: Segment, timing: dict[str, float], pace: direct.Pace
) -> tuple[fmt.Manifest, bytes]:
    import torch.distributed.checkpoint as dcp

    part_dir = os.path.join(job.checkpoint_dir, fmt.data_dir_name(job.save_id), part.subdir)
    writer = dcp.FileSystemWriter(part_dir, sync_files=True, thread_count=1, overwrite=False)
    writer.save_id = job.save_id
    writer.set_up_storage_writer(True)
    plan = writer.prepare_local_plan(part.plan)
    _faults.point("checkpoint.write", rank=job.rank, part=part.subdir)
    results, files, where = direct.write_items(part_dir, plan, _resolve(part, segment), pace=pace)
    writer.finish(dataclasses.replace(part.metadata), [results])
    files[fmt.DCP_METADATA] = file_digest(os.path.join(part_dir, fmt.DCP_METADATA))
    for name, data in part.extra.items():
        fmt.write_bytes_atomic(os.path.join(part_dir, name), data)
        files[name] = (len(data), digest(data))
    items: list[fmt.Item] = []
    for wr in results:
        info = wr.storage_data
        fqn = wr.index.fqn
        if fqn in part.objects and wr.index.offset is None:
            data = part.objects[fqn]
            items.append(
                fmt.Item(fqn, None, info.relative_path, info.offset, info.length, digest(data))
            )
            continue
        slot = part.slots[(fqn, tuple(wr.index.offset or ()))]
        at = where.get(wr.index, 0)
        staged = segment.bytes_at(slot.offset, slot.nbytes) if slot.nbytes else b""
        t = time.perf_counter()
        item_digest = digest(staged)
        timing["digest_s"] += time.perf_counter() - t
        items.append(
            fmt.Item(
                fqn,
                slot.chunk_offsets,
                info.relative_path,
                at,
                slot.nbytes,
                item_digest,
                slot.offset if job.segment_path is not None else None,
            )
        )
    manifest = fmt.Manifest(
        save_id=job.save_id,
        part=part.subdir,
        rank=job.rank,
        files=files,
        items=items,
        segment=None if job.segment_path is None else os.path.basename(job.segment_path),
        torch_version=job.torch_version,
    )
    data = fmt.write_json_atomic(os.path.join(part_dir, fmt.MANIFEST_FILE), manifest.to_json())
    return manifest, data


def write_job(
    job: WriteJob, segment: Segment, limited: Callable[[], bool] = lambda: True
) -> Written:
    """Write this rank's parts of a save (and rank 0's index); never raises. The data files are
    written at ``job.rate`` while ``limited()`` holds (:class:`~fastinit.checkpoint.direct.Pace`)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = Written(job.save_id, ok=False)
    timing = {"digest_s": 0.0}
    pace = direct.Pace(job.rate, limited)
    try:
        for part in job.parts:
            manifest, data = _write_part(job, part, segment, timing, pace)
            out.bytes += sum(size for size, _ in manifest.files.values())
            if part.subdir == fmt.REPLICATED_DIR:
                out.replicated = digest(data)
            else:
                out.manifest = digest(data)
        if job.index is not None:
            _faults.point("checkpoint.index", rank=job.rank)
            path = os.path.join(job.checkpoint_dir, fmt.data_dir_name(job.save_id), fmt.INDEX_FILE)
            fmt.write_bytes_atomic(path, job.index)
            out.index = digest(job.index)
        out.ok = True
    except BaseException as e:  # noqa: BLE001 - reported to every rank by the commit
        out.error = f"{type(e).__name__}: {e}"
        part_dir = os.path.join(
            job.checkpoint_dir,
            fmt.data_dir_name(job.save_id),
            fmt.RANK_DIR_PATTERN.format(rank=job.rank),
        )
        commits.write_failure(part_dir, out.error)
    out.seconds = time.perf_counter() - t0
    out.cpu_s = time.thread_time() - c0
    out.digest_s = timing["digest_s"]
    out.paced_s = pace.slept
    return out


def commit_written(
    checkpoint_dir: str,
    save_id: str,
    world_size: int,
    own: Written,
    *,
    timeout: float,
    torch_version: str,
    job: str,
) -> None:
    """Rank 0: commit save ``save_id`` from the manifests the ranks wrote (no messages); raises
    :class:`~fastinit.checkpoint.format.CheckpointError` if rank 0's write or any rank's failed."""
    if not own.ok:
        raise fmt.CheckpointError(f"rank 0 failed: {own.error}")
    manifests = commits.gather_manifests(checkpoint_dir, save_id, world_size, timeout=timeout)
    commits.commit(
        checkpoint_dir,
        save_id,
        index_digest=own.index,
        manifests=manifests,
        replicated=own.replicated,
        torch_version=torch_version,
        job=job,
    )


def commit_from_files(job: WriteJob, own: Written) -> None:
    """Rank 0 without its trainer: commit (or abort) save ``job`` from the ranks' manifests."""
    if os.path.exists(fmt.abort_file(job.checkpoint_dir, job.save_id)):
        return  # the trainer decided (and recorded) that it failed
    try:
        commit_written(
            job.checkpoint_dir,
            job.save_id,
            job.world_size,
            own,
            timeout=job.timeout,
            torch_version=job.torch_version,
            job=job.job,
        )
    except fmt.CheckpointError as e:
        commits.abort(job.checkpoint_dir, job.save_id, str(e))


# -- the process ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The writer process: serve jobs from the trainer over the pipe on fd ``argv[0]``."""
    argv = sys.argv[1:] if argv is None else argv
    # below its trainer's main thread (started by a thread that may have lowered itself),
    # before its own threads start: they inherit it
    lower_priority(session=True, below=os.getppid())
    conn = Connection(int(argv[0]))
    hello = conn.recv()
    for name, action in hello.get("faults", {}).items():
        _faults.install(name, action)
    inbox = _Inbox(conn)
    segments: dict[int, Segment] = {}
    uncommitted: dict[str, tuple[WriteJob, Written]] = {}
    while (msg := inbox.next()) is not None:  # what the trainer sent before it went is still read
        kind = msg[0]
        if kind == "job":
            job: WriteJob = msg[1]  # unpickling it imported torch (DCP's plan and metadata)
            _torch_once()
            segment = _segment(segments, msg[2])
            _faults.clear()
            for name, action in job.faults.items():
                _faults.install(name, action)
            result = write_job(job, segment, functools.partial(inbox.limited, job.save_id))
            inbox.hurry.discard(job.save_id)
            if job.rank == 0:
                uncommitted[job.save_id] = (job, result)
            inbox.send(("written", result))
        elif kind == "verdict":
            uncommitted.pop(msg[1], None)
            inbox.hurry.discard(msg[1])  # a hurry that came after its job was written
        elif kind == "close":
            break
    # The trainer left (or is gone) without deciding these saves: rank 0 decides from the files.
    for job, result in uncommitted.values():
        commit_from_files(job, result)
    for seg in segments.values():
        seg.close()
    return 0


@functools.cache
def _torch_once() -> None:
    """Set torch up for writing, at the first job rather than when the writer starts.

    The writer starts during its trainer's start-up (``prepare``), and importing torch and
    DCP costs some 2 s of CPU: on a host whose cores the trainers' own start-up fills (this
    project's CI host: 2 cores, 2 ranks), a restart's time to first batch grew by 1-2 s when
    every writer imported torch at once beside it. At the first job the trainers are past
    their start-up and the import overlaps training (``docs/checkpoint.md``, "The writer
    process").
    """
    import torch

    torch.serialization.set_crc32_options(False)  # the manifest's digests replace zip's CRC


class _Inbox:
    """The writer's end of the pipe: the trainer's messages in order, read between jobs and,
    while a job is written, as they come (:meth:`limited`), so that the writer hears at once
    that its trainer waits for the save (``hurry``) or is gone (the pipe closed)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.queue: deque[tuple[Any, ...]] = deque()
        self.gone = False
        """The pipe is closed at the trainer's end and every message in it read."""
        self.unheard = False
        """A message could not be sent: the trainer is gone (its messages may still be unread)."""
        self.hurry: set[str] = set()

    def _read(self) -> None:
        try:
            msg = self.conn.recv()
            if msg[0] == "job":  # the staging buffer's file descriptor follows it
                msg = (*msg, recv_handle(self.conn))
        except (EOFError, OSError):
            self.gone = True
            return
        if msg[0] == "hurry":
            self.hurry.add(msg[1])
        else:
            self.queue.append(msg)

    def next(self) -> tuple[Any, ...] | None:
        """The next message, or None once the trainer is gone and every message is read."""
        while not self.queue and not self.gone:
            self._read()
        return self.queue.popleft() if self.queue else None

    def limited(self, save_id: str) -> bool:
        """Whether save ``save_id`` may still be written at its rate: its trainer runs and does
        not wait for it."""
        with contextlib.suppress(OSError):
            while not self.gone and save_id not in self.hurry and self.conn.poll(0):
                self._read()
        return not (self.gone or self.unheard) and save_id not in self.hurry

    def send(self, msg: Any) -> None:
        if self.gone or self.unheard:
            return
        try:
            self.conn.send(msg)
        except OSError:
            self.unheard = True  # the trainer is gone: go on with what it handed over


def _segment(cache: dict[int, Segment], fd: int) -> Segment:
    """The staging buffer behind ``fd`` (a file descriptor the trainer passed), mapped once per
    buffer: the trainer reuses its buffers, so the writer's mapping (and its page tables) is
    reused too."""
    inode = os.fstat(fd).st_ino
    seg = cache.get(inode)
    if seg is not None:
        os.close(fd)
        return seg
    seg = cache[inode] = Segment.from_fd(fd)
    return seg


# -- the trainer's side ------------------------------------------------------------------------


class WriterProcess:
    """The trainer's handle on its writer process (started once, in the background)."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ours, theirs = mp.Pipe(duplex=True)
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the writer never touches a GPU
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastinit.checkpoint._writer_main", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # torchrun kills the trainer's process group, not this
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        theirs.close()
        self.conn = ours
        self._lock = threading.Lock()
        self._results: dict[str, Written] = {}
        self.conn.send({"faults": _faults.installed()})

    def _pump(self, timeout: float) -> bool:
        """Receive one message (within ``timeout``); False when the writer is gone."""
        try:
            if not self.conn.poll(timeout):
                return True
            msg = self.conn.recv()
        except (EOFError, OSError):
            return False
        if msg[0] == "written":
            self._results[msg[1].save_id] = msg[1]
        return True

    def submit(self, job: WriteJob, segment: Segment) -> None:
        """Hand ``job`` over with its staging buffer's file descriptor (the writer needs no
        name: the buffer may be renamed or released here while it writes)."""
        with self._lock:
            self.conn.send(("job", job))
            send_handle(self.conn, segment.fileno(), self.proc.pid)

    def result(self, save_id: str, timeout: float) -> Written:
        """The writer's report of ``save_id`` (a failed one if it does not come in time)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if save_id not in self._results:
                with contextlib.suppress(OSError):  # written at full speed from now on
                    self.conn.send(("hurry", save_id))
            while save_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Written(
                        save_id,
                        ok=False,
                        error=f"the writer process did not finish within {timeout:g}s "
                        "(FASTINIT_COLLECTIVE_TIMEOUT)",
                    )
                if not self._pump(min(left, 1.0)) or self.proc.poll() is not None:
                    if save_id in self._results:
                        break
                    return Written(
                        save_id,
                        ok=False,
                        error=f"the writer process died (exit code {self.proc.poll()})",
                    )
            return self._results.pop(save_id)

    def done(self, save_id: str) -> bool:
        with self._lock:
            while self.conn.poll(0):
                if not self._pump(0):
                    break
            return save_id in self._results

    def verdict(self, save_id: str) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.conn.send(("verdict", save_id))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Ask the writer to exit once its queue is done (it never abandons a job)."""
        with self._lock, contextlib.suppress(OSError):
            self.conn.send(("close",))
        with contextlib.suppress(OSError):
            self.conn.close()


class WriterThread:
    """The same writer on a thread of the trainer (no shared memory: it dies with the trainer)."""

    def __init__(self) -> None:
        self._results: dict[str, Written] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._hurry: dict[str, threading.Event] = {}

    def submit(self, job: WriteJob, segment: Segment) -> None:
        hurry = self._hurry[job.save_id] = threading.Event()

        def run() -> None:
            self._results[job.save_id] = write_job(job, segment, lambda: not hurry.is_set())

        t = threading.Thread(target=run, name="fastinit-checkpoint-writer", daemon=True)
        self._threads[job.save_id] = t
        t.start()

    def result(self, save_id: str, timeout: float) -> Written:
        t = self._threads.pop(save_id, None)
        hurry = self._hurry.pop(save_id, None)
        if hurry is not None:
            hurry.set()
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                self._threads[save_id] = t
                return Written(
                    save_id,
                    ok=False,
                    error=f"the writer thread did not finish within {timeout:g}s "
                    "(FASTINIT_COLLECTIVE_TIMEOUT)",
                )
        return self._results.pop(save_id, Written(save_id, ok=False, error="no such save"))

    def done(self, save_id: str) -> bool:
        t = self._threads.get(save_id)
        return t is None or not t.is_alive()

    def verdict(self, save_id: str) -> None:
        pass

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        for t in list(self._threads.values()):
            t.join()
