"""``save``: one copy on the loop, a writer process for the rest, one verdict for every rank.

On every rank, :func:`save`:

1. finishes this process's previous save if it is still in flight (one save in flight per
   process: its ``wait``);
2. checks the user's input and the directory (no committed checkpoint there, fastinit's or stock
   DCP's; no save of this process in flight into it), then sends the save's one start message:
   an all_gather of a 64-byte record (this rank's verdict on the input, a digest of the
   directory it was given, and on rank 0 the save's id). Any problem on any rank (bad
   ``metadata`` on rank 0 only, a rank given another directory) raises the same
   :class:`CheckpointError` on every rank before a byte is written;
3. copies the rank's tensors (its shards; rank 0 also the replicated values) into a staging
   buffer allocated once (:mod:`fastinit.checkpoint.staging`) — the only part the loop waits
   for — and hands the buffer and DCP's save plan to the writer
   (:mod:`fastinit.checkpoint.writer`), which writes ``data-<save id>/`` while training goes on.

:meth:`SaveHandle.wait` gives every rank one verdict: it gathers every rank's "files durable"
and manifest digest, rank 0 creates the commit marker (naming the digest of every manifest and
the index), and rank 0's verdict is broadcast; if those messages fail (a peer died), the verdict
comes from the files (:mod:`fastinit.checkpoint.commit`). Every wait is bounded by
``FASTINIT_COLLECTIVE_TIMEOUT``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import io
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit import _faults, knobs
from fastinit.checkpoint import _dcp, tier
from fastinit.checkpoint import commit as commits
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint._comm import CollectiveFailed, Group
from fastinit.checkpoint.digest import DIGEST_BYTES, digest
from fastinit.checkpoint.priority import lower_priority
from fastinit.checkpoint.staging import Layout, Pool, copy_in
from fastinit.checkpoint.state import (
    build_state,
    entry_of,
    flat_state,
    global_runs,
    is_sharded,
    shard0_rank,
)
from fastinit.checkpoint.touched import Touched
from fastinit.checkpoint.writer import (
    Part,
    WriteJob,
    WriterProcess,
    WriterThread,
    Written,
    commit_written,
)
from fastinit.restart import launcher_pid
from fastinit.tables import refuse_pending

if TYPE_CHECKING:
    from torch import nn

__all__ = ["save", "prepare", "SaveHandle", "close"]

_RECORD = 64
_VERDICT = 24
# What a rank found wrong with a save before writing (the start record's first byte).
_PROBLEMS = {
    1: "bad input (metadata, optimizers or directory)",
    2: "the directory holds a committed fastinit checkpoint",
    3: "the directory holds a stock DCP checkpoint",
    4: "a save of this process into the directory is in flight",
    5: "preparing the state failed",
    6: "tables fastinit.setup(init_tables=False) left are not initialised yet",
}
# The verdict rank 0 broadcasts.
_COMMITTED, _RANK_FAILED, _MARKER_FAILED, _TAKEN = 1, 2, 3, 4


class _Refused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- the process's saving machinery -----------------------------------------------------------


class _Saver:
    """This process's staging buffers, writer and save in flight (one per process)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pool: Pool | None = None
        self.writer: WriterProcess | WriterThread | None = None
        self.pending: SaveHandle | None = None
        self.plans: dict[str, tuple[Any, Any, Any]] = {}
        self.mode = ""
        self.warned = False
        self._exit_hook = False
        self.touched: Touched | None = None
        """The rows training touched since each buffer's last copy (None: copy whole)."""
        self.ahead_seen = 0
        """``touched.ahead_bytes`` at the last save."""

    def setup(self, rank: int) -> None:
        """Make the pool and start the writer (once)."""
        with self.lock:
            if self.pool is not None:
                return
            mode = knobs.get_checkpoint_staging()
            tier = knobs.get_checkpoint_tier()
            self.pool = Pool(
                rank,
                keep_tier=tier != 0 and mode == "process",
                tier_limit=tier,
                shared=mode == "process",
                reuse=mode != "off",
                spare=_copies_ahead(),
            )
            self.pool.quiet = _quiet
            if mode == "process" and not self.pool.shared:
                mode = "thread"
            self.mode = mode
            if mode == "process":
                try:
                    self.writer = WriterProcess()
                except OSError as e:
                    warnings.warn(
                        f"fastinit.checkpoint: cannot start the writer process ({e}); writing "
                        "on a thread of the trainer",
                        stacklevel=3,
                    )
                    self.mode = "thread"
            if self.writer is None:
                self.writer = WriterThread()
            self.pool.owner = self.owner()
            if isinstance(self.writer, WriterProcess):
                self._take_over(rank)
            if not self._exit_hook:
                atexit.register(_at_exit)
                self._exit_hook = True

    def _take_over(self, rank: int) -> None:
        """Remove dead jobs' buffers; reuse the ones this rank's predecessor left (a restart)."""
        assert self.pool is not None
        with contextlib.suppress(OSError):
            tier.reclaim()
        loaded = tier.last_loaded()
        found = sorted(tier.adoptable(rank, _job()), key=lambda x: x[1] != loaded)  # tier first
        owner = self.owner()
        for segment, save_id in found:
            tiered = save_id is not None and save_id == loaded
            self.pool.adopt(segment, save_id or "", tier=tiered, owner=owner)

    def tracker(self) -> Touched | None:
        """The record of touched rows (made once; None with ``FASTINIT_CHECKPOINT_DELTA=off``
        or ``FASTINIT_CHECKPOINT_STAGING=off``, whose buffers are never reused)."""
        with self.lock:
            if (
                self.touched is None
                and knobs.get_checkpoint_staging() != "off"
                and knobs.get_checkpoint_delta()
            ):
                self.touched = Touched()
                if knobs.get_checkpoint_ahead():
                    self.touched.copy_ahead(_ahead_buffers)
            return self.touched

    def owner(self) -> dict[str, Any]:
        """What a staging buffer's header says of who holds it: this job, process, launcher
        and writer process."""
        writer = self.writer.proc.pid if isinstance(self.writer, WriterProcess) else None
        return {"job": _job(), "pid": os.getpid(), "ppid": launcher_pid(), "writer": writer}

    def ensure_writer(self) -> WriterProcess | WriterThread:
        """The writer for the next job: a process while the buffers are shared, else (no
        /dev/shm, or it filled up) a thread; a writer process that died is started again."""
        assert self.writer is not None and self.pool is not None
        if isinstance(self.writer, WriterProcess):
            if not self.pool.shared:
                self.writer.close()
                self.writer = WriterThread()
                self.mode = "thread"
            elif not self.writer.alive():
                self.writer = WriterProcess()
        return self.writer


