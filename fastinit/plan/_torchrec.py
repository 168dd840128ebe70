"""Every touch of a private TorchRec name made by ``fastinit.plan``, in one place.

Written against torchrec 1.8.0. Reads only; nothing here writes to a TorchRec object. Touches:
    torchrec.distributed.planner.planners.EmbeddingPlannerBase / EmbeddingShardingPlanner: the
        attributes _topology, _batch_size, _constraints, _enumerator, _storage_reservation,
        _proposers, _partitioner, _perf_model, _callbacks, _timeout_seconds (and the public
        plan_loader), for the plan fingerprint and the cache-miss diagnosis.
    torchrec.distributed.planner.types.Topology._custom_topology_data and
        CustomTopologyData._data (EmbeddingEnumerator reads them for per-device memory).
    The "_<parameter>" attributes in which planner components (enumerators, estimators, proposers,
        partitioners, storage reservations, comms bandwidths, qcomm codecs, ...) keep their
        constructor arguments (constructor_settings), e.g. GreedyProposer._use_depth, ._threshold;
        GreedyPerfPartitioner._sort_by; HeuristicalStorageReservation._percentage;
        EmbeddingEnumerator._estimators (kept for the "estimator" argument).

When TorchRec is upgraded, read the upstream source of the names above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import Topology

# Planner attribute -> name in the fingerprint. Left out: stats and debug (logging only).
_PLANNER_ATTRIBUTES: dict[str, str] = {
    "_batch_size": "batch_size",
    "_constraints": "constraints",
    "_enumerator": "enumerator",
    "_storage_reservation": "storage_reservation",
    "_proposers": "proposers",
    "_partitioner": "partitioner",
    "_perf_model": "performance_model",
    "_callbacks": "callbacks",
    "_timeout_seconds": "timeout_seconds",
    "plan_loader": "plan_loader",
}


def planner_settings(planner: Any) -> dict[str, Any]:
    """The settings of a TorchRec planner that decide its plan, by name.

    Args:
        planner: an ``EmbeddingShardingPlanner`` (or a subclass, or another planner: only the
            attributes it has are read).

    Returns:
        ``{"batch_size": ..., "constraints": ..., "enumerator": ..., ...}`` for the attributes
        present; the planner's topology is not included (the fingerprint takes it separately).
    """
    state = vars(planner) if hasattr(planner, "__dict__") else {}
    return {name: state[attr] for attr, name in _PLANNER_ATTRIBUTES.items() if attr in state}


def topology_custom_data(topology: Topology) -> dict[str, list[int]] | None:
    """``Topology._custom_topology_data._data`` (per-device memory overrides), or None."""
    custom = getattr(topology, "_custom_topology_data", None)
    if custom is None:
        return None
    data = getattr(custom, "_data", None)
    return dict(data) if isinstance(data, dict) else None


def constructor_settings(obj: Any) -> dict[str, Any]:
    """The constructor arguments ``obj`` keeps, read from ``_<name>``, ``<name>`` or ``_<name>s``.

    Only attributes named after a parameter of ``type(obj).__init__`` are read, so state an
    object accumulates while planning (proposals, search spaces, best ratings) never enters the
    fingerprint.

    Args:
        obj: any object (a planner component, a codec, ...).

    Returns:
        ``{parameter name: value}`` for the parameters found; empty when none are.
    """
    import inspect

    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return {}
    try:
        params = inspect.signature(type(obj).__init__).parameters
    except (TypeError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for name, param in params.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        for attr in (f"_{name}", name, f"_{name}s"):
            if attr in state:
                out[name] = state[attr]
                break
    return out


def planner_inputs(planner: Any) -> tuple[Any, Any]:
    """``(topology, constraints)`` of a TorchRec planner (no public accessor in 1.8.0)."""
    return planner._topology, getattr(planner, "_constraints", None)
