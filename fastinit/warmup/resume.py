"""Resume from a checkpoint as a start-up stage, overlapped with the data pipeline's start.

After a failure the job pays start-up again plus the checkpoint load. Loading a
``torch.distributed.checkpoint`` (DCP) of the sharded model is independent of the data pipeline,
so it belongs in the same :class:`~fastinit.warmup.graph.StageGraph`: :func:`resume_stage` gives
the stage. Checkpoints are :mod:`fastinit.checkpoint`'s (indexed by the plan): every rank reads
its own shards (or, after a re-plan, only the stored shards overlapping its new ones) without
any collective, so the stage is local and runs on a worker thread concurrently with everything
else. A stock DCP checkpoint (global ``.metadata``) still loads, with ``dcp.load``: by default
``no_dist=True`` (no collective); with ``no_dist=False`` DCP plans the load with collectives and
the stage is put on the collective lane.

Example::

    graph.add("train_module_creation", shard, deps=("process_group_init",), collective=True)
    graph.add_stage(resume_stage("/ckpt/step-1000"))  # deps: train_module_creation
    graph.add("preproc_creation", make_dataloader)     # overlaps with the load
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit.warmup.graph import Stage

if TYPE_CHECKING:
    from torch import nn

__all__ = ["save_checkpoint", "load_checkpoint", "resume_stage"]


def save_checkpoint(
    checkpoint_dir: str, model: nn.Module, optimizers: Mapping[str, Any] | None = None
) -> None:
    """Save the (sharded) model and optimizers with :func:`fastinit.checkpoint.save`
    (blocking: written and committed on return); a call on every rank.

    Args:
        checkpoint_dir: the checkpoint directory (shared by the ranks).
        model: the model, e.g. a ``DistributedModelParallel``.
        optimizers: name -> optimizer (e.g. ``{"optim": dmp.fused_optimizer}``).
    """
    from fastinit.checkpoint import save

    save(checkpoint_dir, model, optimizers, blocking=True)


def load_checkpoint(
    checkpoint_dir: str,
    model: nn.Module,
    optimizers: Mapping[str, Any] | None = None,
    *,
    no_dist: bool = True,
) -> None:
    """Load a checkpoint in place into the model and optimizers.

    A fastinit checkpoint loads with :func:`fastinit.checkpoint.load` (no collective, same plan
    or resharded); a stock DCP checkpoint (a global ``.metadata``, no fastinit index) with
    ``torch.distributed.checkpoint.load``.

    Args:
        checkpoint_dir: the checkpoint directory.
        model: the model whose ``state_dict`` (sharded tensors included) receives the values.
        optimizers: name -> optimizer, as given to :func:`save_checkpoint`.
        no_dist: for a stock DCP checkpoint: read without collectives (each rank plans its
            own reads); False lets DCP coordinate the load across ranks. A fastinit
            checkpoint never needs a collective.
    """
    from fastinit.checkpoint import load
    from fastinit.checkpoint.format import is_fastinit_checkpoint

    if no_dist or is_fastinit_checkpoint(checkpoint_dir):
        load(checkpoint_dir, model, optimizers)
        return
    import torch.distributed.checkpoint as dcp

    from fastinit.checkpoint.state import build_state

    state = build_state(model, optimizers)
    dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=False)
    model.load_state_dict(state["model"])
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(state[name])


def resume_stage(
    checkpoint_dir: str,
    *,
    name: str = "resume",
    model_stage: str = "train_module_creation",
    optimizer_stage: str | None = None,
    no_dist: bool = True,
) -> Stage:
    """A stage that loads ``checkpoint_dir`` into the model built by ``model_stage``.

    Args:
        checkpoint_dir: the DCP checkpoint to resume from.
        name: the stage's name.
        model_stage: the stage whose result is the model.
        optimizer_stage: a stage whose result is ``{name: optimizer}`` to restore too (optional).
        no_dist: load without collectives (a local stage); False: a collective stage.

    Returns:
        A :class:`~fastinit.warmup.graph.Stage` whose result is the model, loaded.
    """

    def resume(model: nn.Module, optimizers: Mapping[str, Any] | None = None) -> nn.Module:
        load_checkpoint(checkpoint_dir, model, optimizers, no_dist=no_dist)
        return model

    deps = (model_stage,) if optimizer_stage is None else (model_stage, optimizer_stage)
    return Stage(name=name, fn=resume, deps=deps, collective=not no_dist)