_SAVER = _Saver()


def _copies_ahead() -> bool:
    """Whether touched rows are copied ahead between saves (into a spare buffer)."""
    return (
        knobs.get_checkpoint_ahead()
        and knobs.get_checkpoint_delta()
        and knobs.get_checkpoint_staging() != "off"
    )


def _ahead_buffers() -> list[Any]:
    pool = _SAVER.pool
    return [] if pool is None else pool.ahead_buffers()


def _quiet() -> Any:
    touched = _SAVER.touched
    return contextlib.nullcontext() if touched is None else touched.paused()


def _at_exit() -> None:
    """At interpreter exit: say what happens to a save still in flight; release the buffers
    when the process ends cleanly (a crash keeps them: the host-memory tier for a restart)."""
    handle = _SAVER.pending
    if handle is not None and not handle._waited:
        if isinstance(_SAVER.writer, WriterProcess):
            print(
                f"fastinit.checkpoint: WARNING: the save into {handle.checkpoint_dir} was still "
                "in flight at exit (SaveHandle.wait() was not called); its writer process "
                "finishes it and commits it from the files",
                file=sys.stderr,
            )
        else:
            print(
                f"fastinit.checkpoint: WARNING: the save into {handle.checkpoint_dir} was still "
                "in flight at exit (SaveHandle.wait() was not called); finishing it here",
                file=sys.stderr,
            )
            handle._finish_at_exit()
    writer = _SAVER.writer
    if writer is not None:
        writer.close()
    crashed = hasattr(sys, "last_value")
    if _SAVER.pool is not None and not crashed:
        _SAVER.pool.release()


def state_written(model: nn.Module | None = None) -> None:
    """``model``'s state (None: any) was written where torch does not count it (a load): the
    next save of every buffer copies it whole (:meth:`~fastinit.checkpoint.touched.Touched.
    invalidate`)."""
    if _SAVER.touched is not None:
        _SAVER.touched.invalidate(model)


def close() -> None:
    """Finish this process's save in flight (``wait``), stop the writer, release the staging
    buffers (the host-memory tier included). Call it when the job ends cleanly."""
    handle = _SAVER.pending
    if handle is not None and not handle._waited:
        handle.wait()
    with _SAVER.lock:
        if _SAVER.writer is not None:
            _SAVER.writer.close()
            _SAVER.writer = None
        if _SAVER.pool is not None:
            _SAVER.pool.release()
            _SAVER.pool = None
        if _SAVER.touched is not None:
            _SAVER.touched.close()
            _SAVER.touched = None
        _SAVER.ahead_seen = 0


