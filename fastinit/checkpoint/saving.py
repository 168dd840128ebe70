"""``save``: every rank writes its own shards with DCP's storage layer; one collective commits.

Each rank, without any collective:

1. flattens ``{"model": model.state_dict(), <name>: optimizer.state_dict()}`` with DCP's rules
   and splits it into its sharded values (ShardedTensor / sharded DTensor) and the replicated
   rest;
2. with ``blocking=False``, stages them into CPU memory (pinned on CUDA; DCP's
   ``DefaultStager``) — the only part the caller waits for — and writes on a background thread;
3. writes ``rank_<r>/`` with ``torch.distributed.checkpoint.save(..., no_dist=True)`` through
   a ``FileSystemWriter``: a DCP checkpoint of its own shards (``__0_0.distcp`` +
   ``.metadata``), plus ``layouts.json`` (the global layout of each sharded value whose shard 0
   it holds); rank 0 also writes ``replicated/`` (the replicated values, once) and the index.

:meth:`SaveHandle.wait` then joins the writer and sends the one collective of a save: an
``all_reduce(MIN)`` of "my files are durable". If every rank succeeded, rank 0 writes the commit
marker (atomically, last); otherwise every rank raises :class:`CheckpointError` and no marker is
written, so the directory is never taken for a checkpoint, and nothing outside it was touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit.checkpoint import _dcp
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint.state import (
    build_state,
    entry_of,
    flat_state,
    global_runs,
    is_sharded,
    shard0_rank,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = ["save", "SaveHandle", "WRITER"]


def _writer(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, sync_files=True)


#: Builds the ``StorageWriter`` of one directory (a DCP ``FileSystemWriter``). Tests replace it
#: with a wrapper that fails (a full disk) to check that a failed save commits nothing.
WRITER = _writer


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _nbytes(values: Mapping[str, Any]) -> int:
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    total = 0
    for v in values.values():
        if isinstance(v, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
        elif isinstance(v, DTensor):
            t = v.to_local()
            total += t.numel() * t.element_size()
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _stage(values: Mapping[str, Any]) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """Copy every tensor of ``values`` into CPU memory (pinned when CUDA is there).

    Returns ``(fqn, chunk offsets) -> copy`` (offsets None for a non-tensor value, deep-copied):
    what :class:`_StagedPlanner` hands DCP's writer instead of the live tensors. The live
    ShardedTensors still describe the layout (their metadata does not change in training).
    """
    import copy

    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    pin = torch.cuda.is_available()
    cuda_copies = False

    def cpu(t: torch.Tensor) -> torch.Tensor:
        nonlocal cuda_copies
        t = t.detach()
        if t.device.type == "cpu" and not pin:
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.device.type != "cpu")
        cuda_copies = cuda_copies or t.device.type == "cuda"
        out.copy_(t, non_blocking=t.device.type == "cuda")
        return out

    staged: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for fqn, v in values.items():
        if isinstance(v, ShardedTensor):
            for shard in v.local_shards():
                staged[(fqn, tuple(shard.metadata.shard_offsets))] = cpu(shard.tensor)
        elif isinstance(v, DTensor):
            (chunk,) = _dcp.chunks_of(v)
            staged[(fqn, tuple(chunk.offsets))] = cpu(v.to_local())
        elif isinstance(v, torch.Tensor):
            staged[(fqn, (0,) * v.dim())] = cpu(v)
        else:
            staged[(fqn, None)] = copy.deepcopy(v)
    if cuda_copies:
        torch.cuda.synchronize()
    return staged


def _planner(staged: Mapping[tuple[str, tuple[int, ...] | None], Any] | None) -> Any:
    """DCP's default save planner, resolving data from the staged copies when there are some."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    if staged is None:
        return DefaultSavePlanner()
    copies = staged

    class _StagedPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            offset = None if index.offset is None else tuple(index.offset)
            key = (index.fqn, offset)
            if key in copies:
                return copies[key]
            return super().lookup_object(index)

    return _StagedPlanner()


