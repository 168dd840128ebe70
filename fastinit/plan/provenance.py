"""What a plan-cache entry was planned for, so that a miss can say which planner input differs.

The plan-cache key (:func:`fastinit.plan.fingerprint.planner_fingerprint`) is one digest of
every planner input: a different key says *that* something differs, not *what*. Beside an entry
``<key>.fiplan`` this module keeps ``<key>.inputs.json``: the same canonical document cut into
named parts, each a short readable value or a digest, e.g.::

    {"format": 1, "key": "3fa2...", "written_by": "fastinit plan", "inputs": {
        "versions.torch": "2.13.0+cpu", "topology.world_size": 2, "topology.local_world_size": 2,
        "topology.compute_device": "cpu", "topology.other": "9c1e07a2d4b3",
        "sharders": "...", "constraints": "...", "planner.class": "...FastPlanner",
        "planner.settings": "...", "module sparse.ebc": "EmbeddingBagCollection ...",
        "table sparse.ebc.t0": "1000x16 float32 meta #5d1f0c2a9e01", ...}}

On a miss, :func:`explain_miss` finds the entry of the directory that differs in the fewest parts
and names them (planned value, then the job's). The key itself is never derived from this file:
a miss stays a miss, and a plan is only ever used for its exact key.

Example::

    key = fastinit.startup.plan_key(model, world_size=2, local_world_size=2, device=device)
    record_inputs(cache_dir, model, key, written_by="fastinit plan")
    ...
    message = explain_miss(cache_dir, model, key)  # in the job, when the lookup missed
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fastinit.plan import _torchrec as _trc
from fastinit.plan._json import canonical_json as _dumps
from fastinit.plan.fingerprint import planner_inputs

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder, ShardingPlanner

__all__ = [
    "INPUTS_SUFFIX",
    "KeyLike",
    "input_parts",
    "inputs_path",
    "record_inputs",
    "read_inputs",
    "diff_inputs",
    "explain_miss",
    "log_miss",
]

#: The file beside a cache entry that describes what it was planned for.
INPUTS_SUFFIX = ".inputs.json"
_FORMAT = 1
# Scanning a huge cache directory on a miss must stay cheap: the newest entries are compared.
_MAX_SCANNED = 256
# Topology fields worth naming on their own; the rest of the topology is one digest.
_TOPOLOGY_FIELDS = ("world_size", "local_world_size", "compute_device")


class KeyLike(Protocol):
    """What this module reads of a ``fastinit.startup.PlanKey``."""

    @property
    def planner(self) -> ShardingPlanner: ...

    @property
    def sharders(self) -> Sequence[ModuleSharder[Any]]: ...

    @property
    def fingerprint(self) -> bytes: ...


def _digest(doc: Any) -> str:
    return hashlib.sha256(_dumps(doc).encode("utf-8")).hexdigest()[:12]


def _document(
    module: nn.Module,
    key: KeyLike,
    constraints: Mapping[str, ParameterConstraints] | None,
) -> dict[str, Any]:
    topology, planner_constraints = _trc.planner_inputs(key.planner)
    return planner_inputs(
        module,
        list(key.sharders),
        topology,
        constraints=constraints if constraints is not None else planner_constraints,
        planner=key.planner,
    )


def _replace(value: Any, target: Any, by: str) -> Any:
    """``value`` with every sub-document equal to ``target`` replaced by ``by``."""
    if value == target:
        return by
    if isinstance(value, dict):
        return {k: _replace(v, target, by) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, target, by) for v in value]
    return value


def _table_value(entry: Sequence[Any] | None, config: Any) -> str:
    if entry is None:
        return f"(no weight) #{_digest(config)}"
    _, shape, dtype, device = entry
    dims = "x".join(str(n) for n in shape)
    return f"{dims} {dtype.removeprefix('torch.')} {device} #{_digest([entry, config])}"


def _module_parts(doc: Mapping[str, Any]) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    path = doc["path"]
    layout = {k: doc[k] for k in ("type", "sharder", "is_weighted")}
    kind = str(doc["type"]).rsplit(".", 1)[-1]
    parts[f"module {path or '<root>'}"] = f"{kind} #{_digest(layout)}"
    params = {p[0]: p for p in doc["shardable_parameters"]}
    configs: dict[str, Any] = {}
    for config in doc.get("tables") or []:
        name = config.get("fields", {}).get("name") if isinstance(config, Mapping) else None
        configs[str(name)] = config
    for name in sorted(set(params) | set(configs)):
        prefix = f"{path}." if path else ""
        parts[f"table {prefix}{name}"] = _table_value(params.get(name), configs.get(name))
    return parts


def input_parts(
    module: nn.Module,
    key: KeyLike,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
) -> dict[str, Any]:
    """The planner inputs behind ``key``, cut into named, comparable parts.

    Args:
        module: the model the key was computed for.
        key: the plan key (``fastinit.startup.plan_key``'s result).
        constraints: the constraints passed to ``plan_key``, if any (default: the planner's).

    Returns:
        ``{part name: short value}``; equal documents give equal parts. A ``"consistent"`` part is
        False when the document does not hash to ``key.fingerprint`` (the parts cannot then be
        trusted to explain a miss).
    """
    doc = _document(module, key, constraints)
    parts: dict[str, Any] = {"format": doc["format"]}
    for name, version in sorted(doc["versions"].items()):
        parts[f"versions.{name}"] = version
    topology = dict(doc["topology"])
    for field in _TOPOLOGY_FIELDS:
        parts[f"topology.{field}"] = topology.pop(field, None)
    parts["topology.other"] = _digest(topology)
    parts["sharders"] = _digest(doc["sharders"])
    parts["constraints"] = _digest(doc["constraints"])
    planner = dict(doc["planner"])
    parts["planner.class"] = planner.pop("class", None) or planner.get("default")
    # The topology has parts of its own: its copies inside the planner's settings (the planner's,
    # its estimators', its performance model's) are left out here.
    parts["planner.settings"] = _digest(_replace(planner, doc["topology"], "<topology>"))
    for module_doc in doc["modules"]:
        parts.update(_module_parts(module_doc))
    fingerprint = hashlib.sha256(_dumps(doc).encode("utf-8")).digest()
    parts["consistent"] = fingerprint == key.fingerprint
    return parts


def inputs_path(cache_dir: str | os.PathLike[str], fingerprint: bytes) -> pathlib.Path:
    """The file that describes the entry of ``fingerprint`` in ``cache_dir``."""
    return pathlib.Path(cache_dir) / f"{fingerprint.hex()}{INPUTS_SUFFIX}"


def record_inputs(
    cache_dir: str | os.PathLike[str],
    module: nn.Module,
    key: KeyLike,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    written_by: str = "fastinit",
) -> pathlib.Path:
    """Write ``<key>.inputs.json`` beside the cache entry of ``key`` (atomically).

    Args:
        cache_dir: the plan-cache directory (created if missing).
        module: the model the plan was made for.
        key: its plan key.
        constraints: as for :func:`input_parts`.
        written_by: who wrote the entry, shown when a miss is explained.

    Returns:
        The path written.

    Raises:
        OSError: the directory cannot be written.
    """
    path = inputs_path(cache_dir, key.fingerprint)
    doc = {
        "format": _FORMAT,
        "key": key.fingerprint.hex(),
        "written_by": written_by,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "inputs": input_parts(module, key, constraints=constraints),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_inputs(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """An ``*.inputs.json`` document, or None when it is missing, unreadable or foreign."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        return None
    if not isinstance(doc.get("inputs"), dict) or not isinstance(doc.get("key"), str):
        return None
    return doc


def _differing(planned: Mapping[str, Any], now: Mapping[str, Any]) -> set[str]:
    names = {n for n in set(planned) | set(now) if n != "consistent"}
    differ = {n for n in names if n not in planned or n not in now or planned[n] != now[n]}
    if any(n.startswith("topology.") and n != "topology.other" for n in differ):
        differ.discard("topology.other")
    if "planner.class" in differ:
        differ.discard("planner.settings")
    return differ


_TABLE_FIELDS = ("shape", "dtype", "device")


def _table_change(a: Any, b: Any) -> tuple[tuple[str, str, str], ...] | None:
    """What differs between two table values (shape, dtype, device; else "config"), or None."""
    pa, pb = str(a).split(), str(b).split()
    if len(pa) != 4 or len(pb) != 4:
        return None
    changes = tuple((f, x, y) for f, x, y in zip(_TABLE_FIELDS, pa[:3], pb[:3]) if x != y)
    return changes or (("config", "other fields", "differ"),)


def diff_inputs(planned: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The parts that differ, each as ``"name: planned X, now Y"``, most telling first.

    The rest-of-topology digest is left out when a named topology field already differs, and the
    planner's settings digest when its class differs. Three or more tables changed the same way
    (say, built on "cpu" where the plan was made on "meta") make one line.
    """
    differ = _differing(planned, now)
    order = ("format", "versions", "topology", "planner", "sharders", "constraints", "module")

    def rank(name: str) -> tuple[int, str]:
        return next((i for i, p in enumerate(order) if name.startswith(p)), len(order)), name

    groups: dict[tuple[tuple[str, str, str], ...], list[str]] = {}
    for name in sorted(differ):
        if name.startswith("table ") and name in planned and name in now:
            change = _table_change(planned[name], now[name])
            if change is not None:
                groups.setdefault(change, []).append(name.removeprefix("table "))
    grouped = {f"table {t}" for tables in groups.values() if len(tables) >= 3 for t in tables}
    lines = []
    for name in sorted(differ - grouped, key=rank):
        if name not in planned:
            lines.append(f"{name}: not planned for, now {now[name]}")
        elif name not in now:
            lines.append(f"{name}: planned {planned[name]}, now absent")
        else:
            lines.append(f"{name}: planned {planned[name]}, now {now[name]}")
    for change, tables in groups.items():
        if len(tables) >= 3:
            what = ", ".join(f"{f} planned {x}, now {y}" for f, x, y in change)
            lines.append(f"{len(tables)} tables ({', '.join(tables[:2])}, ...): {what}")
    return lines


def explain_miss(
    cache_dir: str | os.PathLike[str],
    module: nn.Module,
    key: KeyLike,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    limit: int = 8,
) -> str:
    """One log line saying why ``key`` has no entry in ``cache_dir``.

    Compares the job's planner inputs with those of every described entry (the newest 256) and
    names the parts in which the nearest one differs. Call it only on a miss: it recomputes the
    planner-input document (about the cost of the fingerprint).

    Args:
        cache_dir: the plan-cache directory.
        module: the job's model.
        key: the job's plan key (which missed).
        constraints: as for :func:`input_parts`.
        limit: most differing parts named.

    Returns:
        e.g. ``"plan cache miss in /plans (key 3fa2c1d09e8b): the nearest entry 77b0e1aa02c4
        (fastinit plan, 2026-11-30T11:02:10+00:00) differs in topology.world_size: planned 2,
        now 4"``.
    """
    head = f"plan cache miss in {os.fspath(cache_dir)} (key {key.fingerprint.hex()[:12]})"
    try:
        candidates = sorted(
            pathlib.Path(cache_dir).glob(f"*{INPUTS_SUFFIX}"),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )[:_MAX_SCANNED]
    except OSError:
        candidates = []
    described = [d for d in map(read_inputs, candidates) if d is not None]
    if not described:
        return f"{head}: no entry there says what it was planned for (none from `fastinit plan`)"
    now = input_parts(module, key, constraints=constraints)
    if not now.get("consistent", False):
        return f"{head}: this fastinit cannot describe the key's inputs (a version mismatch?)"
    best = min(described, key=lambda d: len(_differing(d["inputs"], now)))
    diffs = diff_inputs(best["inputs"], now)
    origin = f"{best.get('written_by', '?')}, {best.get('written_at', '?')}"
    if best["key"] == key.fingerprint.hex():
        return f"{head}: its description exists but the entry does not (deleted or unreadable)"
    if not diffs:
        return (
            f"{head}: the nearest entry {best['key'][:12]} ({origin}) differs in a planner input "
            "this description does not cover"
        )
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return (
        f"{head}: the nearest entry {best['key'][:12]} ({origin}) differs in "
        + "; ".join(diffs[:limit])
        + more
    )


def log_miss(
    cache_dir: str | os.PathLike[str],
    module: nn.Module,
    key: KeyLike,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    log: logging.Logger | None = None,
) -> str:
    """Log :func:`explain_miss`'s line: WARNING when the directory holds plans made ahead with
    ``fastinit plan`` (someone expected a hit), INFO otherwise (a cold cache). Returns the line."""
    message = explain_miss(cache_dir, module, key, constraints=constraints)
    planned_ahead = "(fastinit plan," in message
    (log or logger).log(logging.WARNING if planned_ahead else logging.INFO, "%s", message)
    return message