# -- what a save writes ---------------------------------------------------------------------------


def _plan_key(values: Mapping[str, Any]) -> str:
    """A digest of everything DCP's save plan of ``values`` depends on (not their data)."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    parts: list[Any] = []
    for fqn, v in values.items():
        if isinstance(v, ShardedTensor):
            md = v.metadata()
            shards = [
                (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
                for s in v.local_shards()
            ]
            parts.append((fqn, "st", str(md.tensor_properties.dtype), tuple(md.size), shards))
        elif isinstance(v, torch.Tensor):
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in _dcp.chunks_of(v)]
            parts.append((fqn, type(v).__name__, str(v.dtype), tuple(v.shape), chunks))
        else:
            parts.append((fqn, "obj"))
    return digest(repr(parts).encode())


def _plan(values: Mapping[str, Any], cache: dict[str, tuple[Any, Any, Any]], key: str) -> Any:
    """DCP's final save plan and metadata of ``values`` as one DCP checkpoint (cached)."""
    hit = cache.get(key)
    if hit is not None:
        return hit[0], hit[1]
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(values), storage_meta=None, is_coordinator=True)
    local = planner.create_local_plan()
    plans, metadata = planner.create_global_plan([local])
    plans = FileSystemWriter("unused").prepare_global_plan(plans)
    final = planner.finish_plan(plans[0])
    if len(cache) > 8:
        cache.clear()
    cache[key] = (final, metadata, None)
    return final, metadata


