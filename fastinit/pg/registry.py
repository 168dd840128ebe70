"""The process-group registry: only the node groups a plan needs, created only on their members.

Stock TorchRec 1.8.0 (``comm.intra_and_cross_node_pg``, reached from table_row_wise and grid_shard
sharding) makes every rank call ``new_group`` for every intra-node group (W/L of them) and every
cross-node group (L of them), then runs two barriers over the world. A rank belongs to exactly one
of each. This module creates just those two, and only on their members:

* gloo, or any backend without a bound device: ``new_group(ranks, use_local_synchronization=True)``
  on the members only, no barrier;
* a default group bound to a device (``init_process_group(device_id=...)``, NCCL): one
  ``split_group`` per grouping (every rank of the parent calls it once and gets its own group; the
  communicator is split from the parent's, no store rendezvous). A bound NCCL group cannot use
  member-only ``new_group``: torch makes non-members join a "no colour" split of the default
  communicator. Not exercised on this CPU machine;
* a group that would hold exactly the parent's ranks is the parent itself (one host: intra-node is
  the world; one rank per host: cross-node is the world).

Groups are cached per (parent group, local size, backend) and reused by every later call -- repeated
``setup`` calls, several sharded modules in one model -- until the default group is destroyed or
re-created, or a cached group is destroyed. The cost model (group creations and store round-trips
per rank, stock against fastinit, 8 to 4,096 ranks) is in ``docs/pg.md``.

Names: ``new_group(use_local_synchronization=True)`` names a group
``sha1("<ranks joined by _>_<number of groups this process has registered>")``
(``distributed_c10d._hash_ranks_to_str``), and that name prefixes the store keys of the group's
rendezvous. So the members of a group agree on its name only if each has registered the same number
of groups before. fastinit creates intra then cross in the same order on every rank; groups created
by stock code on every rank register only where the rank is a member, which for node-shaped groups
is the same count everywhere. Code that creates member-only groups of different shapes on different
ranks before this can break the agreement: the members then time out (below) rather than hang.

Example::

    import fastinit.pg

    plan = planner.collective_plan(model, sharders, pg)
    fastinit.pg.prepare_for_plan(plan)  # 0 groups unless the plan has TWRW/GRID tables
    model = DistributedModelParallel(model, plan=plan, ...)  # creates no process group
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fastinit import knobs
from fastinit.errors import NodeGroupError
from fastinit.pg import _torchrec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "NODE_GROUP_SHARDING_TYPES",
    "NodeGroups",
    "NodeGroupError",
    "plan_sharding_types",
    "plan_needs_node_groups",
    "node_group_ranks",
    "node_groups",
    "ensure_node_groups",
    "prepare_for_plan",
    "clear_cache",
]

logger = logging.getLogger(__name__)

#: Sharding types whose TorchRec sharding needs the intra- and cross-node groups.
NODE_GROUP_SHARDING_TYPES: frozenset[str] = frozenset({"table_row_wise", "grid_shard"})


@dataclasses.dataclass(frozen=True, slots=True)
class NodeGroups:
    """This rank's intra-node and cross-node groups and how they were obtained."""

    intra: ProcessGroup
    """The ranks of this rank's host (``local_size`` consecutive ranks of the parent)."""
    cross: ProcessGroup
    """The ranks with this rank's local rank on every host."""
    intra_ranks: tuple[int, ...]
    """Global ranks of :attr:`intra`, in group-rank order."""
    cross_ranks: tuple[int, ...]
    """Global ranks of :attr:`cross`, in group-rank order."""
    local_size: int
    """Ranks per host."""
    method: str
    """``"new_group"`` (member-only), ``"split_group"``, ``"adopted"`` (TorchRec's, already there)."""
    created: int
    """Process groups created to get these (0 to 2): the others are the parent or were adopted."""


# -- what a plan needs (no torch import) -------------------------------------------------------


def _module_plans(plan: Any) -> Iterable[Any]:
    inner = getattr(plan, "plan", plan)
    if isinstance(inner, Mapping):
        return inner.values()
    return ()


