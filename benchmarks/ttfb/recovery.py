"""Checkpoints in the benchmark's trainer, the way each mode (or checkpointer) saves and resumes.

* ``stock``: ``torch.distributed.checkpoint.save`` (blocking) and ``dcp.load``.
* ``stock-best``: ``dcp.async_save`` on a gloo process group of its own (DCP's advice: the
  background save's collectives must not interleave with training's) with the best stager DCP
  has for TorchRec's state here (:func:`benchmarks.checkpoint_blocking.anchors.dcp_stager`: its
  cached blocking stager, buffers allocated by the first save and reused; DCP's default stager
  cannot copy ShardedTensors), so the loop blocks only for the staging copy; ``dcp.load`` with
  DCP's load planning. Rank 0 marks the checkpoint ``latest`` as soon as its future completes
  (after every rank's data and the metadata are written).
* ``fastinit``: :class:`fastinit.checkpoint.CheckpointManager` (``save``: the loop blocks for
  the staging copy; the writer process writes and commits) and :func:`fastinit.checkpoint.load`
  (each rank reads its own shards, from the host-memory tier when the save's staging buffer is
  still on this host), as a start-up stage before the warm-up.
* ``torch-checkpointing`` (a checkpointer, beside stock-best's start-up): torch_checkpointing
  0.1.1's ``CheckpointManager`` (:func:`benchmarks.checkpoint_blocking.anchors.
  torch_checkpointing_manager`: a writer process, shared-memory staging on a thread, a TCPStore
  barrier and a directory rename as the commit) on each rank's local shards as plain tensors (it
  cannot take ShardedTensors); the loop's next step waits for its staging (its ``lock``); loaded
  in place into the same views (same plan only).

A stock checkpoint ``step-<K>/`` counts once rank 0 has seen it committed and written ``latest``
(atomically); a fastinit one once its commit marker is there (the manager's ``latest``); a
torch_checkpointing one once its directory is renamed into place. A job killed mid-save resumes
from the previous one. Each rank appends a record per save (blocking, staging, wait and commit
seconds, bytes) to ``saves-a<attempt>-rank<N>.jsonl`` in the trace directory, and keeps the last
one in ``save-rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

__all__ = ["LATEST", "CHECKPOINTERS", "latest", "Saver", "load", "checkpoint_bytes"]

LATEST = "latest"

#: Checkpointers a trainer can be given besides its mode's own ("mode").
CHECKPOINTERS: tuple[str, ...] = ("mode", "torch-checkpointing")

_STEP_DIR = re.compile(r"^step-(\d+)$")


def latest(
    checkpoint_dir: str | None, mode: str = "stock", checkpointer: str = "mode"
) -> tuple[str, int] | None:
    """``(path, step)`` of the last committed checkpoint in ``checkpoint_dir``, or None."""
    if not checkpoint_dir:
        return None
    if checkpointer == "torch-checkpointing":
        try:
            names = os.listdir(checkpoint_dir)
        except FileNotFoundError:
            return None
        steps = [int(m.group(1)) for m in map(_STEP_DIR.match, names) if m]
        if not steps:
            return None
        return os.path.join(checkpoint_dir, f"step-{max(steps)}"), max(steps)
    if mode == "fastinit":
        from fastinit.checkpoint import CheckpointManager

        found = CheckpointManager(checkpoint_dir).latest()
        return None if found is None else (found[1], found[0])
    try:
        with open(os.path.join(checkpoint_dir, LATEST)) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    return os.path.join(checkpoint_dir, str(rec["path"])), int(rec["step"])


def _mark_latest(checkpoint_dir: str, step: int) -> None:
    path = os.path.join(checkpoint_dir, LATEST)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"path": f"step-{step}", "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def _local(state: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.checkpoint_blocking.anchors import local_tensors

    return {"state": local_tensors(state)}


class Saver:
    """Saves the job's checkpoints in the mode's (or checkpointer's) way; :meth:`wait` commits."""

    def __init__(
        self, mode: str, checkpoint_dir: str, rank: int, out: str, checkpointer: str = "mode"
    ) -> None:
        self.mode = mode
        self.kind = "torch-checkpointing" if checkpointer == "torch-checkpointing" else mode
        self.checkpoint_dir = checkpoint_dir
        self.rank = rank
        self.out = out
        self._pending: Any = None
        self._record: dict[str, Any] = {}
        self._pg: Any = None
        self._manager: Any = None
        self._stager: Any = None
        self._tc: Any = None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._log_path = os.path.join(out, f"saves-a{attempt}-rank{rank}.jsonl")
        if self.kind == "fastinit":
            from fastinit.checkpoint import CheckpointManager

            self._manager = CheckpointManager(checkpoint_dir, keep=2)

    def _torch_checkpointing(self) -> Any:
        """Its manager, made at the first save: rank 0 picks its barrier's port (served by
        rank 0's writer process) and the ranks agree on it with one broadcast."""
        if self._tc is None:
            import torch.distributed as dist

            from benchmarks.checkpoint_blocking.anchors import torch_checkpointing_manager
            from fastinit.testing.dist import free_port

            port = [free_port() if self.rank == 0 else 0]
            dist.broadcast_object_list(port, src=0)
            address = os.environ.get("MASTER_ADDR", "127.0.0.1")
            self._tc = torch_checkpointing_manager(barrier=(address, int(port[0])))
        return self._tc

    def prepare(self, model: Any, optimizer: Any) -> None:
        """Before the first save (torch_checkpointing): its manager and writer process, and its
        staging buffers prewarmed (``prewarm_staging``, on its staging thread: the first save
        waits for it if it is not done). fastinit prepares in a start-up stage; DCP has no
        such call (its cached stager allocates at the first save)."""
        if self.kind != "torch-checkpointing":
            return
        t0 = time.perf_counter()
        self._torch_checkpointing().prewarm_staging(_local(_state(model, optimizer)))
        self._log({"prepare_s": time.perf_counter() - t0, "step": -1}, "prepared")

    def save(self, step: int, model: Any, optimizer: Any) -> float:
        """Start the checkpoint of ``step``; returns the seconds the loop was blocked."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        t_wait = time.perf_counter()
        self.wait()
        wait_s = time.perf_counter() - t_wait
        path = os.path.join(self.checkpoint_dir, f"step-{step}")
        t0 = time.perf_counter()
        how = self.kind
        extra: dict[str, Any] = {}
        if self.kind == "stock":
            dcp.save(_state(model, optimizer), checkpoint_id=path)
        elif self.kind == "stock-best":
            from benchmarks.checkpoint_blocking.anchors import dcp_stager

            if self._pg is None:
                self._pg = dist.new_group(backend="gloo")
                device = next(iter(model.parameters())).device
                self._stager, how_staged = dcp_stager(device.type)
                self._record_how = f"dcp.async_save, {how_staged}"
            future = dcp.async_save(
                _state(model, optimizer),
                checkpoint_id=path,
                process_group=self._pg,
                async_stager=self._stager,
            )
            if self.rank == 0:  # committed once rank 0's future is done: every rank wrote

                def mark(f: Any, step: int = step) -> None:
                    if f.exception() is None:
                        _mark_latest(self.checkpoint_dir, step)

                future.add_done_callback(mark)
            self._pending = future
            how = self._record_how
        elif self.kind == "torch-checkpointing":
            manager = self._torch_checkpointing()
            self._pending = manager.save(path, _local(_state(model, optimizer)))
            extra["save_call_s"] = time.perf_counter() - t0
            with manager.lock():  # the next step's in-place update waits for the staging copy
                pass
            how = "torch_checkpointing.CheckpointManager (local shards as plain tensors)"
        else:
            self._pending = self._manager.save(step, model, {"optim": optimizer})
            how = "fastinit.checkpoint.CheckpointManager.save"
            # known as save returns: a killed attempt's last save has them too
            extra.update(agree_s=self._pending.agree_s, stage_s=self._pending.stage_s)
        blocking = time.perf_counter() - t0
        self._record = {
            "step": step,
            "path": path,
            "how": how,
            "blocking_s": blocking,
            "wait_before_s": wait_s,
            "t0": t0,
            "time": time.time(),
            **extra,
        }
        # Logged now: a killed attempt's saves count too (their commit comes from the writers).
        self._log({k: v for k, v in self._record.items() if k != "t0"}, "saved")
        if self._pending is None:
            self._commit()
        return blocking

    def in_flight(self) -> bool:
        """Whether this rank's part of the last save is still being written."""
        pending = self._pending
        if pending is None:
            return False
        if self.kind == "fastinit":
            return not pending.done()
        return not pending.done()  # a concurrent.futures.Future

    def wait(self) -> None:
        """Wait for the save in flight (if any) and commit it."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        if self._manager is not None:
            self._manager.wait()
            self._record["staged_bytes"] = pending.staged_bytes
            self._record["copied_bytes"] = pending.copied_bytes
            self._record["ahead_bytes"] = pending.ahead_bytes
            self._record["stage_s"] = pending.stage_s
            written = pending.written
            if written is not None:
                self._record.update(
                    writer_s=written.seconds,
                    writer_cpu_s=written.cpu_s,
                    writer_paced_s=written.paced_s,
                    digest_s=written.digest_s,
                    written_bytes=written.bytes,
                )
        elif hasattr(pending, "wait"):
            pending.wait()
        else:  # a concurrent.futures.Future (dcp.async_save, torch_checkpointing)
            pending.result()
        self._record["wait_s"] = time.perf_counter() - t0
        self._commit()

    def close(self) -> None:
        """The job ended cleanly: wait for the save in flight, stop a checkpointer's background
        process, release fastinit's staging buffers (the trainer leaves with ``os._exit``)."""
        self.wait()
        if self._manager is not None:
            self._manager.close()
        if self._tc is not None:
            self._tc.close()
            self._tc = None

    def _commit(self) -> None:
        rec = self._record
        rec["commit_s"] = time.perf_counter() - rec.pop("t0")
        if self.rank == 0:
            if self.kind == "stock":
                _mark_latest(self.checkpoint_dir, int(rec["step"]))
            rec["bytes"] = checkpoint_bytes(str(rec["path"]))
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"save-rank{self.rank}.json"), "w") as f:
            json.dump({**rec, "rank": self.rank}, f)
        self._log(rec, "committed")

    def _log(self, rec: dict[str, Any], event: str) -> None:
        os.makedirs(self.out, exist_ok=True)
        with open(self._log_path, "a") as f:
            f.write(json.dumps({**rec, "event": event, "rank": self.rank}) + "\n")


