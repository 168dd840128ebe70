"""The state a checkpoint holds: the model's and the optimizers' ``state_dict``, flattened.

``{"model": model.state_dict(), name: optimizer.state_dict(), ...}`` flattened with DCP's own
rules (:func:`fastinit.checkpoint._dcp.flatten`), so every FQN is the FQN DCP would write. A value
is *sharded* (a ``ShardedTensor`` or a ``DTensor`` not replicated on every mesh dim: each rank
stores its own shards) or *replicated* (a plain tensor or any other value: the same on every
rank, stored once, by rank 0, as DCP's own deduplication keeps one copy). Fused optimizer state
(TorchRec's ``fused_optimizer``, e.g. EXACT_ROWWISE_ADAGRAD momentum) is ShardedTensors in the
optimizer's state_dict; a dense optimizer's state is plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastinit.checkpoint import _dcp
from fastinit.checkpoint.format import TensorEntry
from fastinit.plan.layout import LazyShards, runs_of

if TYPE_CHECKING:
    from torch import nn

__all__ = ["build_state", "is_sharded", "entry_of", "global_runs", "shard0_rank"]


def build_state(model: nn.Module, optimizers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The nested state: ``{"model": ..., <optimizer name>: ...}``."""
    state: dict[str, Any] = {"model": model.state_dict()}
    for name, opt in (optimizers or {}).items():
        if name == "model":
            raise ValueError("'model' is reserved for the model's state")
        if "." in name:
            raise ValueError(f"optimizer names may not contain '.': {name!r}")
        state[name] = opt.state_dict()
    return state


def flat_state(state: dict[str, Any]) -> dict[str, Any]:
    return _dcp.flatten(state)


def is_sharded(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return True
    if isinstance(value, DTensor):
        return not all(p.is_replicate() for p in value.placements)
    return False


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def entry_of(fqn: str, value: Any) -> TensorEntry:
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        md = value.metadata()
        return TensorEntry(fqn, tuple(md.size), _dtype_name(md.tensor_properties.dtype))
    if isinstance(value, torch.Tensor):
        return TensorEntry(fqn, tuple(value.shape), _dtype_name(value.dtype))
    return TensorEntry(fqn, None, None)


def _shards_metadata(value: Any) -> Any:
    """A ShardedTensor's global shard list (as it is held: a list or fastinit's lazy list)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return value.metadata().shards_metadata
    return None


_RUNS_KEY = "fastinit.checkpoint.runs"


def global_runs(value: Any) -> tuple[Any, ...] | None:
    """The global layout of a ShardedTensor as shard runs (None for other values).

    A layout fastinit holds as a rule (``LazyShards``) gives its runs at no cost; otherwise the
    runs are found once per shared layout (memoised in the layout's shared ``checked`` facts).
    """
    shards = _shards_metadata(value)
    if shards is None:
        return None
    if isinstance(shards, LazyShards) and not shards.expanded:
        return shards.runs
    checked = getattr(shards, "checked", None)
    if isinstance(checked, dict):
        got = checked.get(_RUNS_KEY)
        if got is None or sum(r.count for r in got) != len(shards):
            got = checked[_RUNS_KEY] = runs_of(list(shards))
        return got
    return runs_of(list(shards))


def shard0_rank(value: Any) -> int | None:
    """The rank holding shard 0 of a ShardedTensor (it writes the layout), else None."""
    shards = _shards_metadata(value)
    if shards is None or len(shards) == 0:
        return None
    placement = shards[0].placement
    return None if placement is None else placement.rank()
