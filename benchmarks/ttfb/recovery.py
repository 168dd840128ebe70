"""Checkpoints in the benchmark's trainer, the way each mode saves and resumes.

* ``stock``: ``torch.distributed.checkpoint.save`` (blocking) and ``dcp.load``.
* ``stock-best``: ``dcp.async_save`` on a gloo process group of its own (DCP's advice: the
  background save's collectives must not interleave with training's) with DCP's
  ``BlockingAsyncStager`` (its default stager cannot copy ShardedTensors), so the loop blocks
  only for the staging copy; ``dcp.load`` with DCP's load planning.
* ``fastinit``: :class:`fastinit.checkpoint.CheckpointManager` (``save``: the loop blocks for
  the staging copy; the writer process writes and commits) and :func:`fastinit.checkpoint.load`
  (each rank reads its own shards, from the host-memory tier when the save's staging buffer is
  still on this host), as a start-up stage before the warm-up.

A stock checkpoint ``step-<K>/`` counts once rank 0 has seen it committed and written ``latest``
(atomically); a fastinit one once its commit marker is there (the manager's ``latest``). A job
killed mid-save resumes from the previous one. Each rank writes ``save-rank<N>.json`` (blocking
and commit seconds, bytes) to the trace directory.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["LATEST", "latest", "Saver", "load", "checkpoint_bytes"]

LATEST = "latest"


def latest(checkpoint_dir: str | None, mode: str = "stock") -> tuple[str, int] | None:
    """``(path, step)`` of the last committed checkpoint in ``checkpoint_dir``, or None."""
    if not checkpoint_dir:
        return None
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


class Saver:
    """Saves the job's checkpoints in the mode's way; :meth:`wait` commits."""

    def __init__(self, mode: str, checkpoint_dir: str, rank: int, out: str) -> None:
        self.mode = mode
        self.checkpoint_dir = checkpoint_dir
        self.rank = rank
        self.out = out
        self._pending: Any = None
        self._record: dict[str, Any] = {}
        self._pg: Any = None
        self._manager: Any = None
        if mode == "fastinit":
            from fastinit.checkpoint import CheckpointManager

            self._manager = CheckpointManager(checkpoint_dir, keep=2)

    def save(self, step: int, model: Any, optimizer: Any) -> float:
        """Start the checkpoint of ``step``; returns the seconds the loop was blocked."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = os.path.join(self.checkpoint_dir, f"step-{step}")
        t0 = time.perf_counter()
        how = self.mode
        if self.mode == "stock":
            dcp.save(_state(model, optimizer), checkpoint_id=path)
        elif self.mode == "stock-best":
            if self._pg is None:
                self._pg = dist.new_group(backend="gloo")
            # DCP's default stager cannot copy TorchRec's ShardedTensors (torch 2.13: "torch
            # function 'data_ptr' ... not supported for ShardedTensor"); its blocking stager can.
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            self._pending = dcp.async_save(
                _state(model, optimizer),
                checkpoint_id=path,
                process_group=self._pg,
                async_stager=BlockingAsyncStager(),
            )
        else:
            self._pending = self._manager.save(step, model, {"optim": optimizer})
            how = "fastinit.checkpoint.CheckpointManager.save"
        blocking = time.perf_counter() - t0
        self._record = {"step": step, "path": path, "how": how, "blocking_s": blocking, "t0": t0}
        if self._pending is None:
            self._commit()
        return blocking

    def wait(self) -> None:
        """Wait for the save in flight (if any) and commit it."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        if self._manager is not None:
            self._manager.wait()
            self._record["staged_bytes"] = pending.staged_bytes
            self._record["stage_s"] = pending.stage_s
        elif hasattr(pending, "wait"):
            pending.wait()
        else:  # a concurrent.futures.Future (dcp.async_save)
            pending.result()
        self._commit()

    def _commit(self) -> None:
        rec = self._record
        rec["commit_s"] = time.perf_counter() - rec.pop("t0")
        if self.rank == 0:
            if self._manager is None:
                _mark_latest(self.checkpoint_dir, int(rec["step"]))
            rec["bytes"] = checkpoint_bytes(str(rec["path"]))
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"save-rank{self.rank}.json"), "w") as f:
            json.dump({**rec, "rank": self.rank}, f)


def load(mode: str, path: str, model: Any, optimizer: Any) -> dict[str, Any]:
    """Load the checkpoint at ``path`` in place, the mode's way; returns how, and (fastinit)
    the bytes read from storage and from the host-memory tier."""
    if mode == "fastinit":
        from fastinit import checkpoint

        report = checkpoint.load(path, model, {"optim": optimizer})
        return {
            "how": f"fastinit.checkpoint.load ({report.mode}, {report.tier})",
            "storage_bytes": report.bytes_read,
            "memory_bytes": report.memory_bytes,
            "seconds": report.seconds,
        }
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return {"how": "dcp.load", "storage_bytes": checkpoint_bytes(path), "memory_bytes": 0}
