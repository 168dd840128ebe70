"""Sharded-module construction in O(this rank's shards + tables), not O(tables × ranks).

Stock TorchRec builds, for every row-wise and data-parallel table, one ``ShardedEmbeddingTable``
per rank of the job and groups every rank's tables, although a rank's lookups use only its own;
it then validates every shard of every ``ShardedTensor`` against the group's rank list (a list of
N ranks built per shard: O(N²) per row-wise table), and the fused optimizer deep-copies every
table's global shard metadata.

Here:

* :class:`FastRwPooledEmbeddingSharding`, :class:`FastRwSequenceEmbeddingSharding`,
  :class:`FastDpPooledEmbeddingSharding`, :class:`FastDpSequenceEmbeddingSharding` are TorchRec's
  row-wise / data-parallel shardings that build this rank's tables and groups only; another
  rank's are built on demand (``_grouped_embedding_configs_per_rank[r]``), as stock would have
  them, if anything asks (the ported ``__init__``/``_shard``: ``mirror/sharding/rw_sharding.py``,
  ``mirror/sharding/dp_sharding.py``).
* A table's global shard metadata is one shared list per table whose deep copy shares its
  (immutable) ``ShardMetadata`` and which remembers what was already checked about it.
* :func:`fast_sharded_tensor` is ``ShardedTensor._init_from_local_shards_and_global_metadata``
  with the same checks and result: for a layout given by its runs (:class:`LazyShards`) in
  O(runs + local shards), the shard list left unbuilt; for a list, in O(shards) rather than
  O(shards × ranks), once per distinct layout. :mod:`fastinit.sharding.kernels` has TorchRec's
  kernels and fused optimizer (its ``__init__`` ported in ``mirror/batched_embedding_kernel.py``)
  call it (no class or global is patched).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType

from fastinit.plan.layout import LazyShards, SharedShards, validate_runs
from fastinit.sharding import _torchrec_modules as _trc
from fastinit.sharding import rules
from fastinit.sharding.mirror.sharding.dp_sharding import OwnRankDp
from fastinit.sharding.mirror.sharding.rw_sharding import OwnRankRw

__all__ = [
    "FastRwPooledEmbeddingSharding",
    "FastRwSequenceEmbeddingSharding",
    "FastDpPooledEmbeddingSharding",
    "FastDpSequenceEmbeddingSharding",
    "embedding_bag_sharding",
    "embedding_sharding",
    "fast_sharded_tensor",
]


class FastRwPooledEmbeddingSharding(OwnRankRw, RwPooledEmbeddingSharding):
    """``RwPooledEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


class FastRwSequenceEmbeddingSharding(OwnRankRw, RwSequenceEmbeddingSharding):
    """``RwSequenceEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


class FastDpPooledEmbeddingSharding(OwnRankDp, DpPooledEmbeddingSharding):
    """``DpPooledEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


class FastDpSequenceEmbeddingSharding(OwnRankDp, DpSequenceEmbeddingSharding):
    """``DpSequenceEmbeddingSharding`` built in O(tables), not O(tables × ranks)."""


def _plain_env(env: ShardingEnv) -> bool:
    from torchrec.distributed.types import ShardingEnv2D

    return not isinstance(env, ShardingEnv2D)


