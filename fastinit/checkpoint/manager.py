"""``CheckpointManager``: the step directories, the latest checkpoint, retention.

Every training job writes one: save every N steps into ``root/step-<N>``, find the newest
committed checkpoint at start, keep the last few. This one keeps the checkpoint's promises:

* :meth:`~CheckpointManager.latest` is the newest *committed* step (a marker that parses and
  names its save); a torn or in-flight save is never "latest". A restarted worker first waits
  (bounded) for its dead predecessors' writer processes on this host to finish the save they
  hold (:func:`fastinit.checkpoint.tier.await_predecessor_writers`), so it resumes from the save
  its predecessor's loop paid for, not the one before.
* Retention runs on rank 0 only after a newer checkpoint has committed, deletes committed
  checkpoints beyond ``keep`` (oldest first) and the leftovers of saves that never committed and
  are older than every kept one; it never deletes the newest committed checkpoint.
* :meth:`~CheckpointManager.save` of a step whose directory already holds a committed
  checkpoint (a restarted job reaching a step its previous attempt already saved) keeps that
  checkpoint and returns None, with a warning, on every rank alike.
* :meth:`~CheckpointManager.load_latest` falls back to the previous committed checkpoint when
  the newest fails to load (every rank agrees on each attempt), with a warning.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit import knobs
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint import tier
from fastinit.checkpoint._comm import CollectiveFailed, Group
from fastinit.checkpoint.loading import load
from fastinit.checkpoint.saving import close, save

if TYPE_CHECKING:
    from torch import nn

    from fastinit.checkpoint.loading import LoadReport
    from fastinit.checkpoint.saving import SaveHandle

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Checkpoints of one job under ``root``: ``root/<prefix><step>``.

    Args:
        root: the directory holding the job's checkpoints (shared by the ranks).
        keep: how many committed checkpoints to keep (the newest; at least 1).
        prefix: the step directories' name prefix.

    Example::

        manager = CheckpointManager("/ckpt/job", keep=2)
        start = manager.load_latest(model, {"optim": model.fused_optimizer})  # None: fresh
        for step in range(first, steps + 1):
            train_step()
            if step % 100 == 0:
                manager.save(step, model, {"optim": model.fused_optimizer})
        manager.close()
    """

    def __init__(
        self, root: str | os.PathLike[str], *, keep: int = 2, prefix: str = "step-"
    ) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if not prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a non-empty name, got {prefix!r}")
        self.root = os.fspath(root)
        self.keep = keep
        self.prefix = prefix
        self._pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
        self._pending: SaveHandle | None = None
        #: The step :meth:`load_latest` loaded (None before, or if nothing was loaded).
        self.loaded_step: int | None = None

    def path(self, step: int) -> str:
        """The directory of step ``step``'s checkpoint."""
        return os.path.join(self.root, f"{self.prefix}{int(step)}")

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            m = self._pattern.match(name)
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def committed(self) -> list[int]:
        """The steps whose checkpoints are committed, oldest first."""
        out = []
        for step in self._steps():
            with contextlib.suppress(fmt.CheckpointError):
                fmt.read_commit(self.path(step))
                out.append(step)
        return out

    def latest(self) -> tuple[int, str] | None:
        """``(step, directory)`` of the newest committed checkpoint, or None (after the dead
        predecessors' writers on this host finished: :meth:`await_predecessors`)."""
        self.await_predecessors()
        steps = self.committed()
        return (steps[-1], self.path(steps[-1])) if steps else None

    def await_predecessors(self) -> float:
        """Wait for the writer processes a dead predecessor of this worker left on this host
        (the same launcher: a torchrun restart) to finish their save, at most half of
        ``FASTINIT_COLLECTIVE_TIMEOUT`` (a warning if they did not); the seconds waited."""
        # half the collective bound: a rank that waits in full still meets the others, who
        # wait for it in load_latest's all_reduce within the whole bound
        running, waited = tier.await_predecessor_writers(knobs.get_collective_timeout() / 2)
        if running:
            warnings.warn(
                f"fastinit.checkpoint: the writer processes {running} of a previous attempt "
                f"are still running after {waited:.0f} s; the save they hold is not waited for",
                stacklevel=3,
            )
        return waited

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizers: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = False,
    ) -> SaveHandle | None:
        """Save step ``step`` (on every rank); the previous save is finished first.

        Returns:
            The save's handle, or None when ``step`` already has a committed checkpoint (kept
            as it is).
        """
        self.wait()
        path = self.path(step)
        if fmt.is_committed(path):
            warnings.warn(
                f"fastinit.checkpoint: {path} already holds a committed checkpoint (an earlier "
                "attempt of this job saved this step); it is kept and this save is skipped",
                stacklevel=2,
            )
            return None
        meta = {**dict(metadata or {}), "step": int(step)}
        handle = save(path, model, optimizers, metadata=meta, blocking=blocking)
        self._pending = handle
        if blocking:
            self._settled()
        return handle

    def wait(self) -> None:
        """Finish the save in flight (its verdict on every rank), then apply retention."""
        handle, self._pending = self._pending, None
        if handle is None:
            return
        handle.wait()
        self._settled()

    def _settled(self) -> None:
        self._pending = None
        if _rank() == 0:
            self.prune()

    def prune(self) -> list[str]:
        """Delete committed checkpoints beyond ``keep`` and never-committed leftovers older
        than every kept checkpoint; the newest committed one is always kept. Returns the
        directories removed. Called on rank 0 after each commit."""
        committed = self.committed()
        kept = committed[-self.keep :]
        if not kept:
            return []
        removed = []
        done = set(committed)
        for step in self._steps():
            if step in kept or (step not in done and step > kept[0]):
                continue  # kept, or a save newer than every kept one (maybe in flight)
            path = self.path(step)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def load_latest(
        self,
        model: nn.Module,
        optimizers: Mapping[str, Any] | None = None,
        *,
        strict: bool = False,
    ) -> LoadReport | None:
        """Load the newest committed checkpoint that loads (every rank alike); None if none.

        The step loaded is :attr:`loaded_step`, the same on every rank: the ranks agree on the
        newest step all of them see committed (a commit that lands while they look, such as a
        restarted job's predecessor's writers finishing its last save, is seen by some ranks
        only), then on each load's verdict and step (one all_reduce each). A newest checkpoint
        that fails to load (on any rank: the verdict is every rank's) is skipped for the one
        before it, with a warning.

        Raises:
            CheckpointError: on every rank alike: no checkpoint loads, the ranks do not see the
                same checkpoints (a directory that is not shared), or a peer failed.
        """
        group = Group()
        self.await_predecessors()
        for look in range(2):
            steps = self.committed()
            mine = steps[-1] if steps else -1
            try:
                low, high = group.all_reduce_mins([mine, -mine], "load_latest's newest step")
            except CollectiveFailed as e:
                raise fmt.CheckpointError(f"{self.root}: {e}") from e
            high = -high
            if low == high or look:
                break
            # A commit landed while the ranks looked (the predecessors' writers on another host
            # finishing): what one rank saw committed is there for all; look once more.
        if low != high:
            if low < 0:
                raise fmt.CheckpointError(
                    f"{self.root}: some ranks see no committed checkpoint, others see step "
                    f"{high}: is the directory shared by every rank?"
                )
            warnings.warn(
                f"fastinit.checkpoint: under {self.root} the ranks see step {low} to step {high} "
                f"as the newest committed (a commit landed while they looked); loading step {low}",
                stacklevel=2,
            )
        errors = []
        for step in reversed([s for s in steps if s <= low]):
            error: fmt.CheckpointError | None = None
            report = None
            try:
                report = load(self.path(step), model, optimizers, strict=strict, agree=False)
            except fmt.CheckpointError as e:
                error = e
            mine_ok = group.rank if error is not None else group.world_size
            try:
                failed, lo, hi = group.all_reduce_mins(
                    [mine_ok, step, -step], "load_latest's verdict"
                )
            except CollectiveFailed as e:
                raise fmt.CheckpointError(f"loading {self.path(step)}: {e}") from e
            if lo != -hi:
                raise fmt.CheckpointError(
                    f"{self.root}: the ranks reached different steps ({lo} to {-hi}): the "
                    "ranks do not see the same checkpoints; is the directory shared?"
                )
            if failed < group.world_size:
                why = str(error) if error is not None else f"it failed on rank {failed}"
                errors.append(f"step {step}: {why}")
                warnings.warn(
                    f"fastinit.checkpoint: the checkpoint of step {step} did not load ({why}); "
                    "trying the one before it",
                    stacklevel=2,
                )
                continue
            self.loaded_step = step
            return report
        if errors:
            raise fmt.CheckpointError(
                f"no checkpoint under {self.root} loads: " + " | ".join(errors[:3])
            )
        return None

    def close(self) -> None:
        """Finish the save in flight and release this process's staging buffers (the job
        ended cleanly)."""
        self.wait()
        close()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
