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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.pg.registry import (
        NODE_GROUP_SHARDING_TYPES,
        NodeGroupError,
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


def __getattr__(name: str) -> Any:
    if name == "init_process_group":
        from fastinit.pg.rendezvous import init_process_group

        return init_process_group
    if name in __all__:
        from fastinit.pg import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'fastinit.pg' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
