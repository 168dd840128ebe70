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


# ---- ShardedTensor from local shards and global metadata (fastinit.sharding.local) -----------
# Touches: ShardedTensor._init_from_local_shards_and_global_metadata (scoped, thread-aware
# replacement while a fast sharded module is built), ShardedTensor._normalize_pg,
# ._prepare_init, ._post_init, ._local_shards, c10d._rank_not_in_group, and torch's layout checks
# (_infer_sharding_spec_from_shards_metadata, validate_non_overlapping_shards_metadata,
# check_tensor). Written against torch 2.13.0.

_st_local = threading.local()
_st_lock = threading.Lock()
_st_depth = 0
_st_original: Any = None


def _st_dispatch(cls: Any, *args: Any, **kwargs: Any) -> Any:
    hook = getattr(_st_local, "hook", None)
    if hook is not None and cls.__name__ == "ShardedTensor":
        result = hook(*args, **kwargs)
        if result is not NotImplemented:
            return result
    return _st_original.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def local_sharded_tensor_from_metadata(hook: Callable[..., Any]) -> Iterator[None]:
    """Within the block, on this thread only,
    ``ShardedTensor._init_from_local_shards_and_global_metadata(...)`` calls ``hook`` with the
    same arguments first; ``NotImplemented`` falls through to torch's implementation."""
    global _st_depth, _st_original
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    name = "_init_from_local_shards_and_global_metadata"
    with _st_lock:
        if _st_depth == 0:
            _st_original = ShardedTensor.__dict__[name]
            setattr(ShardedTensor, name, classmethod(_st_dispatch))
        _st_depth += 1
    previous = getattr(_st_local, "hook", None)
    _st_local.hook = hook
    try:
        yield
    finally:
        _st_local.hook = previous
        with _st_lock:
            _st_depth -= 1
            if _st_depth == 0:
                setattr(ShardedTensor, name, _st_original)
                _st_original = None


def rank_not_in_group(pg: Any) -> bool:
    from torch.distributed import distributed_c10d as c10d

    return bool(c10d._rank_not_in_group(pg))


def normalize_pg(pg: Any) -> Any:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor._normalize_pg(pg)


def validate_layout(shards: Any, size: list[int], checks: bool = True) -> Any:
    """torch's layout checks of ``_init_from_local_shards_and_global_metadata`` (strided layout
    aside): the inferred sharding spec, after the overlap and bounds checks (``checks=False``:
    done already, on the layout's rule)."""
    from torch.distributed._shard.sharding_spec import api as spec_api
    from torch.distributed._shard.sharding_spec._internals import (
        check_tensor,
        validate_non_overlapping_shards_metadata,
    )

    spec = spec_api._infer_sharding_spec_from_shards_metadata(shards)
    if checks:
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, size)
    return spec


def sharded_tensor_from_checked_layout(
    local_shards: list[Any],
    metadata: Any,
    spec: Any,
    process_group: Any,
    built: dict[Any, Any] | None = None,
) -> Any:
    """The rest of torch 2.13.0's ``_init_from_local_shards_and_global_metadata`` once the
    layout has been checked: the local shards' checks, then the tensor. ``built`` remembers
    ``spec.build_metadata`` per size and tensor properties (O(shards) for torch's specs), so
    tensors of one layout get a copy of it instead of a rebuild."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ShardingSpec

    from fastinit.sharding.layout import SharedShards

    props = metadata.tensor_properties
    if props.layout != torch.strided:
        raise ValueError("Only torch.strided layout is currently supported")
    size = metadata.size
    key = (tuple(size), props.dtype, props.layout, props.requires_grad, props.pin_memory)
    template = built.get(key) if built is not None else None
    if template is None:
        dims = torch.Size(size)
        template = spec.build_metadata(
            dims, TensorProperties(props.dtype, props.layout, props.requires_grad, props.pin_memory)
        )
        if built is not None:
            built[key] = template

    shards, global_size = template.shards_metadata, template.size
    checked = shards.checked if isinstance(shards, SharedShards) else None

    class _Built(ShardingSpec):
        def build_metadata(self, tensor_sizes: Any, tensor_properties: Any) -> Any:
            return ShardedTensorMetadata(
                SharedShards(shards, checked), global_size, tensor_properties
            )

        def shard(self, tensor: Any, src_rank: int = 0, process_group: Any = None) -> Any:
            raise NotImplementedError

    st = ShardedTensor.__new__(
        ShardedTensor,
        _Built(),
        size,
        dtype=props.dtype,
        layout=props.layout,
        pin_memory=props.pin_memory,
        requires_grad=props.requires_grad,
    )
    st._sharding_spec = spec

    def mismatch(expected: Any, actual: Any, prop: str, rank: Any, is_property: bool) -> None:
        what = "tensor property" if is_property else "local ShardMetadata"
        if expected != actual:
            raise ValueError(
                f"Local shards' tensor {prop} property is incompatible with {what} on rank "
                f"{rank}: {what} {prop}={expected}, local shard tensor {prop}={actual}."
            )

    for shard in local_shards:
        meta = shard.metadata
        tensor = shard.tensor
        placement = meta.placement
        if placement is None:
            raise AssertionError("Must specify placement for `Shard`!")
        rank = placement.rank()
        mismatch(props.layout, tensor.layout, "layout", rank, True)
        if not tensor.is_contiguous():
            raise ValueError("Only torch.contiguous_format memory_format is currently supported")
        mismatch(meta.shard_sizes, list(tensor.size()), "size", rank, False)
        mismatch(props.pin_memory, tensor.is_pinned(), "pin_memory", rank, True)
        mismatch(placement.device(), tensor.device, "device", rank, False)
        mismatch(props.dtype, tensor.dtype, "dtype", rank, True)
        mismatch(props.requires_grad, tensor.requires_grad, "requires_grad", rank, True)
    st._local_shards = local_shards
    st._prepare_init(process_group=process_group, init_rrefs=False)
    st._post_init()
    return st


_opt_lock = threading.Lock()
_opt_depth = 0
_opt_original: Any = None


@contextlib.contextmanager
def fused_optimizer_class(cls: type) -> Iterator[None]:
    """Within the block, ``torchrec.distributed.batched_embedding_kernel.EmbeddingFusedOptimizer``
    (the name TorchRec's fused kernels construct their optimizers through) is ``cls``, a subclass
    that behaves as TorchRec's own on any thread but the building one; restored on exit."""
    global _opt_depth, _opt_original
    from torchrec.distributed import batched_embedding_kernel as bek

    with _opt_lock:
        if _opt_depth == 0:
            _opt_original = bek.EmbeddingFusedOptimizer
            bek.EmbeddingFusedOptimizer = cls
        _opt_depth += 1
    try:
        yield
    finally:
        with _opt_lock:
            _opt_depth -= 1
            if _opt_depth == 0:
                bek.EmbeddingFusedOptimizer = _opt_original
                _opt_original = None