def _tensors(values: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], Any]]:
    """Every tensor chunk of ``values`` this rank writes: ``(fqn, chunk offsets, local data)``."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out: list[tuple[str, tuple[int, ...], Any]] = []
    for fqn, v in values.items():
        if isinstance(v, ShardedTensor):
            for shard in v.local_shards():
                out.append((fqn, tuple(shard.metadata.shard_offsets), shard.tensor))
        elif isinstance(v, DTensor):
            (chunk,) = _dcp.chunks_of(v)
            out.append((fqn, tuple(chunk.offsets), v.to_local()))
        elif isinstance(v, torch.Tensor):
            out.append((fqn, (0,) * v.dim(), v))
    return out


def _objects(values: Mapping[str, Any]) -> dict[str, bytes]:
    """The bytes DCP writes for each non-tensor value (its planner's ``torch.save`` of it)."""
    import torch

    out: dict[str, bytes] = {}
    for fqn, v in values.items():
        if not isinstance(v, torch.Tensor):
            buf = io.BytesIO()
            torch.save(v, buf)
            out[fqn] = buf.getvalue()
    return out


def _build_index(
    model: nn.Module,
    flat: Mapping[str, Any],
    world_size: int,
    optimizers: list[str],
    metadata: dict[str, Any],
    save_id: str,
) -> fmt.Index:
    import torch

    entries = [entry_of(k, v) for k, v in flat.items() if k.startswith("model.")]
    sharded: dict[str, list[Any]] = {}
    for k, v in flat.items():
        if k.startswith("model.") and is_sharded(v):
            runs = global_runs(v)
            if runs is not None:
                sharded[k] = [r.to_json() for r in runs]
    plan_bytes = plan_sha = None
    plan = getattr(model, "plan", None)
    if plan is not None:
        try:
            import hashlib

            from fastinit.plan.codec import encode_plan

            plan_bytes = encode_plan(plan)
            plan_sha = hashlib.sha256(plan_bytes).hexdigest()
        except Exception as e:  # noqa: BLE001 - a plan the codec cannot hold is not fatal
            warnings.warn(
                f"fastinit.checkpoint: the plan is not encodable ({e}); the index holds no plan",
                stacklevel=3,
            )
    step = metadata.get("step")
    return fmt.Index(
        world_size=world_size,
        rank_dir_pattern=fmt.RANK_DIR_PATTERN,
        model=entries,
        fingerprint=fmt.fingerprint(entries),
        sharded=sharded,
        replicated=[k for k, v in flat.items() if not is_sharded(v)],
        optimizers=optimizers,
        plan=plan_bytes,
        plan_sha256=plan_sha,
        step=step if isinstance(step, int) else None,
        metadata=metadata,
        torch_version=torch.__version__,
        save_id=save_id,
        state=[
            entry_of(k, v) for k, v in flat.items() if not k.startswith("model.") and is_sharded(v)
        ],
    )


def _layouts(flat: Mapping[str, Any], rank: int) -> dict[str, list[Any]]:
    """The layouts this rank records: sharded non-model values whose shard 0 it holds."""
    out: dict[str, list[Any]] = {}
    for k, v in flat.items():
        if k.startswith("model.") or not is_sharded(v) or shard0_rank(v) != rank:
            continue
        runs = global_runs(v)
        if runs is not None:
            out[k] = [r.to_json() for r in runs]
    return out


# -- the handle -----------------------------------------------------------------------------------


class SaveHandle:
    """A save in progress; :meth:`wait` on every rank gives its verdict.

    Attributes:
        checkpoint_dir: the checkpoint directory.
        save_id: the save's identity (every rank's is rank 0's).
        blocking_s: seconds :func:`save` held the caller (the previous save's finish, the start
            message and the staging copy; the whole save with ``blocking=True``).
        agree_s: seconds of those in the start message: the ranks agreeing on the save, which
            includes waiting for the last rank to reach ``save``.
        stage_s: seconds of the staging copy alone.
        staged_bytes: bytes of this rank's tensors staged (its shards; rank 0 also the
            replicated values).
        copied_bytes: of those, the bytes the staging copy moved: less than ``staged_bytes``
            where only the rows training touched were copied (``FASTINIT_CHECKPOINT_DELTA``).
        ahead_bytes: bytes of touched rows copied ahead, off the loop, since the previous save
            (``FASTINIT_CHECKPOINT_AHEAD``): the work the staging copy did not have to do.
        wait_s: seconds :meth:`wait` held the caller.
        committed: True once :meth:`wait` returned.
        written: the writer's report (bytes, seconds), once waited.
    """

    def __init__(self, checkpoint_dir: str, save_id: str, group: Group) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.save_id = save_id
        self.blocking_s = 0.0
        self.agree_s = 0.0
        self.stage_s = 0.0
        self.staged_bytes = 0
        self.copied_bytes = 0
        self.ahead_bytes = 0
        self.wait_s = 0.0
        self.committed = False
        self.written: Written | None = None
        self._group = group
        self._waited = False
        self._error: BaseException | None = None
        self._local_failure: Written | None = None

    def done(self) -> bool:
        """True when this rank's files are written (the verdict still needs :meth:`wait`)."""
        if self._waited:
            return True
        writer = _SAVER.writer
        return writer is None or writer.done(self.save_id)

    def wait(self) -> None:
        """This rank's files durable, then the verdict of every rank (call on every rank).

        Returns when the checkpoint is committed (the marker is on disk); raises on every rank
        otherwise. Bounded by ``FASTINIT_COLLECTIVE_TIMEOUT``.

        Raises:
            CheckpointError: the save failed on some rank, the directory was committed by
                another save meanwhile, the marker could not be written, or a peer died before
                the verdict (then the verdict comes from the files: committed if every rank's
                files and the marker landed).
        """
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        t0 = time.perf_counter()
        try:
            self._verdict()
        except fmt.CheckpointError as e:
            self._error = e
        finally:
            self._waited = True
            self.wait_s = time.perf_counter() - t0
            if _SAVER.pool is not None:
                _SAVER.pool.settle(self.save_id, self._error is None)
            if _SAVER.writer is not None:
                _SAVER.writer.verdict(self.save_id)
        if self._error is not None:
            raise self._error
        self.committed = True

    def _verdict(self) -> None:
        group = self._group
        if self._local_failure is not None:
            own = self._local_failure
        else:
            assert _SAVER.writer is not None
            own = _SAVER.writer.result(self.save_id, group.timeout)
        self.written = own
        mine = bytes([1 if own.ok else 0]) + (
            bytes.fromhex(own.manifest) if own.ok else b"\0" * DIGEST_BYTES
        )
        try:
            records = group.all_gather_bytes(mine, _VERDICT, "commit exchange")
            failed = [r for r, rec in enumerate(records) if rec[0] != 1]
            verdict, reason = _COMMITTED, ""
            if group.rank == 0:
                verdict, reason = self._decide(records, failed, own)
            verdict = group.broadcast_byte(verdict, "commit verdict")
        except CollectiveFailed as e:
            self._from_files(own, e)
            return
        if verdict == _COMMITTED:
            return
        if not own.ok:
            raise fmt.CheckpointError(
                f"saving {self.checkpoint_dir} failed on rank {group.rank}: {own.error}; "
                "nothing was committed"
            )
        if verdict == _RANK_FAILED:
            shown = ", ".join(map(str, failed[:8])) + (" ..." if len(failed) > 8 else "")
            raise fmt.CheckpointError(
                f"saving {self.checkpoint_dir} failed on rank(s) {shown} (each says why); "
                "nothing was committed"
            )
        if reason:
            raise fmt.CheckpointError(reason)
        if verdict == _TAKEN:
            raise commits.Taken(
                f"{self.checkpoint_dir} was committed by another save while this one was being "
                "written (two jobs, or two saves, into one directory): this save is not committed "
                "and the checkpoint there is left as it is"
            )
        raise fmt.CheckpointError(
            f"saving {self.checkpoint_dir}: rank 0 could not write the commit marker (rank 0 "
            "says why); nothing was committed"
        )

    def _decide(self, records: list[bytes], failed: list[int], own: Written) -> tuple[int, str]:
        """Rank 0: commit if every rank's files are durable; the verdict and why not."""
        if failed:
            reason = f"rank(s) {failed[:8]} failed to write"
            commits.abort(self.checkpoint_dir, self.save_id, reason)
            return _RANK_FAILED, ""
        try:
            commits.commit(
                self.checkpoint_dir,
                self.save_id,
                index_digest=own.index,
                manifests=[rec[1 : 1 + DIGEST_BYTES].hex() for rec in records],
                replicated=own.replicated,
                torch_version=_torch_version(),
                job=_job(),
            )
        except fmt.CheckpointError as e:
            commits.abort(self.checkpoint_dir, self.save_id, str(e))
            return (_TAKEN if isinstance(e, commits.Taken) else _MARKER_FAILED), str(e)
        return _COMMITTED, ""

    def _from_files(self, own: Written, cause: Exception) -> None:
        """The verdict when the messages failed: from the manifests and the marker."""
        group = self._group
        try:
            if group.rank == 0:
                self._commit_written(own)
            else:
                commits.await_verdict(self.checkpoint_dir, self.save_id, timeout=group.timeout)
        except fmt.CheckpointError as e:
            if group.rank == 0:
                commits.abort(self.checkpoint_dir, self.save_id, str(e))
            raise fmt.CheckpointError(f"{e} (the commit messages failed first: {cause})") from cause

    def _commit_written(self, own: Written) -> None:
        """Rank 0: the commit from the manifests on disk (no messages)."""
        commit_written(
            self.checkpoint_dir,
            self.save_id,
            self._group.world_size,
            own,
            timeout=self._group.timeout,
            torch_version=_torch_version(),
            job=_job(),
        )

    def _finish_at_exit(self) -> None:
        """At exit, with no writer process: finish the write; rank 0 commits from the files."""
        writer = _SAVER.writer
        if writer is None:
            return
        own = writer.result(self.save_id, self._group.timeout)
        self._waited = True
        if self._group.rank != 0:
            return
        try:
            self._commit_written(own)
        except fmt.CheckpointError as e:
            commits.abort(self.checkpoint_dir, self.save_id, str(e))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _job() -> str:
    """This job's name for humans: torchelastic's run id, else the launcher's address."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return run
    addr = os.environ.get("MASTER_ADDR")
    return f"{addr}:{os.environ.get('MASTER_PORT', '')}" if addr else f"pid {launcher_pid()}"


# -- save -------------------------------------------------------------------------------------------


def _check_input(
    checkpoint_dir: Any, optimizers: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise _Refused(1, f"checkpoint_dir must be a path, got {type(checkpoint_dir).__name__}")
    path = os.path.normpath(os.path.abspath(os.fspath(checkpoint_dir)))
    if metadata is not None and not isinstance(metadata, Mapping):
        raise _Refused(1, f"metadata must be a mapping, got {type(metadata).__name__}")
    meta = dict(metadata or {})
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _Refused(1, f"checkpoint metadata must be JSON-able: {e}") from None
    step = meta.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise _Refused(1, f"metadata['step'] must be an int, got {step!r}")
    for name in optimizers or {}:
        if not isinstance(name, str) or not name or name == "model" or "." in name:
            raise _Refused(
                1,
                f"optimizer names must be non-empty strings without '.', other than 'model': "
                f"{name!r}",
            )
    return path, meta


def _check_directory(path: str) -> None:
    if fmt.is_committed(path):
        holder = ""
        with contextlib.suppress(fmt.CheckpointError):
            holder = f" (save {fmt.read_commit(path).save_id})"
        raise _Refused(
            2,
            f"{path} already holds a committed fastinit checkpoint{holder}; save into a new "
            "directory (the checkpoint there is left as it is)",
        )
    if fmt.has_stock_metadata(path):
        raise _Refused(
            3,
            f"{path} holds a stock DCP checkpoint (a global .metadata); fastinit never writes "
            "into it: save into a new directory",
        )
    pending = _SAVER.pending
    if pending is not None and not pending._waited and pending.checkpoint_dir == path:
        raise _Refused(4, f"a save into {path} is already in flight in this process")


def _refusal(records: list[bytes], rank: int, own: _Refused | None, path: str) -> str | None:
    """The one message every rank raises when some rank refused the save, else None."""
    refused = [(r, rec[0]) for r, rec in enumerate(records) if rec[0] != 0]
    if refused:
        if own is not None:
            return f"rank {rank}: {own}; nothing was written"
        r, code = refused[0]
        more = f" (and {len(refused) - 1} more rank(s))" if len(refused) > 1 else ""
        return (
            f"saving {path} refused on rank {r}{more}: {_PROBLEMS.get(code, f'code {code}')}; "
            "nothing was written"
        )
    dirs = [rec[1 : 1 + DIGEST_BYTES] for rec in records]
    other = [r for r, d in enumerate(dirs) if d != dirs[0]]
    if other:
        shown = ", ".join(map(str, other[:8])) + (" ..." if len(other) > 8 else "")
        return (
            f"the ranks were given different checkpoint directories: rank(s) {shown} differ from "
            f"rank 0's (this rank's: {path}); nothing was written"
        )
    return None


def save(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Mapping[str, Any] | None = None,
    *,
    blocking: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Save the (sharded) model and optimizers; the loop waits only for one memory copy.

    Call on every rank, with the same directory. Each rank's shards (and rank 0's replicated
    values and index) are written under ``checkpoint_dir/data-<save id>/`` by this rank's writer
    process; :meth:`SaveHandle.wait` makes them a checkpoint (or not) on every rank alike.

    Args:
        checkpoint_dir: a directory that holds no checkpoint (a committed fastinit checkpoint or a
            stock DCP one there is refused on every rank, and left as it is).
        model: the model, e.g. the ``DistributedModelParallel`` from :func:`fastinit.setup`.
        optimizers: name -> optimizer (``{"optim": dmp.fused_optimizer}``); names are keys of
            the saved state.
        blocking: False (default): return once the state is copied into the staging buffer;
            True: also wait for the verdict (``wait()``) before returning.
        metadata: JSON-able user metadata kept in the index (``"step"``: an int step). Every
            rank checks its own; only rank 0's is stored.

    Returns:
        A :class:`SaveHandle` (already committed when ``blocking``).

    Raises:
        CheckpointError: on every rank alike: some rank's input or directory was refused, the
            ranks named different directories, the previous save failed, a peer did not take
            part (within ``FASTINIT_COLLECTIVE_TIMEOUT``); with ``blocking``, the verdict.
        ValueError: ``FASTINIT_COLLECTIVE_TIMEOUT`` (or a checkpoint knob) is malformed.
    """
    t0 = time.perf_counter()
    group = Group()
    # a bad knob raises here, before a byte is written
    knobs.get_checkpoint_staging(), knobs.get_checkpoint_tier(), knobs.get_checkpoint_write_rate()
    rank = group.rank
    previous = _SAVER.pending
    if previous is not None and not previous._waited:
        previous.wait()  # one save in flight per process (raises its failure on every rank)
    own: _Refused | None = None
    path = os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, (str, os.PathLike)) else ""
    state: dict[str, Any] | None = None
    meta: dict[str, Any] = {}
    try:
        path, meta = _check_input(checkpoint_dir, optimizers, metadata)
        _check_directory(path)
        pending = refuse_pending(model, f"saving {path}")
        if pending is not None:
            raise _Refused(6, pending)
        try:
            state = build_state(model, optimizers)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            raise _Refused(5, f"reading the model's and optimizers' state failed: {e!r}") from e
    except _Refused as e:
        own = e
    nonce = os.urandom(16)
    record = (
        bytes([own.code if own is not None else 0]) + bytes.fromhex(digest(path.encode())) + nonce
    )
    t_agree = time.perf_counter()
    try:
        records = group.all_gather_bytes(record, _RECORD, "save's start message")
    except CollectiveFailed as e:
        raise fmt.CheckpointError(f"saving {path}: {e}; nothing was written") from e
    agree_s = time.perf_counter() - t_agree
    refusal = _refusal(records, rank, own, path)
    if refusal is not None:
        raise fmt.CheckpointError(refusal) from own
    assert state is not None
    save_id = records[0][1 + DIGEST_BYTES : 1 + 2 * DIGEST_BYTES].hex()
    handle = SaveHandle(path, save_id, group)
    handle.agree_s = agree_s
    try:
        _stage_and_submit(handle, model, state, list(optimizers or {}), meta, rank, group)
    except Exception as e:  # noqa: BLE001 - reported by wait(), which every rank takes part in
        handle._local_failure = Written(save_id, ok=False, error=f"staging failed: {e!r}")
    _SAVER.pending = handle
    handle.blocking_s = time.perf_counter() - t0
    if blocking:
        handle.wait()
        handle.blocking_s = time.perf_counter() - t0
    return handle


