"""Process groups: only those a sharding plan needs, created only on their members.

``import fastinit.pg`` loads neither torch nor torchrec; the names below load
:mod:`fastinit.pg.registry` on first use. See that module for the API and ``docs/pg.md`` for the
cost model.

Example::

    import fastinit.pg

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

__all__ = [
    "NODE_GROUP_SHARDING_TYPES",
    "NodeGroupError",
    "NodeGroups",
    "clear_cache",
    "ensure_node_groups",
    "node_group_ranks",
    "node_groups",
    "plan_needs_node_groups",
    "plan_sharding_types",
    "prepare_for_plan",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fastinit.pg import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'fastinit.pg' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