def load(
    mode: str, path: str, model: Any, optimizer: Any, checkpointer: str = "mode"
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` in place, the mode's way; returns how, and the bytes read
    from storage and from the host-memory tier."""
    t0 = time.perf_counter()
    if checkpointer == "torch-checkpointing":
        from benchmarks.checkpoint_blocking.anchors import torch_checkpointing_loader

        state = _state(model, optimizer)
        manager = torch_checkpointing_loader()
        try:
            manager.load(path, into=_local(state))
        finally:
            manager.close()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        own = os.path.join(path, f"state_{int(os.environ.get('RANK', '0'))}.pt")
        return {
            "how": "torch_checkpointing.CheckpointManager.load (same plan, in place)",
            "storage_bytes": os.path.getsize(own) if os.path.exists(own) else 0,
            "memory_bytes": 0,
            "seconds": time.perf_counter() - t0,
        }
    if mode == "fastinit":
        from fastinit import checkpoint

        report = checkpoint.load(path, model, {"optim": optimizer})
        return {
            "how": f"fastinit.checkpoint.load ({report.mode}, {report.tier})",
            "storage_bytes": report.bytes_read,
            "memory_bytes": report.memory_bytes,
            "seconds": report.seconds,
            "verify_s": report.verify_s,
        }
    import torch.distributed.checkpoint as dcp

    from benchmarks.resume_scale.main import _rchar

    state = _state(model, optimizer)
    before = _rchar()
    dcp.load(state, checkpoint_id=path)
    read = _rchar() - before
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return {
        "how": "dcp.load",
        # what this process read from files while loading (its stages run one at a time)
        "storage_bytes": read if read >= 0 else checkpoint_bytes(path),
        "memory_bytes": 0,
        "seconds": time.perf_counter() - t0,
    }