@dataclasses.dataclass(slots=True)
class _Staged:
    """What a rank writes for a save: its tensors' layout, and everything but their bytes."""

    flat: dict[str, Any]
    sharded: dict[str, Any]
    replicated: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], Any]]
    layout: Layout


def _what(state: dict[str, Any], rank: int) -> _Staged:
    flat = flat_state(state)
    sharded = {k: v for k, v in flat.items() if is_sharded(v)}
    replicated = {k: v for k, v in flat.items() if not is_sharded(v)} if rank == 0 else {}
    tensors = _tensors(sharded) + _tensors(replicated)
    return _Staged(flat, sharded, replicated, tensors, Layout.of(tensors))


def _job_of(
    staged: _Staged,
    model: nn.Module,
    optimizers: list[str],
    meta: dict[str, Any],
    *,
    save_id: str,
    checkpoint_dir: str,
    rank: int,
    world_size: int,
    timeout: float,
    segment_path: str | None,
) -> WriteJob:
    """The writer's job: DCP's plans of this rank's parts (cached per state structure), where
    each tensor lies in the staging buffer, the objects' bytes, and on rank 0 the index."""
    import torch

    slots = {(s.fqn, s.chunk_offsets): s for s in staged.layout.slots}
    plan, metadata = _plan(staged.sharded, _SAVER.plans, _plan_key(staged.sharded))
    layouts = fmt.json_bytes(_layouts(staged.flat, rank))
    rank_part = fmt.RANK_DIR_PATTERN.format(rank=rank)
    parts = [Part(rank_part, plan, metadata, slots, {}, {fmt.LAYOUTS_FILE: layouts})]
    index_bytes = None
    if rank == 0:
        rplan, rmeta = _plan(staged.replicated, _SAVER.plans, _plan_key(staged.replicated))
        parts.append(Part(fmt.REPLICATED_DIR, rplan, rmeta, slots, _objects(staged.replicated)))
        index = _build_index(model, staged.flat, world_size, optimizers, meta, save_id)
        index_bytes = fmt.json_bytes(index.to_json())
    return WriteJob(
        save_id=save_id,
        checkpoint_dir=checkpoint_dir,
        rank=rank,
        world_size=world_size,
        segment_path=segment_path,
        parts=parts,
        index=index_bytes,
        timeout=timeout,
        job=_job(),
        torch_version=str(torch.__version__),
        faults=_faults.installed(),
        rate=knobs.get_checkpoint_write_rate(),
    )


