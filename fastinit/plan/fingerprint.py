"""A digest of what determines a sharding plan.

:func:`planner_fingerprint` is the key of the plan cache and the value every rank compares in the
start-up record: two processes with the same fingerprint would get the same plan from the same
planner. It is a sha256 over a canonical JSON document (sorted keys, no ``hash()``, no ``id()``, no
``repr`` of arbitrary objects), so it is the same in every process whatever ``PYTHONHASHSEED``.

The replicated values themselves (dense parameters, buffers, data-parallel tables) are compared
after construction by :mod:`fastinit.protocol`.

Example::

    key = planner_fingerprint(model, sharders, topology, constraints=constraints)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastinit.plan._json import canonical_json as _dumps
from fastinit.plan._torchrec import constructor_settings, planner_settings, topology_custom_data

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.types import ModuleSharder, ShardingPlanner

__all__ = [
    "FINGERPRINT_VERSION",
    "DefaultTopology",
    "planner_fingerprint",
    "planner_inputs",
    "uncacheable_reason",
]

#: Bumped whenever what the fingerprint covers changes, so old cache entries stop matching.
FINGERPRINT_VERSION = 2

# Table config fields that only decide initial values, never the plan.
_INIT_ONLY_FIELDS = frozenset({"init_fn", "weight_init_max", "weight_init_min"})
_MAX_DEPTH = 8


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _canon(value: Any, depth: int = 0, exclude: frozenset[str] = frozenset()) -> Any:
    """A JSON-able, process-independent description of ``value``.

    Never uses ``hash()``, ``id()`` or an object's ``repr`` (which may hold a memory address):
    objects are described by their class and the constructor arguments they keep.
    """
    import torch

    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": _qualname(value), "name": value.name}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, torch.Size):
        return list(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype), "device": value.device.type}
    if isinstance(value, type):
        return {"class": _qualname(value)}
    if depth > _MAX_DEPTH:
        return {"object": _qualname(value), "truncated": True}
    deeper = depth + 1
    if dataclasses.is_dataclass(value):
        fields = {
            f.name: _canon(getattr(value, f.name), deeper)
            for f in dataclasses.fields(value)
            if f.name not in exclude
        }
        return {"object": _qualname(value), "fields": fields}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        fields = {f: _canon(getattr(value, f), deeper) for f in value._fields if f not in exclude}
        return {"object": _qualname(value), "fields": fields}
    if isinstance(value, list | tuple):
        return [_canon(v, deeper) for v in value]
    if isinstance(value, Mapping):
        items = [[_canon(k, deeper), _canon(v, deeper)] for k, v in value.items()]
        return {"mapping": sorted(items, key=_dumps)}
    if isinstance(value, set | frozenset):
        return {"set": sorted((_canon(v, deeper) for v in value), key=_dumps)}
    if isinstance(value, functools.partial):
        return {
            "partial": _canon(value.func, deeper),
            "args": _canon(value.args, deeper),
            "kwargs": _canon(value.keywords, deeper),
        }
    if inspect.isroutine(value):  # functions, methods, builtins: by name, never by address
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", "?")
        return {"callable": f"{getattr(value, '__module__', None)}.{name}"}
    if _is_topology(value):
        return _topology_doc(value)

    settings = constructor_settings(value)
    return {
        "object": _qualname(value),
        "settings": {k: _canon(v, deeper) for k, v in settings.items()},
    }


def _is_topology(value: Any) -> bool:
    from torchrec.distributed.planner.types import Topology

    return isinstance(value, Topology)


@dataclasses.dataclass(frozen=True)
class DefaultTopology:
    """TorchRec's ``Topology(world_size=..., local_world_size=..., compute_device=...)`` with
    every other argument at its default, described by these arguments (with the TorchRec
    version the fingerprint records, they determine it) without building its per-rank device
    list."""

    world_size: int
    local_world_size: int
    compute_device: str


def _device_runs(devices: Sequence[Any]) -> list[dict[str, Any]]:
    """The devices as runs of consecutive ranks with the same memory and perf (a uniform
    topology is one run at any world size)."""
    runs: list[dict[str, Any]] = []
    last: tuple[Any, ...] | None = None
    for d in devices:
        key = (d.storage.hbm, d.storage.ddr, d.storage.ssd, d.perf)
        if last is not None and key == last[0] and d.rank == last[1] + 1:
            runs[-1]["count"] += 1
            last = (key, d.rank)
            continue
        runs.append(
            {
                "rank": d.rank,
                "count": 1,
                "hbm": d.storage.hbm,
                "ddr": d.storage.ddr,
                "ssd": d.storage.ssd,
                "perf": [
                    _canon(d.perf.fwd_compute),
                    _canon(d.perf.fwd_comms),
                    _canon(d.perf.bwd_compute),
                    _canon(d.perf.bwd_comms),
                ],
            }
        )
        last = (key, d.rank)
    return runs


def _topology_doc(topology: Topology | DefaultTopology) -> dict[str, Any]:
    if isinstance(topology, DefaultTopology):
        return {"default_topology": dataclasses.asdict(topology)}

    return {
        "class": _qualname(topology),
        "world_size": topology.world_size,
        "local_world_size": topology.local_world_size,
        "intra_group_size": topology.intra_group_size,
        "compute_device": topology.compute_device,
        "devices": _device_runs(topology.devices),
        "hbm_mem_bw": _canon(topology.hbm_mem_bw),
        "ddr_mem_bw": _canon(topology.ddr_mem_bw),
        "ssd_mem_bw": _canon(topology.ssd_mem_bw),
        "hbm_to_ddr_mem_bw": _canon(topology.hbm_to_ddr_mem_bw),
        "intra_host_bw": _canon(topology.intra_host_bw),
        "inter_host_bw": _canon(topology.inter_host_bw),
        "comms_bandwidths": _canon(topology.comms_bandwidths, depth=1),
        "bwd_compute_multiplier": _canon(topology.bwd_compute_multiplier),
        "weighted_feature_bwd_compute_multiplier": _canon(
            topology.weighted_feature_bwd_compute_multiplier
        ),
        "uneven_sharding_perf_multiplier": _canon(topology.uneven_sharding_perf_multiplier),
        "custom_topology_data": _canon(topology_custom_data(topology)),
    }


def _table_configs(module: nn.Module) -> list[Any] | None:
    for getter in ("embedding_bag_configs", "embedding_configs"):
        fn = getattr(module, getter, None)
        if callable(fn):
            return [_canon(c, exclude=_INIT_ONLY_FIELDS) for c in fn()]
    return None


def _shardable_modules(
    module: nn.Module, sharders: Sequence[ModuleSharder[Any]], compute_device: str
) -> list[dict[str, Any]]:
    """The modules the planner would shard, found as ``EmbeddingEnumerator.enumerate`` does:
    from the root down, by exact type against each sharder's ``module_type`` (the last sharder
    of a type wins), not descending into a module that has a sharder."""
    from torchrec.distributed.planner.utils import sharder_name

    by_type = {sharder_name(s.module_type): s for s in sharders}
    out: list[dict[str, Any]] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        path, child = stack.pop(0)
        sharder = by_type.get(sharder_name(type(child)))
        if sharder is None:
            stack[0:0] = [(f"{path}.{n}" if path else n, m) for n, m in child.named_children()]
            continue
        is_weighted = getattr(child, "is_weighted", None)
        params = [
            [name, list(p.shape), str(p.dtype), p.device.type]
            for name, p in sharder.shardable_parameters(child).items()
        ]
        out.append(
            {
                "path": path,
                "type": _qualname(child),
                "sharder": _qualname(sharder),
                "is_weighted": bool(is_weighted()) if callable(is_weighted) else None,
                "shardable_parameters": params,
                "tables": _table_configs(child),
            }
        )
    return out


def _sharder_doc(sharder: ModuleSharder[Any], compute_device: str) -> dict[str, Any]:
    sharding_types = list(sharder.sharding_types(compute_device))
    return {
        "class": _qualname(sharder),
        "module_type": _qualname(sharder.module_type),
        "sharding_types": sharding_types,
        "compute_kernels": {
            st: list(sharder.compute_kernels(st, compute_device)) for st in sharding_types
        },
        "fused_params": _canon(getattr(sharder, "fused_params", None)),
        "qcomm_codecs": _canon(sharder.qcomm_codecs_registry),
    }


def _constraints_doc(constraints: Mapping[str, ParameterConstraints] | None) -> Any:
    if constraints is None:
        return None
    return {name: _canon(c) for name, c in sorted(constraints.items())}


def _planner_doc(planner: ShardingPlanner | None) -> dict[str, Any]:
    if planner is None:
        return {"default": "torchrec.distributed.planner.planners.EmbeddingShardingPlanner"}

    settings = planner_settings(planner)
    return {
        "class": _qualname(planner),
        "settings": {k: _canon(v, depth=1) for k, v in sorted(settings.items())},
    }


@functools.cache
def _versions() -> dict[str, str | None]:
    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    fbgemm = version("fbgemm_gpu") or version("fbgemm_gpu_cpu") or version("fbgemm-gpu-cpu")
    return {"torch": str(torch.__version__), "torchrec": version("torchrec"), "fbgemm_gpu": fbgemm}


def planner_inputs(
    module: nn.Module,
    sharders: Sequence[ModuleSharder[Any]],
    topology: Topology | DefaultTopology,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    planner: ShardingPlanner | None = None,
) -> dict[str, Any]:
    """The canonical document :func:`planner_fingerprint` hashes (for diagnostics and tests).

    Args: as :func:`planner_fingerprint`.

    Returns:
        A JSON-able dict: ``format``, ``versions``, ``modules``, ``sharders``, ``topology``,
        ``constraints``, ``planner``.
    """
    if constraints is None and planner is not None:
        constraints = planner_settings(planner).get("constraints")
    device = topology.compute_device
    return {
        "format": FINGERPRINT_VERSION,
        "versions": _versions(),
        "modules": _shardable_modules(module, sharders, device),
        "sharders": [_sharder_doc(s, device) for s in sharders],
        "topology": _topology_doc(topology),
        "constraints": _constraints_doc(constraints),
        "planner": _planner_doc(planner),
    }


def planner_fingerprint(
    module: nn.Module,
    sharders: Sequence[ModuleSharder[Any]],
    topology: Topology | DefaultTopology,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    planner: ShardingPlanner | None = None,
) -> bytes:
    """A digest of everything that determines the sharding plan (32 bytes).

    Covers every module the planner would shard (path, type, shardable parameters' names,
    shapes, dtypes and devices, every table config field except the init-only ones), the
    sharders (class, module type, sharding types and compute kernels for the topology's device,
    fused params, qcomm codecs), the topology (world and local sizes, every device's memory and
    perf, bandwidths, multipliers, custom topology data), every ``ParameterConstraints`` field,
    the planner's class and settings (batch size, enumerator, estimators, storage reservation,
    proposers, partitioner, performance model, callbacks, timeout, plan loader, each by class
    and kept constructor arguments), and the torch, torchrec and fbgemm_gpu versions.

    Args:
        module: the unsharded model (parameters may be on "meta").
        sharders: the sharders the plan is made for.
        topology: the planner's topology, or a :class:`DefaultTopology` (TorchRec's default
            topology of those arguments).
        constraints: per-table constraints; default: the planner's.
        planner: the planner that would plan; None means TorchRec's default
            ``EmbeddingShardingPlanner(topology, constraints=constraints)``.

    Returns:
        The sha256 digest of :func:`planner_inputs`' canonical JSON; the same in every process.
    """
    doc = planner_inputs(module, sharders, topology, constraints=constraints, planner=planner)
    return hashlib.sha256(_dumps(doc).encode("utf-8")).digest()


# Constructor arguments of TorchRec's planners that never decide the plan (logging only), and the
# topology, which the fingerprint takes separately; every other argument of a planner's class
# must be one of the settings read by ``planner_settings``.
_PLANNER_UNUSED_ARGUMENTS = frozenset({"topology", "stats", "debug"})
_PLANNER_ARGUMENTS = {
    "batch_size": "batch_size",
    "enumerator": "enumerator",
    "storage_reservation": "storage_reservation",
    "proposer": "proposers",
    "partitioner": "partitioner",
    "performance_model": "performance_model",
    "constraints": "constraints",
    "callbacks": "callbacks",
    "timeout_seconds": "timeout_seconds",
    "plan_loader": "plan_loader",
}


def uncacheable_reason(
    planner: ShardingPlanner | None,
    sharders: Sequence[ModuleSharder[Any]],
    constraints: Mapping[str, ParameterConstraints] | None,
) -> str | None:
    """Why the plan-cache key of these planner inputs would not be unique, or None if it is.

    The fingerprint describes a callable by its module and qualified name and an object by its
    class and the constructor arguments it keeps (see :func:`planner_fingerprint`). That is a
    faithful description only for module-level functions and classes whose state is their kept
    constructor arguments. Anything else would give two different inputs the same key, so a plan
    cached for one would be served for the other; such a call must not use the plan cache (the
    fingerprint itself stays usable for the cross-rank agreement check: every rank runs the same
    code). Reported, with where it was found:

    * a lambda, a local function or closure (``<locals>`` in its qualified name), a function
      without a module, a method bound to an instance;
    * an instance of a class defined inside a function;
    * an object whose class takes a constructor argument it does not keep under that name
      (``_<name>``, ``<name>`` or ``_<name>s``), or that has no ``__dict__`` to read it from;
    * a planner whose class takes a constructor argument TorchRec's planner does not have;
    * a value nested too deep to describe.

    Args:
        planner: the planner (None: TorchRec's default, always describable).
        sharders: the sharders.
        constraints: the per-table constraints (default: the planner's).

    Returns:
        A sentence naming the first indescribable input, or None.
    """
    if planner is not None:
        problem = _planner_problem(planner)
        if problem is not None:
            return problem
    if constraints is not None:
        for name, c in sorted(constraints.items()):
            problem = _describe_problem(c, f"constraints[{name!r}]", 0)
            if problem is not None:
                return problem
    for i, sharder in enumerate(sharders):
        where = f"sharders[{i}] ({_qualname(sharder)})"
        if "<locals>" in type(sharder).__qualname__:
            return f"{where} is an instance of a class defined inside a function"
        for attr in ("fused_params", "qcomm_codecs_registry"):
            problem = _describe_problem(getattr(sharder, attr, None), f"{where}.{attr}", 0)
            if problem is not None:
                return problem
    return None


def _planner_problem(planner: ShardingPlanner) -> str | None:
    where = f"the planner ({_qualname(planner)})"
    if "<locals>" in type(planner).__qualname__:
        return f"{where} is an instance of a class defined inside a function"
    try:
        params = inspect.signature(type(planner).__init__).parameters
    except (TypeError, ValueError):
        return f"{where} has a constructor whose arguments cannot be read"
    unknown = [
        n
        for n, p in params.items()
        if n != "self"
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and n not in _PLANNER_UNUSED_ARGUMENTS
        and n not in _PLANNER_ARGUMENTS
    ]
    if unknown:
        return (
            f"{where} takes constructor argument(s) {unknown} that the plan-cache key does not "
            "cover"
        )
    settings = planner_settings(planner)
    for name, value in sorted(settings.items()):
        problem = _describe_problem(value, f"{where} setting {name!r}", 0)
        if problem is not None:
            return problem
    return None


def _describe_problem(value: Any, where: str, depth: int) -> str | None:
    """Why ``_canon(value)`` would not describe ``value`` uniquely, or None (mirrors ``_canon``)."""
    import torch

    if value is None or isinstance(value, bool | str | int | float | enum.Enum):
        return None
    if isinstance(value, torch.dtype | torch.device | torch.Size | torch.Tensor):
        return None
    if isinstance(value, type):
        if "<locals>" in value.__qualname__:
            return f"{where} is the class {value.__qualname__}, defined inside a function"
        return None
    if depth > _MAX_DEPTH:
        return f"{where} is nested more than {_MAX_DEPTH} levels deep"
    deeper = depth + 1
    if "<locals>" in type(value).__qualname__:
        return f"{where} is an instance of {type(value).__qualname__}, defined inside a function"
    if dataclasses.is_dataclass(value):
        return _first(
            _describe_problem(getattr(value, f.name), f"{where}.{f.name}", deeper)
            for f in dataclasses.fields(value)
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return _first(
            _describe_problem(getattr(value, f), f"{where}.{f}", deeper) for f in value._fields
        )
    if isinstance(value, list | tuple):
        return _first(_describe_problem(v, f"{where}[{i}]", deeper) for i, v in enumerate(value))
    if isinstance(value, Mapping):
        return _first(
            _describe_problem(k, f"{where} key", deeper)
            or _describe_problem(v, f"{where}[{k!r}]", deeper)
            for k, v in value.items()
        )
    if isinstance(value, set | frozenset):
        return _first(_describe_problem(v, f"{where} item", deeper) for v in value)
    if isinstance(value, functools.partial):
        return (
            _describe_problem(value.func, f"{where}.func", deeper)
            or _describe_problem(value.args, f"{where}.args", deeper)
            or _describe_problem(value.keywords, f"{where}.keywords", deeper)
        )
    if inspect.isroutine(value):
        return _routine_problem(value, where)
    if _is_topology(value):
        return None
    return _object_problem(value, where, deeper)


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)


def _routine_problem(fn: Any, where: str) -> str | None:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or "?"
    if "<lambda>" in name:
        return f"{where} is a lambda ({getattr(fn, '__module__', None)}.{name})"
    if "<locals>" in name:
        return f"{where} is a local function or closure ({getattr(fn, '__module__', None)}.{name})"
    if getattr(fn, "__module__", None) is None and not inspect.isbuiltin(fn):
        return f"{where} is a function without a module ({name})"
    bound_to = getattr(fn, "__self__", None)
    if bound_to is not None and not isinstance(bound_to, type) and not inspect.ismodule(bound_to):
        return f"{where} is the method {name} bound to a {type(bound_to).__qualname__} instance"
    return None


# Planner components from these packages were read for 1.8.0: an argument they do not keep under
# its name is kept derived (EmbeddingEnumerator's topology as _world_size, _compute_device, ...,
# which the fingerprint covers through the topology) or does not decide the plan.
_AUDITED_MODULES = ("torchrec.", "fastinit.")


def _object_problem(value: Any, where: str, depth: int) -> str | None:
    cls = type(value)
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return f"{where} is a {cls.__qualname__} whose constructor arguments cannot be read"
    wanted = [
        n
        for n, p in params.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if wanted and not isinstance(getattr(value, "__dict__", None), dict):
        return f"{where} is a {cls.__qualname__} without a __dict__ to read its settings from"
    settings = constructor_settings(value)
    missing = [n for n in wanted if n not in settings]
    if missing and not cls.__module__.startswith(_AUDITED_MODULES):
        return (
            f"{where} is a {_qualname(value)} that does not keep its constructor argument(s) "
            f"{missing} under their names"
        )
    return _first(_describe_problem(v, f"{where}.{k}", depth) for k, v in sorted(settings.items()))