def _build_index(
    model: nn.Module,
    flat: Mapping[str, Any],
    world_size: int,
    optimizers: list[str],
    metadata: dict[str, Any],
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


@dataclasses.dataclass(slots=True)
class _Work:
    checkpoint_dir: str
    rank: int
    world_size: int
    sharded: dict[str, Any]
    replicated: dict[str, Any] | None
    layouts: dict[str, list[Any]]
    index: fmt.Index | None
    staged: dict[Any, Any] | None = None


def _write(work: _Work) -> str | None:
    """Write this rank's files; returns the index digest on rank 0."""
    import torch.distributed.checkpoint as dcp

    d = work.checkpoint_dir
    os.makedirs(d, exist_ok=True)
    rdir = fmt.rank_dir(d, work.rank)
    os.makedirs(rdir, exist_ok=True)
    dcp.save(work.sharded, storage_writer=WRITER(rdir), planner=_planner(work.staged), no_dist=True)
    fmt.write_json_atomic(os.path.join(rdir, fmt.LAYOUTS_FILE), work.layouts)
    if work.replicated is None or work.index is None:
        return None
    rep = os.path.join(d, fmt.REPLICATED_DIR)
    os.makedirs(rep, exist_ok=True)
    dcp.save(
        work.replicated, storage_writer=WRITER(rep), planner=_planner(work.staged), no_dist=True
    )
    return fmt.write_index(d, work.index)


class SaveHandle:
    """A save in progress; :meth:`wait` on every rank commits it.

    Attributes:
        checkpoint_dir: the directory being written.
        blocking_s: seconds :func:`save` held the caller (staging copy, or the whole save
            with ``blocking=True``).
        staged_bytes: bytes of this rank's tensors written (its shards, and the replicated
            values on rank 0).
    """

    def __init__(self, work: _Work | None, error: BaseException | None, blocking: bool) -> None:
        self.checkpoint_dir = work.checkpoint_dir if work is not None else ""
        self.blocking_s = 0.0
        self.staged_bytes = 0
        self.committed = False
        self._work = work
        self._error = error
        self._digest: str | None = None
        self._waited = False
        self._thread: threading.Thread | None = None
        if work is not None and error is None and not blocking:
            self._thread = threading.Thread(
                target=self._run, name="fastinit-checkpoint-writer", daemon=True
            )
            self._thread.start()
        elif work is not None and error is None:
            self._run()

    def _run(self) -> None:
        assert self._work is not None
        try:
            self._digest = _write(self._work)
        except BaseException as e:  # noqa: BLE001 - reported by wait() on every rank
            self._error = e
        finally:
            # Drop the staged copies as soon as they are on disk.
            self._work.staged = None

    def done(self) -> bool:
        """True when this rank's files are written (the commit still needs :meth:`wait`)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Finish this rank's writes, then commit (one ``all_reduce``; call on every rank).

        Returns when the checkpoint is committed: on rank 0 the commit marker is durable; on
        the other ranks every rank's files are durable and rank 0 is writing the marker.

        Raises:
            CheckpointError: a rank failed to write (every rank raises; nothing is committed).
        """
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        self._waited = True
        if self._thread is not None:
            self._thread.join()
        ok = self._error is None
        try:
            all_ok = _agree(ok)
        except Exception as e:  # noqa: BLE001 - a peer died or the group timed out
            self._error = fmt.CheckpointError(
                f"committing {self.checkpoint_dir}: the commit collective failed ({e}); "
                "a rank died or did not call wait(); nothing was committed"
            )
            raise self._error from e
        work = self._work
        if not all_ok:
            if ok:
                self._error = fmt.CheckpointError(
                    f"saving {self.checkpoint_dir} failed on another rank; nothing was committed"
                )
            else:
                err = self._error
                self._error = fmt.CheckpointError(
                    f"saving {self.checkpoint_dir} failed on rank "
                    f"{work.rank if work else '?'}: {type(err).__name__}: {err}; "
                    "nothing was committed"
                )
                self._error.__cause__ = err
            raise self._error
        if work is not None and work.rank == 0:
            assert self._digest is not None
            try:
                fmt.commit(work.checkpoint_dir, self._digest, work.world_size)
            except BaseException as e:
                self._error = fmt.CheckpointError(
                    f"writing the commit marker of {self.checkpoint_dir} failed: {e}"
                )
                raise self._error from e
        self.committed = True


def _agree(ok: bool) -> bool:
    """All ranks succeeded? The save's one collective (none without a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save(
    checkpoint_dir: str,
    model: nn.Module,
    optimizers: Mapping[str, Any] | None = None,
    *,
    blocking: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Save the (sharded) model and optimizers; each rank writes its own shards.

    Call on every rank. Nothing is planned centrally and no object is exchanged: each rank
    writes ``rank_<r>/`` with DCP's ``FileSystemWriter``, rank 0 the replicated values and the
    index; :meth:`SaveHandle.wait` commits with one small ``all_reduce``.

    Args:
        checkpoint_dir: a new directory (shared by the ranks). One that already holds a
            committed checkpoint is refused (every rank raises from ``wait``).
        model: the model, e.g. the ``DistributedModelParallel`` from :func:`fastinit.setup`.
        optimizers: name -> optimizer (``{"optim": dmp.fused_optimizer}``); names are keys of
            the saved state, as for :func:`fastinit.warmup.save_checkpoint`.
        blocking: False (default): return once the state is staged into CPU memory (pinned on
            CUDA) and write in the background; call :meth:`SaveHandle.wait` on every rank
            before the next save (it commits). True: write and commit before returning.
        metadata: JSON-able user metadata kept in the index (``"step"``: an int step).

    Returns:
        A :class:`SaveHandle` (already committed when ``blocking``).

    Raises:
        ValueError: bad arguments (an optimizer named ``model``, non-JSON metadata).
        CheckpointError: with ``blocking=True``, a rank failed to write (on every rank).
    """
    t0 = time.perf_counter()
    rank, world_size = _rank_world()
    meta = dict(metadata or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint metadata must be JSON-able: {e}") from None
    state = build_state(model, optimizers)
    work: _Work | None = None
    error: BaseException | None = None
    try:
        if fmt.is_committed(checkpoint_dir):
            raise fmt.CheckpointError(
                f"{checkpoint_dir} already holds a committed checkpoint; save into a new "
                "directory (the old one is left as it is)"
            )
        flat = flat_state(state)
        sharded = {k: v for k, v in flat.items() if is_sharded(v)}
        replicated = {k: v for k, v in flat.items() if not is_sharded(v)} if rank == 0 else None
        index = (
            _build_index(model, flat, world_size, list(optimizers or {}), meta)
            if rank == 0
            else None
        )
        work = _Work(
            checkpoint_dir=os.fspath(checkpoint_dir),
            rank=rank,
            world_size=world_size,
            sharded=sharded,
            replicated=replicated,
            layouts=_layouts(flat, rank),
            index=index,
        )
        staged_bytes = _nbytes(sharded) + (_nbytes(replicated) if replicated else 0)
        if not blocking:
            work.staged = _stage({**sharded, **(replicated or {})})
    except BaseException as e:  # noqa: BLE001 - reported on every rank by wait()
        error = e
        staged_bytes = 0
    if work is None:
        work = _Work(os.fspath(checkpoint_dir), rank, world_size, {}, None, {}, None)
    handle = SaveHandle(work, error, blocking)
    handle.staged_bytes = staged_bytes
    if blocking:
        handle.wait()
    handle.blocking_s = time.perf_counter() - t0
    return handle