def _stage_and_submit(
    handle: SaveHandle,
    model: nn.Module,
    state: dict[str, Any],
    optimizers: list[str],
    meta: dict[str, Any],
    rank: int,
    group: Group,
) -> None:
    _SAVER.setup(rank)
    pool = _SAVER.pool
    assert pool is not None
    staged = _what(state, rank)
    _SAVER.ensure_writer()
    pool.owner = _SAVER.owner()  # its writer may have been started again since
    t = time.perf_counter()
    touched = _SAVER.tracker() if pool.reuse else None
    ahead = touched.ahead_segment() if touched is not None else None
    segment = pool.acquire(staged.layout, handle.save_id, pool.owner, prefer=ahead)
    writer = _SAVER.ensure_writer()  # the buffer may have fallen back to private memory
    if touched is not None:
        touched.attach(model)
        copied = touched.copy_in(segment, staged.layout, [x for _, _, x in staged.tensors])
        # The buffer the next save takes, if it holds nothing yet (a job's first save), gets
        # this copy on a thread: the next save copies only the rows touched from here on.
        fill = touched.fork_fill(segment)
        if fill is not None:
            done = functools.partial(touched.adopt_fill, fill)
            if not pool.mirror(segment, staged.layout.size, done):
                touched.forget(fill)
    else:
        copy_in(segment, staged.layout, [x for _, _, x in staged.tensors])
        copied = staged.layout.data_bytes
    handle.stage_s = time.perf_counter() - t
    handle.staged_bytes = staged.layout.data_bytes
    handle.copied_bytes = copied
    if touched is not None:
        handle.ahead_bytes = touched.ahead_bytes - _SAVER.ahead_seen
        _SAVER.ahead_seen = touched.ahead_bytes
    job = _job_of(
        staged,
        model,
        optimizers,
        meta,
        save_id=handle.save_id,
        checkpoint_dir=handle.checkpoint_dir,
        rank=rank,
        world_size=group.world_size,
        timeout=group.timeout,
        segment_path=segment.path,
    )
    if pool.warning and not _SAVER.warned:
        _SAVER.warned = True
        warnings.warn(f"fastinit.checkpoint: {pool.warning}", stacklevel=4)
    _faults.point("checkpoint.handoff", rank=rank)  # a trainer dying before save returned
    writer.submit(job, segment)