def plan_sharding_types(plan: Any) -> set[str]:
    """The sharding types used by a ``ShardingPlan`` (or a mapping of module path to module plan).

    Module plans that are not mappings of ``ParameterSharding`` contribute nothing.
    """
    kinds: set[str] = set()
    for module_plan in _module_plans(plan):
        if not isinstance(module_plan, Mapping):
            continue
        for sharding in module_plan.values():
            kind = getattr(sharding, "sharding_type", None)
            if kind is not None:
                kinds.add(str(getattr(kind, "value", kind)))
    return kinds


def plan_needs_node_groups(plan: Any) -> bool:
    """Whether TorchRec will ask for the intra- and cross-node groups to shard ``plan``.

    True when a table is ``table_row_wise`` or ``grid_shard``; False for ``data_parallel``,
    ``table_wise``, ``column_wise``, ``table_column_wise`` and ``row_wise`` only.
    """
    return not plan_sharding_types(plan).isdisjoint(NODE_GROUP_SHARDING_TYPES)


def node_group_ranks(rank: int, world_size: int, local_size: int) -> tuple[list[int], list[int]]:
    """The (intra-node, cross-node) group of ``rank``, as indices into the parent's ranks.

    The layout of ``torchrec.distributed.comm.intra_and_cross_node_pg``: host h holds ranks
    ``[h*L, (h+1)*L)``; local rank l's cross-node group is ``[l, l+L, l+2L, ...]``.

    Raises:
        ValueError: ``local_size`` does not divide ``world_size`` or ``rank`` is out of range.
    """
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local size {local_size} does not divide the world size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    host, local = divmod(rank, local_size)
    intra = list(range(host * local_size, (host + 1) * local_size))
    cross = list(range(local, world_size, local_size))
    return intra, cross


def _all_groups(world_size: int, local_size: int) -> tuple[list[list[int]], list[list[int]]]:
    intra = [list(range(h, h + local_size)) for h in range(0, world_size, local_size)]
    cross = [list(range(lr, world_size, local_size)) for lr in range(local_size)]
    return intra, cross


# -- the cache ----------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Entry:
    parent: Any
    groups: NodeGroups


_LOCK = threading.RLock()
_WORLD: list[Any] = [None]  # the default group the cache was filled under
_CACHE: dict[tuple[int, int, str], _Entry] = {}


def clear_cache() -> None:
    """Forget every cached group (the groups themselves stay alive if referenced elsewhere)."""
    with _LOCK:
        _CACHE.clear()
        _WORLD[0] = None


def _registered(group: Any) -> bool:
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _lookup(key: tuple[int, int, str], parent: Any) -> NodeGroups | None:
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None or world is not _WORLD[0]:
        # The default group was destroyed or re-created: every cached group is stale.
        _CACHE.clear()
        _WORLD[0] = world
        return None
    entry = _CACHE.get(key)
    if entry is None or entry.parent is not parent:
        return None
    if not all(_registered(g) for g in (entry.parent, entry.groups.intra, entry.groups.cross)):
        del _CACHE[key]
        return None
    return entry.groups


# -- creation -----------------------------------------------------------------------------------


def _op_timeout(backend: str, timeout: timedelta | None) -> timedelta:
    if timeout is not None:
        return timeout
    from torch.distributed import constants

    # What new_group(timeout=None) gives, i.e. what TorchRec's own groups get.
    if backend == "nccl":
        return constants.default_pg_nccl_timeout or constants.default_pg_timeout
    return constants.default_pg_timeout


def _set_timeout(group: Any, timeout: timedelta) -> None:
    # Private torch helper (torch >= 2.3): the group was created with the start-up timeout so that a
    # missing member fails fast; its collectives get the usual timeout, as TorchRec's groups do.
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:
        logger.warning("torch has no _set_pg_timeout: node groups keep the start-up timeout")
        return
    setter(timeout, group)


_WAIT_KEY = re.compile(r"keys:\s*\S*/(\d+)\b")