def embedding_bag_sharding(
    sharding_infos: list[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: torch.device | None,
    qcomm_codecs_registry: dict[str, Any] | None,
) -> Any:
    """The fast sharding for an EmbeddingBagCollection's ``sharding_infos``, or None where
    TorchRec's own is used (other sharding types, a meta device, a 2D environment)."""
    kind = sharding_infos[0].param_sharding.sharding_type
    if (device is not None and device.type == "meta") or not _plain_env(env):
        return None
    if kind == ShardingType.ROW_WISE.value:
        return FastRwPooledEmbeddingSharding(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
        )
    if kind == ShardingType.DATA_PARALLEL.value:
        return FastDpPooledEmbeddingSharding(sharding_infos, env, device)
    return None


def embedding_sharding(
    sharding_type: str,
    sharding_infos: list[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: torch.device | None,
    qcomm_codecs_registry: dict[str, Any] | None,
) -> Any:
    """The fast sharding for an EmbeddingCollection's ``sharding_infos``, or None."""
    if (device is not None and device.type == "meta") or not _plain_env(env):
        return None
    if sharding_type == ShardingType.ROW_WISE.value:
        return FastRwSequenceEmbeddingSharding(
            sharding_infos=sharding_infos,
            env=env,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
    if sharding_type == ShardingType.DATA_PARALLEL.value:
        return FastDpSequenceEmbeddingSharding(
            sharding_infos=sharding_infos, env=env, device=device
        )
    return None


# ---- ShardedTensor from local shards and global metadata, without O(ranks) per shard ----------


class _Checked:
    """What was established about one shard list (one layout): per (group, rank), the number
    of this rank's shards; per size, the inferred spec, after the overlap and bounds checks."""

    __slots__ = ("local", "specs")

    def __init__(self) -> None:
        self.local: dict[tuple[int, int], int] = {}
        self.specs: dict[Any, Any] = {}


_GROUP_RANKS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _group_ranks(pg: Any) -> frozenset[int] | None:
    """The group's global ranks as a set, once per group (a group's ranks never change)."""
    if _trc.rank_not_in_group(pg):
        return None
    try:
        got = _GROUP_RANKS.get(pg)
    except TypeError:  # not weakly referenceable
        return frozenset(dist.get_process_group_ranks(pg))
    if got is None:
        got = _GROUP_RANKS[pg] = frozenset(dist.get_process_group_ranks(pg))
    return got


def _count_local(shards: Sequence[Any], pg: Any, current: int) -> int | None:
    """This rank's shards among ``shards``, each placement checked against the group's ranks
    (a set built once, not a list per shard); None where a placement names an RPC worker."""
    ranks = _group_ranks(pg)
    n = 0
    for md in shards:
        p = md.placement
        if p is None:
            raise ValueError("remote device is None")
        if p.worker_name() is not None:
            return None
        r = p.rank()
        if ranks is not None and r is not None and r not in ranks:
            raise ValueError(
                f"Global rank {r} does not exist in input process group: {sorted(ranks)}"
            )
        if r == current:
            n += 1
    return n


def fast_sharded_tensor(
    local_shards: list[Any],
    sharded_tensor_metadata: ShardedTensorMetadata,
    process_group: Any = None,
    init_rrefs: bool = False,
    sharding_spec: Any = None,
) -> Any:
    """``ShardedTensor._init_from_local_shards_and_global_metadata`` with the same checks and
    result; the per-shard placement check uses a set of the group's ranks, and the layout checks
    (overlap, bounds, spec inference) run once per distinct shard list. ``NotImplemented`` where
    torch's own must run (RPC references, worker-named placements)."""
    if init_rrefs:
        return NotImplemented
    shards = sharded_tensor_metadata.shards_metadata
    if not shards:
        raise ValueError("shards_metadata must not be empty!")
    pg = _trc.normalize_pg(process_group)
    current = dist.get_rank()
    if isinstance(shards, LazyShards) and not shards.expanded:
        out = _on_rule(local_shards, sharded_tensor_metadata, shards, pg, current, sharding_spec)
        if out is not None:
            return out
    # What was established about a layout shared by tables is kept with it (a plan's layouts:
    # SharedShards, or a LazyShards whose list was built); a plain list is checked per call.
    checked: _Checked | None = None
    if isinstance(shards, SharedShards | LazyShards):
        checked = shards.checked.get("fastinit")
        if checked is None:
            checked = shards.checked["fastinit"] = _Checked()
    key_pg = (id(pg), current)
    n_local = checked.local.get(key_pg) if checked is not None else None
    if n_local is None:
        n_local = _count_local(shards, pg, current)
        if n_local is None:
            return NotImplemented
        if checked is not None:
            checked.local[key_pg] = n_local
    if len(local_shards) != n_local:
        raise RuntimeError(
            f"Number of local shards ({len(local_shards)}) does not match number of local "
            f"shards metadata in sharded_tensor_metadata ({n_local}) on rank ({current}) "
        )
    size_key = tuple(sharded_tensor_metadata.size)
    spec = sharding_spec
    cached_spec = checked.specs.get(size_key) if checked is not None else None
    if cached_spec is None:
        # A compact spec's layout was checked on its runs (overlap and bounds) for this size.
        on_rule = (
            isinstance(shards, SharedShards | LazyShards) and ("bounds", size_key) in shards.checked
        )
        inferred = _trc.validate_layout(shards, list(size_key), checks=not on_rule)
        if checked is not None:
            checked.specs[size_key] = inferred
        cached_spec = inferred
    if spec is None:
        spec = cached_spec
    built = None
    if checked is not None and sharding_spec is None:  # the spec is the one cached here
        built = checked.specs.setdefault(("built", size_key), {})
    return _trc.sharded_tensor_from_checked_layout(
        local_shards, sharded_tensor_metadata, spec, process_group, built
    )


def _group_facts(pg: Any) -> tuple[frozenset[int], int, int] | None:
    """The group's ranks, smallest and largest (None if this rank is not in it)."""
    ranks = _group_ranks(pg)
    return (ranks, min(ranks), max(ranks)) if ranks else None


def _on_rule(
    local_shards: list[Any],
    metadata: ShardedTensorMetadata,
    shards: LazyShards,
    pg: Any,
    current: int,
    sharding_spec: Any,
) -> Any:
    """:func:`fast_sharded_tensor` for a layout given by its runs, in O(runs + local shards):
    torch's checks, spec and metadata computed from the runs (:mod:`fastinit.sharding.rules`)
    and the shard list left unbuilt. None where the runs do not decide it (the caller checks the
    built list); ``NotImplemented`` where torch's own must run."""
    runs = shards.runs
    facts = shards.checked
    key = ("group", id(pg))
    if key not in facts:
        facts[key] = _group_facts(pg)
    group = facts[key]
    if group is not None:
        bad = rules.ranks_in(runs, *group)
        if bad is not None:
            raise ValueError(
                f"Global rank {bad} does not exist in input process group: {sorted(group[0])}"
            )
    n_local = rules.local_count(runs, current)
    if n_local is None:
        return NotImplemented
    if len(local_shards) != n_local:
        raise RuntimeError(
            f"Number of local shards ({len(local_shards)}) does not match number of local "
            f"shards metadata in sharded_tensor_metadata ({n_local}) on rank ({current}) "
        )
    size = tuple(metadata.size)
    if ("bounds", size) not in facts:
        try:
            validate_runs(runs, list(size), "shards")
        except ValueError:
            return None  # torch's own checks give torch's error
        facts[("bounds", size)] = True
    spec = sharding_spec
    if spec is None:
        spec = facts.get(("spec", size))
        if spec is None:
            spec = rules.infer_spec(shards)
            if spec is None:
                return None
            facts[("spec", size)] = spec
        held = metadata  # the inferred spec's own metadata has these shards (same values)
    else:
        held = None
    return _trc.sharded_tensor_from_checked_layout(local_shards, metadata, spec, pg, held=held)


# torch's own constructor, as this module found it: fast_sharded_tensor stands for it only.
_TORCH_INIT = ShardedTensor.__dict__.get("_init_from_local_shards_and_global_metadata")


def sharded_tensor(*args: Any, **kwargs: Any) -> Any:
    """``ShardedTensor._init_from_local_shards_and_global_metadata(*args, **kwargs)``:
    :func:`fast_sharded_tensor`, or torch's own where that declines (RPC references,
    worker-named placements) or where torch's has been replaced since (a wrapper or a fault
    injection, as in TorchRec's own tests: whatever it does or raises is what happens, and
    TorchRec 1.9's ``_initialize_torch_state`` names the table in the error as it does stock)."""
    if ShardedTensor.__dict__.get("_init_from_local_shards_and_global_metadata") is not _TORCH_INIT:
        return ShardedTensor._init_from_local_shards_and_global_metadata(*args, **kwargs)
    out = fast_sharded_tensor(*args, **kwargs)
    if out is NotImplemented:
        out = ShardedTensor._init_from_local_shards_and_global_metadata(*args, **kwargs)
    return out