def write_rank_files(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Mapping[str, Any] | None = None,
    *,
    save_id: str,
    rank: int,
    world_size: int,
    metadata: Mapping[str, Any] | None = None,
) -> Written:
    """Write rank ``rank``'s part of save ``save_id`` here and now: no collective, no writer
    process, no commit. For tools that build a checkpoint of N ranks one rank at a time (the
    scale benchmark on the fake backend); :func:`fastinit.checkpoint.commit.commit` then makes
    it visible. A training job calls :func:`save`."""
    from fastinit.checkpoint.staging import Segment
    from fastinit.checkpoint.writer import write_job

    try:
        path, meta = _check_input(checkpoint_dir, optimizers, metadata)
    except _Refused as e:
        raise fmt.CheckpointError(str(e)) from None
    staged = _what(build_state(model, optimizers), rank)
    segment = Segment.private(staged.layout.size)
    try:
        copy_in(segment, staged.layout, [x for _, _, x in staged.tensors])
        job = _job_of(
            staged,
            model,
            list(optimizers or {}),
            meta,
            save_id=save_id,
            checkpoint_dir=path,
            rank=rank,
            world_size=world_size,
            timeout=knobs.get_collective_timeout(),
            segment_path=None,
        )
        return write_job(job, segment)
    finally:
        segment.close()


