"""Resume from a checkpoint as a start-up stage, overlapped with the data pipeline's start.

After a failure the job pays start-up again plus the checkpoint load. Loading a
``torch.distributed.checkpoint`` (DCP) of the sharded model is independent of the data pipeline,
so it belongs in the same :class:`~fastinit.warmup.graph.StageGraph`: :func:`resume_stage` gives
the stage. By default it loads with ``no_dist=True``: every rank reads the checkpoint's metadata
and its own shards without any collective, so the stage is local and runs on a worker thread
concurrently with everything else. With ``no_dist=False`` DCP plans the load with collectives and
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


def _state(model: nn.Module, optimizers: Mapping[str, Any] | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model.state_dict()}
    for name, opt in (optimizers or {}).items():
        if name == "model":
            raise ValueError("'model' is reserved for the model's state")
        state[name] = opt.state_dict()
    return state


def save_checkpoint(
    checkpoint_dir: str, model: nn.Module, optimizers: Mapping[str, Any] | None = None
) -> None:
    """Save the (sharded) model and optimizers with DCP; a collective call on every rank.

    Args:
        checkpoint_dir: the checkpoint directory (shared by the ranks).
        model: the model, e.g. a ``DistributedModelParallel``.
        optimizers: name -> optimizer (e.g. ``{"optim": dmp.fused_optimizer}``).
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizers), checkpoint_id=checkpoint_dir)


def load_checkpoint(
    checkpoint_dir: str,
    model: nn.Module,
    optimizers: Mapping[str, Any] | None = None,
    *,
    no_dist: bool = True,
) -> None:
    """Load a DCP checkpoint in place into the model and optimizers.

    Args:
        checkpoint_dir: the checkpoint directory.
        model: the model whose ``state_dict`` (sharded tensors included) receives the values.
        optimizers: name -> optimizer, as given to :func:`save_checkpoint`.
        no_dist: read without collectives (each rank plans its own reads); False lets DCP
            coordinate the load across ranks.
    """
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizers)
    dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=no_dist)
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