def _creation_error(
    kind: str, ranks: list[int], rank: int, waited: float, timeout: timedelta, error: BaseException
) -> NodeGroupError:
    message = str(error)
    cause = f"{type(error).__name__}: {message.strip()}"
    if "timeout" not in message.lower() and "timed out" not in message.lower():
        return NodeGroupError(
            f"fastinit.pg: rank {rank} failed creating its {kind} process group of ranks {ranks} "
            f"after {waited:.1f}s: {cause}"
        )
    others = [r for r in ranks if r != rank]
    waiting = f"one of ranks {others}"
    match = _WAIT_KEY.search(message)
    if match is not None and int(match.group(1)) < len(ranks):
        # gloo's rendezvous waits for the members' keys in group-rank order; the key it timed out
        # on ends with the group rank it was waiting for.
        index = int(match.group(1))
        waiting = f"rank {ranks[index]}"
        if index < len(ranks) - 1:
            waiting += f" (ranks {ranks[index + 1 :]} not checked yet)"
    return NodeGroupError(
        f"fastinit.pg: rank {rank} gave up after {waited:.1f}s "
        f"(FASTINIT_COLLECTIVE_TIMEOUT={timeout.total_seconds():g}s) creating its {kind} process "
        f"group of ranks {ranks}: still waiting for {waiting}. Every member must create its node "
        "groups (fastinit.pg.prepare_for_plan / ensure_node_groups) with the same local size; a "
        "member that died, hangs, or was given another plan never joins. "
        f"Underlying error: {cause}"
    )


def _new_member_group(
    kind: str, ranks: list[int], backend: str, op_timeout: timedelta
) -> ProcessGroup:
    import torch.distributed as dist

    rank = dist.get_rank()
    creation_timeout = timedelta(seconds=knobs.get_collective_timeout())
    t0 = time.monotonic()
    try:
        group = dist.new_group(
            ranks=ranks,
            timeout=creation_timeout,
            backend=backend,
            use_local_synchronization=True,
            group_desc=f"fastinit_{kind}",
        )
    except Exception as e:
        raise _creation_error(kind, ranks, rank, time.monotonic() - t0, creation_timeout, e) from e
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        raise NodeGroupError(
            f"fastinit.pg: rank {rank} is not a member of its {kind} group {ranks}"
        )
    if op_timeout != creation_timeout:
        _set_timeout(group, op_timeout)
    return group


def _split(
    kind: str, parent: Any, splits: list[list[int]], mine: list[int], op_timeout: timedelta
) -> ProcessGroup:
    import torch.distributed as dist

    # split_ranks are ranks *in the parent group*; every rank of the parent calls this once with the
    # same splits and receives the group it is in.
    group = dist.split_group(
        parent_pg=parent, split_ranks=splits, timeout=op_timeout, group_desc=f"fastinit_{kind}"
    )
    if group is None:
        raise NodeGroupError(f"fastinit.pg: split_group gave no {kind} group for ranks {mine}")
    return group


def _adopt(intra_ranks: list[int], cross_ranks: list[int]) -> tuple[Any, Any] | None:
    """TorchRec's cached groups, if something already created them with the right ranks."""
    if _torchrec.unsupported_reason() is not None:
        return None
    intra, cross = _torchrec.installed_node_groups()
    if intra is None or cross is None or not (_registered(intra) and _registered(cross)):
        return None
    import torch.distributed as dist

    if dist.get_process_group_ranks(intra) != intra_ranks:
        return None
    if dist.get_process_group_ranks(cross) != cross_ranks:
        return None
    return intra, cross