def prepare(
    model: nn.Module, optimizers: Mapping[str, Any] | None = None, *, background: bool = True
) -> threading.Thread | None:
    """Allocate this rank's staging buffers and start its writer, ahead of the first save.

    Sizes the buffers from the state as it is now (this rank's shards; on rank 0 also the
    replicated values), so the first save copies into memory that is already there. Optimizer
    state created later (a dense optimizer's, at its first step) grows the buffer at the save
    that first holds it. No collective; call it on every rank, e.g. as a start-up stage.

    Where rows are tracked (fused CPU tables, :mod:`fastinit.checkpoint.touched`), the buffers
    are also filled with the state as it is now, on the same thread, so even the first save
    copies only the rows trained since: one more copy of the state per buffer, off the loop.
    Call it where no backward is in flight (at start-up, or between steps).

    Args:
        model: the model.
        optimizers: name -> optimizer, as for :func:`save`.
        background: allocate on a thread (returned; join it or not); False: before returning.

    Returns:
        The allocating thread, or None with ``background=False``.
    """
    group = Group()
    rank = group.rank
    staged = _what(build_state(model, optimizers), rank)
    tensors = [t for _, _, t in staged.tensors]
    cuda = any(t.device.type == "cuda" for t in tensors)

    touched = _SAVER.tracker()
    fills: list[Any] = []
    if touched is not None:
        touched.attach(model)  # on the caller's thread: the hooks are on before its next step
        # What each buffer's prefill will hold, fixed here: rows touched from now on are
        # recorded, and the first save into it copies only those.
        # at most three buffers: the one a save takes, the tier's and the spare one
        for _ in range(3 if _copies_ahead() else 2):
            fill = touched.begin(staged.layout, tensors)
            if fill is not None:
                fills.append(fill)

    def run() -> None:
        if background:
            lower_priority()  # its own thread, ended with this function
        _SAVER.setup(rank)
        pool = _SAVER.pool
        assert pool is not None
        pool.reserve(staged.layout.size, pin=cuda)
        if fills:
            assert touched is not None
            # a predecessor's buffers only once this process has loaded (before, one may
            # hold the save its load reads from memory)
            loaded = tier.last_loaded() is not None
            pool.prefill(
                staged.layout, tensors, fills, touched.adopt_fill, touched.forget, adopted=loaded
            )

    if not background:
        run()
        return None
    t = threading.Thread(target=run, name="fastinit-checkpoint-staging", daemon=True)
    t.start()
    return t


def staging_info() -> dict[str, Any]:
    """What this process holds for checkpoints: the writer kind and every staging buffer."""
    pool = _SAVER.pool
    return {
        "writer": _SAVER.mode,
        "buffers": [] if pool is None else pool.buffers(),
        "allocated_s": 0.0 if pool is None else pool.allocated_s,
        "allocated_bytes": 0 if pool is None else pool.allocated_bytes,
        "pinned_bytes": 0 if pool is None else pool.pinned_bytes(),
    }
