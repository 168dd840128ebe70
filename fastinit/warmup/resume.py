"""Resume from a checkpoint as a start-up stage, beside the data pipeline's start.

After a failure the job pays start-up again plus the checkpoint load. Loading the sharded model
is independent of the data pipeline, so it belongs in the same
:class:`~fastinit.warmup.graph.StageGraph`: :func:`resume_stage` gives the stage. It calls
:mod:`fastinit.checkpoint` (the one checkpoint API): each rank reads its own shards (or, after a
re-plan, only the stored shards overlapping its new ones), from the host-memory tier when the
save's staging buffer is still on this host. The load ends with its verdict (one all_reduce, so
every rank fails alike), so the stage is on the collective lane; it still runs beside every
local stage (the data pipeline's start).

Example::

    manager = CheckpointManager("/ckpt/job")
    graph.add("train_module_creation", shard, deps=("process_group_init",), collective=True)
    graph.add_stage(resume_stage(manager))              # deps: train_module_creation
    graph.add("preproc_creation", make_dataloader)      # overlaps with the load
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit.warmup.graph import Stage

if TYPE_CHECKING:
    from torch import nn

    from fastinit.checkpoint.manager import CheckpointManager

__all__ = ["resume_stage"]


def resume_stage(
    checkpoint: str | CheckpointManager,
    *,
    name: str = "resume",
    model_stage: str = "train_module_creation",
    optimizer_stage: str | None = None,
    strict: bool = False,
) -> Stage:
    """A stage that loads a checkpoint into the model built by ``model_stage``.

    Args:
        checkpoint: a checkpoint directory (fastinit's, or a stock DCP one), or a
            :class:`~fastinit.checkpoint.CheckpointManager` (its newest committed checkpoint
            that loads; nothing when there is none).
        name: the stage's name.
        model_stage: the stage whose result is the model.
        optimizer_stage: a stage whose result is ``{name: optimizer}`` to restore too (optional).
        strict: fail if the checkpoint does not hold some value of the target (see
            :func:`fastinit.checkpoint.load`).

    Returns:
        A collective :class:`~fastinit.warmup.graph.Stage` whose result is the model, loaded.
    """

    def resume(model: nn.Module, optimizers: Mapping[str, Any] | None = None) -> nn.Module:
        from fastinit.checkpoint import load
        from fastinit.checkpoint.manager import CheckpointManager

        if isinstance(checkpoint, CheckpointManager):
            checkpoint.load_latest(model, optimizers, strict=strict)
        else:
            load(checkpoint, model, optimizers, strict=strict)
        return model

    deps = (model_stage,) if optimizer_stage is None else (model_stage, optimizer_stage)
    return Stage(name=name, fn=resume, deps=deps, collective=True)
