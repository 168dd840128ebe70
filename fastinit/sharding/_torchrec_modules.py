"""Private TorchRec and torch names touched by fastinit's sharders and ``setup``, in one place.

Written against torchrec 1.8.0 and torch 2.13.0; :func:`fastinit.compat.require` checks for them
before any of these names is used, so an upgrade fails loudly instead of silently changing what a
patched code path does.

Touches:
    torch.distributed._shard.sharded_tensor.ShardedTensor._init_from_local_shards (scoped,
        thread-aware replacement while one EmbeddingCollection builds its state),
    ShardedTensor._init_from_local_shards_and_global_metadata (the public-in-spirit local route
        that TorchRec's own EmbeddingBagCollection uses),
    ShardedEmbeddingCollection._model_parallel_name_to_local_shards, ._table_name_to_config,
    torchrec.distributed.collective_utils._INITIALIZED / _USE_COLLECTIVE_VALIDATION /
        _resolve_enablement_on_leader (collective validation configured without a broadcast),
    EmbeddingShardingPlanner._topology / ._constraints (read, for the plan fingerprint).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_local = threading.local()
_patch_lock = threading.Lock()
_patch_depth = 0
_original: Callable[..., Any] | None = None


def _dispatching_init(*args: Any, **kwargs: Any) -> Any:
    hook = getattr(_local, "hook", None)
    if hook is not None:
        result = hook(*args, **kwargs)
        if result is not NotImplemented:
            return result
    assert _original is not None
    return _original(*args, **kwargs)


@contextlib.contextmanager
def local_sharded_tensor_init(hook: Callable[..., Any]) -> Iterator[None]:
    """Within the block, on this thread only, ``ShardedTensor._init_from_local_shards`` calls
    ``hook(local_shards, *global_size, process_group=..., init_rrefs=...)`` first; a hook that
    returns ``NotImplemented`` falls through to torch's collective implementation.

    Other threads keep torch's implementation (the replacement dispatches on a thread-local).
    """
    global _patch_depth, _original
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with _patch_lock:
        if _patch_depth == 0:
            _original = ShardedTensor._init_from_local_shards
            ShardedTensor._init_from_local_shards = staticmethod(_dispatching_init)  # type: ignore[method-assign]
        _patch_depth += 1
    previous = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = previous
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                setattr(ShardedTensor, "_init_from_local_shards", _original)  # noqa: B010
                _original = None


def ec_local_shards_by_id(module: Any) -> dict[int, str]:
    """``id(local shard list) -> table name`` of a ShardedEmbeddingCollection building its state."""
    shards = getattr(module, "_model_parallel_name_to_local_shards", {})
    return {id(v): k for k, v in shards.items()}


def table_config(module: Any, name: str) -> Any:
    return module._table_name_to_config[name]


def collective_validation_on_leader() -> bool:
    """What rank 0's ``init_collective_validation`` would broadcast, resolved on this rank."""
    from torchrec.distributed import collective_utils

    return bool(collective_utils._resolve_enablement_on_leader())


def set_collective_validation(enabled: bool) -> None:
    """Configure TorchRec's collective validation as ``init_collective_validation`` would, with
    rank 0's value already known, so DMP's own call returns at once (no broadcasts)."""
    from torchrec.distributed import collective_utils

    if collective_utils._INITIALIZED:
        return
    collective_utils._USE_COLLECTIVE_VALIDATION = enabled
    collective_utils._INITIALIZED = True


def planner_inputs(planner: Any) -> tuple[Any, Any]:
    """``(topology, constraints)`` of a TorchRec planner (no public accessor in 1.8.0)."""
    return planner._topology, getattr(planner, "_constraints", None)