def node_groups(
    local_size: int | None = None,
    pg: ProcessGroup | None = None,
    *,
    timeout: timedelta | None = None,
) -> NodeGroups:
    """This rank's intra- and cross-node groups, created (only where a member) if not cached.

    Every rank of ``pg`` must call this with the same ``local_size`` (as every rank calls
    ``DistributedModelParallel``); on a gloo/unbound group only the members of a group synchronise.

    Args:
        local_size: ranks per host; default: what TorchRec's ``intra_and_cross_node_pg`` uses
            (``LOCAL_WORLD_SIZE``, or the pod size when ``TORCHREC_RESOLVED_POD_SIZE`` is set).
        pg: the parent group whose ranks are split (in order, ``local_size`` per host); default the
            world.
        timeout: the collective timeout of the new groups; default torch's default for the backend
            (as for TorchRec's own groups). Creation itself waits at most
            ``FASTINIT_COLLECTIVE_TIMEOUT`` for the other members.

    Returns:
        The groups; the same object for every later call with the same parent, size and backend.

    Raises:
        NodeGroupError: a member did not join within ``FASTINIT_COLLECTIVE_TIMEOUT``.
        ValueError: ``local_size`` does not divide the parent's size.
    """
    import torch.distributed as dist

    parent = pg if pg is not None else dist.group.WORLD
    if parent is None:
        raise RuntimeError("fastinit.pg: the default process group is not initialised")
    world_size = parent.size()
    if local_size is None:
        local_size = _torchrec.default_local_size(world_size)
    backend = str(dist.get_backend(parent))
    key = (id(parent), local_size, backend)
    with _LOCK:
        cached = _lookup(key, parent)
        if cached is not None:
            return cached
        parent_ranks = dist.get_process_group_ranks(parent)
        me = parent.rank()
        intra_idx, cross_idx = node_group_ranks(me, world_size, local_size)
        intra_ranks = [parent_ranks[i] for i in intra_idx]
        cross_ranks = [parent_ranks[i] for i in cross_idx]
        is_world = parent is dist.group.WORLD
        adopted = _adopt(intra_ranks, cross_ranks) if is_world else None
        bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
        op_timeout = _op_timeout(backend, timeout)
        all_intra, all_cross = _all_groups(world_size, local_size)
        made: list[Any] = []
        created = 0
        for kind, mine, splits in (
            ("intra-node", intra_ranks, all_intra),
            ("cross-node", cross_ranks, all_cross),
        ):
            if adopted is not None:
                made.append(adopted[len(made)])
            elif mine == parent_ranks:
                made.append(parent)
            elif bound:
                made.append(_split(kind, parent, splits, mine, op_timeout))
                created += 1
            else:
                made.append(_new_member_group(kind, mine, backend, op_timeout))
                created += 1
        method = "adopted" if adopted is not None else "split_group" if bound else "new_group"
        groups = NodeGroups(
            intra=made[0],
            cross=made[1],
            intra_ranks=tuple(intra_ranks),
            cross_ranks=tuple(cross_ranks),
            local_size=local_size,
            method=method,
            created=created,
        )
        _CACHE[key] = _Entry(parent=parent, groups=groups)
        logger.info(
            "fastinit.pg: rank %d intra %s, cross %s (%s, %d created)",
            dist.get_rank(),
            intra_ranks,
            cross_ranks,
            method,
            created,
        )
        return groups


def ensure_node_groups(
    local_size: int | None = None, pg: ProcessGroup | None = None
) -> tuple[ProcessGroup, ProcessGroup]:
    """This rank's (intra-node, cross-node) groups; see :func:`node_groups`."""
    groups = node_groups(local_size, pg)
    return groups.intra, groups.cross


_WARNED: set[str] = set()


def prepare_for_plan(
    plan: Any, pg: ProcessGroup | None = None, local_size: int | None = None
) -> None:
    """Create the process groups ``plan`` needs, and make TorchRec's sharders use them.

    Call it on every rank right before ``DistributedModelParallel``. A plan without
    ``table_row_wise`` or ``grid_shard`` tables needs no group: nothing is created (nor imported).
    Otherwise this rank's intra- and cross-node groups (:func:`node_groups`) are installed where
    TorchRec's ``intra_and_cross_node_pg`` finds them, so TWRW and GRID sharding create nothing.

    Falls back, with a warning, to TorchRec's own group creation (stock behaviour) when ``pg`` is not
    the world (TorchRec 1.8.0's 1-D sharding derives its node groups from the world) or the installed
    torchrec is not the version ``fastinit.pg._torchrec`` was written against.

    Args:
        plan: the ``ShardingPlan`` about to be applied.
        pg: the sharding group (``ShardingEnv.process_group``); default the world.
        local_size: ranks per host; default what TorchRec's sharders use (see :func:`node_groups`).

    Raises:
        NodeGroupError: a member of one of this rank's groups did not join in time.
    """
    if not plan_needs_node_groups(plan):
        return
    import torch.distributed as dist

    reason = _torchrec.unsupported_reason()
    if reason is None and pg is not None and pg is not dist.group.WORLD:
        reason = "the sharding group is not the world (TorchRec 1.8.0 builds node groups from it)"
    if reason is not None:
        if reason not in _WARNED:
            _WARNED.add(reason)
            logger.warning("fastinit.pg: leaving node groups to TorchRec: %s", reason)
        return
    groups = node_groups(local_size, pg)
    _torchrec.install_node_groups(groups.intra, groups.cross)
