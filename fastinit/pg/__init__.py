"""Process groups: the default one made so that every restart comes back, and only the groups a
sharding plan needs, created only on their members.

``import fastinit.pg`` loads neither torch nor torchrec; the names below load
:mod:`fastinit.pg.rendezvous` (``init_process_group``) or :mod:`fastinit.pg.registry` (the rest)
on first use. See those modules for the API and ``docs/pg.md`` for the cost model.

Example::

    import fastinit.pg

    fastinit.pg.init_process_group()  # under torchrun: this restart round's keys only
    fastinit.pg.prepare_for_plan(plan)  # before DistributedModelParallel(..., plan=plan)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

if TYPE_CHECKING:
    from fastinit.errors import NodeGroupError
    from fastinit.pg.registry import (
        NODE_GROUP_SHARDING_TYPES,
        NodeGroups,
        clear_cache,
        ensure_node_groups,
        node_group_ranks,
        node_groups,
        plan_needs_node_groups,
        plan_sharding_types,
        prepare_for_plan,
    )
    from fastinit.pg.rendezvous import init_process_group

__all__ = [
    "NODE_GROUP_SHARDING_TYPES",
    "NodeGroupError",
    "NodeGroups",
    "clear_cache",
    "ensure_node_groups",
    "init_process_group",
    "node_group_ranks",
    "node_groups",
    "plan_needs_node_groups",
    "plan_sharding_types",
    "prepare_for_plan",
]

_EXPORTS = {
    "NODE_GROUP_SHARDING_TYPES": ".registry",
    "NodeGroupError": "fastinit.errors",
    "NodeGroups": ".registry",
    "clear_cache": ".registry",
    "ensure_node_groups": ".registry",
    "node_group_ranks": ".registry",
    "node_groups": ".registry",
    "plan_needs_node_groups": ".registry",
    "plan_sharding_types": ".registry",
    "prepare_for_plan": ".registry",
    "init_process_group": ".rendezvous",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
