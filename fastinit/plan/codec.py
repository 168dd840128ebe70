"""A versioned, pickle-free encoding of TorchRec sharding plans.

The plan is the one message the start-up protocol sends, and what the plan cache stores, so its
encoding must be small, deterministic (the same plan is the same bytes on every rank and in every
process) and safe to decode from untrusted bytes: decoding parses JSON and constructs only the
types named in an explicit allowlist; it never imports or calls anything named in the data.

Format (version 2; version 1 is still read)::

    b"FIPLAN" + NUL byte + uint16 big-endian format version + canonical JSON (UTF-8)

The JSON is ``{"plan": [[module_path, module_plan], ...]}``; module and parameter order are kept
as in the plan (TorchRec iterates them), while the fields of every object are written sorted by
name (``sort_keys``), with fixed separators. Values are tagged where JSON alone is ambiguous:

* ``{"$t": "<allowlisted class>", "$f": {field: value, ...}}``: a dataclass or NamedTuple;
* ``{"$t": "EmbeddingModuleShardingPlan", "$items": [[param_name, ParameterSharding], ...]}``;
* ``{"$e": "<allowlisted enum>", "$v": "<member name>"}``;
* ``{"$t": "remote_device", "$s": "rank:0/cpu"}``: a shard placement;
* ``{"$tuple": [...]}``, ``{"$frozenset": [...]}`` (items in canonical order);
* ``{"$float": "nan" | "inf" | "-inf"}``;
* ``{"$range": [start, stop, step]}``: a list of 4 or more ints in arithmetic progression (the
  ``ranks`` of a row-wise or data-parallel table), so that it does not grow with the world size;
* an ``EnumerableShardingSpec``'s ``shards`` as ``{"$runs": [run, ...]}``: its canonical
  :class:`~fastinit.plan.layout.ShardRun` s (a few per table for row-wise, table-row-wise,
  column and grid layouts at any world size). It decodes to a
  ``CompactShardingSpec``, which builds its ``ShardMetadata`` only when they are asked for.

Example::

    data = encode_plan(plan)
    assert plan_digest(plan) == hashlib.sha256(data).digest()
    same = decode_plan(data)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
import struct
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastinit.errors import PlanDecodeError, PlanEncodeError
from fastinit.plan import layout
from fastinit.plan._json import canonical_json

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "PlanDecodeError",
    "PlanEncodeError",
    "encode_plan",
    "decode_plan",
    "plan_digest",
    "is_current",
]

#: The first bytes of every encoded plan.
MAGIC = b"FIPLAN\x00"
#: The format version written after the magic; decoding any other version fails.
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
#: Longest list a ``$range`` or a shard run may stand for (a corrupt count must not exhaust memory).
_MAX_EXPANSION = 1 << 24
_HEADER = struct.Struct(">H")
_HEADER_LEN = len(MAGIC) + _HEADER.size
_EMBEDDING_PLAN = "EmbeddingModuleShardingPlan"
_REMOTE_DEVICE = "remote_device"


@dataclasses.dataclass(frozen=True, slots=True)
class _Registry:
    """The allowlist: the only classes the codec writes and constructs, by stable name."""

    objects: dict[str, type]
    """Dataclasses and NamedTuples, encoded field by field."""
    enums: dict[str, type[enum.Enum]]
    """Enums, encoded by member name."""
    names: dict[type, str]
    """The inverse of ``objects`` and ``enums``."""
    hints: dict[str, dict[str, Any]]
    """Field type hints per object class (empty where they cannot be resolved)."""
    placement: type
    """The type of ``ShardMetadata.placement`` (torch's ``_remote_device``), found through the
    public constructor rather than by its private name."""
    spec: type
    """``EnumerableShardingSpec`` (its compact subclass is encoded the same way)."""


@functools.cache
def _registry() -> _Registry:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        CacheAlgorithm,
        MultiPassPrefetchConfig,
    )
    from fbgemm_gpu.tbe.monitoring import TBEStatsReporterConfig
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torchrec.distributed.types import (
        CacheParams,
        KeyValueParams,
        ObjectPoolShardingPlan,
        ObjectPoolShardingType,
        ParameterSharding,
    )
    from torchrec.types import DataType

    objects: dict[str, type] = {
        "ParameterSharding": ParameterSharding,
        "CacheParams": CacheParams,
        "KeyValueParams": KeyValueParams,
        "EnumerableShardingSpec": EnumerableShardingSpec,
        "ShardMetadata": ShardMetadata,
        "MultiPassPrefetchConfig": MultiPassPrefetchConfig,
        "TBEStatsReporterConfig": TBEStatsReporterConfig,
        "ObjectPoolShardingPlan": ObjectPoolShardingPlan,
    }
    enums: dict[str, type[enum.Enum]] = {
        "DataType": DataType,
        "BoundsCheckMode": BoundsCheckMode,
        "CacheAlgorithm": CacheAlgorithm,
        "ObjectPoolShardingType": ObjectPoolShardingType,
    }
    try:  # KeyValueParams.kvzch_tbe_config (fbgemm_gpu >= 1.8 keeps these in tbe.ssd)
        from fbgemm_gpu.tbe.ssd import ssd_config

        objects["KVZCHTBEConfig"] = ssd_config.KVZCHTBEConfig
        objects["EnrichmentPolicy"] = ssd_config.EnrichmentPolicy
        enums["EnrichmentType"] = ssd_config.EnrichmentType
        enums["EnrichmentResponseFormat"] = ssd_config.EnrichmentResponseFormat
    except (ImportError, AttributeError):  # pragma: no cover - older fbgemm_gpu
        pass
    try:
        from fbgemm_gpu.tbe.monitoring.runtime_monitor import StdLogStatsReporterConfig

        objects["StdLogStatsReporterConfig"] = StdLogStatsReporterConfig
    except ImportError:  # pragma: no cover - older fbgemm_gpu
        pass

    hints: dict[str, dict[str, Any]] = {}
    for name, cls in objects.items():
        try:
            hints[name] = typing.get_type_hints(cls)
        except Exception:  # pragma: no cover - unresolvable annotations: no type checks
            hints[name] = {}
    names: dict[type, str] = {cls: name for name, cls in objects.items()}
    names.update({cls: name for name, cls in enums.items()})
    placement = type(ShardMetadata([0], [1], "rank:0/cpu").placement)
    return _Registry(
        objects=objects,
        enums=enums,
        names=names,
        hints=hints,
        placement=placement,
        spec=EnumerableShardingSpec,
    )


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(cls._fields)  # type: ignore[attr-defined]  # NamedTuple


# ---- encoding -------------------------------------------------------------------------------------

_canonical_json = functools.partial(canonical_json, allow_nan=False)


def _is_range(value: list[Any]) -> bool:
    if len(value) < 4 or set(map(type, value)) != {int}:
        return False
    step = value[1] - value[0]
    return step != 0 and value == list(range(value[0], value[-1] + step, step))


def _encode_spec(value: Any, where: str) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata

    from fastinit.plan import compact  # torch: imported when a spec is encoded

    if isinstance(value, compact.CompactShardingSpec):
        runs = value.current_runs()
    else:
        shards = value.shards
        if not isinstance(shards, list) or not shards:
            raise PlanEncodeError(f"{where}.shards: expected a non-empty list of ShardMetadata")
        for i, shard in enumerate(shards):
            if type(shard) is not ShardMetadata:
                raise PlanEncodeError(
                    f"{where}.shards[{i}]: expected ShardMetadata, got {type(shard).__qualname__}"
                )
            if not all(type(v) is int for v in (*shard.shard_offsets, *shard.shard_sizes)):
                raise PlanEncodeError(f"{where}.shards[{i}]: offsets and sizes must be ints")
            if shard.placement is not None and not isinstance(
                shard.placement, _registry().placement
            ):
                raise PlanEncodeError(f"{where}.shards[{i}].placement: not a remote device")
        runs = layout.runs_of(shards)
    return {
        "$t": "EnumerableShardingSpec",
        "$f": {"shards": {"$runs": [r.to_json() for r in runs]}},
    }


def _encode_value(value: Any, where: str) -> Any:
    reg = _registry()
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, enum.Enum):
        name = reg.names.get(type(value))
        if name is None:
            raise PlanEncodeError(
                f"{where}: enum {type(value).__qualname__} is not in the codec's allowlist"
            )
        return {"$e": name, "$v": value.name}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": repr(value)}
    if isinstance(value, reg.placement):
        return {"$t": _REMOTE_DEVICE, "$s": str(value)}
    name = reg.names.get(type(value))
    if name == "EnumerableShardingSpec" or (name is None and isinstance(value, reg.spec)):
        return _encode_spec(value, where)
    if name is not None:
        cls: type = value.__class__
        fields = {f: _encode_value(getattr(value, f), f"{where}.{f}") for f in _field_names(cls)}
        return {"$t": name, "$f": fields}
    if isinstance(value, list):
        if _is_range(value):
            return {"$range": [value[0], value[-1] + value[1] - value[0], value[1] - value[0]]}
        return [_encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        return {"$tuple": [_encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, frozenset):
        items = [_encode_value(v, f"{where}{{}}") for v in value]
        return {"$frozenset": sorted(items, key=_canonical_json)}
    raise PlanEncodeError(
        f"{where}: cannot encode a value of type {type(value).__module__}."
        f"{type(value).__qualname__}; the plan codec only writes the types of TorchRec's "
        f"ParameterSharding (allowlist: {sorted(reg.names.values())})"
    )


def _encode_module_plan(module_plan: Any, where: str) -> Any:
    from torchrec.distributed.types import EmbeddingModuleShardingPlan

    if type(module_plan) is EmbeddingModuleShardingPlan:
        items = [
            [name, _encode_value(ps, f"{where}[{name!r}]")] for name, ps in module_plan.items()
        ]
        for name, _ in items:
            if not isinstance(name, str):
                raise PlanEncodeError(f"{where}: parameter names must be str, got {name!r}")
        return {"$t": _EMBEDDING_PLAN, "$items": items}
    if type(module_plan) in _registry().names:
        return _encode_value(module_plan, where)
    raise PlanEncodeError(
        f"{where}: module plans of type {type(module_plan).__qualname__} are not supported "
        f"(only EmbeddingModuleShardingPlan and ObjectPoolShardingPlan)"
    )


def encode_plan(plan: ShardingPlan) -> bytes:
    """Encodes a sharding plan as versioned, canonical, pickle-free bytes.

    Args:
        plan: a ``torchrec.distributed.types.ShardingPlan``.

    Returns:
        ``MAGIC + version + canonical JSON``; the same plan always gives the same bytes.

    Raises:
        PlanEncodeError: the plan holds a type outside the codec's allowlist (for example a
            user-defined ``CacheParams.stats`` object).
    """
    modules = []
    for path, module_plan in plan.plan.items():
        if not isinstance(path, str):
            raise PlanEncodeError(f"module paths must be str, got {path!r}")
        modules.append([path, _encode_module_plan(module_plan, f"plan[{path!r}]")])
    body = _canonical_json({"plan": modules}).encode("utf-8")
    return MAGIC + _HEADER.pack(FORMAT_VERSION) + body


def is_current(data: bytes) -> bool:
    """Whether ``data`` starts with this version's header (what :func:`encode_plan` writes now);
    a decoded plan re-encodes to the same bytes only then."""
    return data[:_HEADER_LEN] == MAGIC + _HEADER.pack(FORMAT_VERSION)


def plan_digest(plan: ShardingPlan) -> bytes:
    """The sha256 of :func:`encode_plan` (32 bytes)."""
    return hashlib.sha256(encode_plan(plan)).digest()


# ---- decoding -------------------------------------------------------------------------------------


def _fail(where: str, message: str) -> PlanDecodeError:
    return PlanDecodeError(f"malformed plan at {where}: {message}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__qualname__", None) or str(hint)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the type hint ``hint`` (permissive where a hint is not understood)."""
    try:
        check = _checker(hint)
    except TypeError:  # an unhashable hint: build its checker without the cache
        check = _compile_hint(hint)
    return check(value)


@functools.cache
def _checker(hint: Any) -> Callable[[Any], bool]:
    # One checker per hint, built once: a plan has a ShardMetadata per shard (tables x ranks).
    return _compile_hint(hint)


def _always(value: Any) -> bool:
    return True


def _compile_hint(hint: Any) -> Callable[[Any], bool]:
    if hint is Any or isinstance(hint, typing.TypeVar | str | typing.ForwardRef):
        return _always
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        subs = [_compile_hint(a) for a in args]
        return lambda v: any(c(v) for c in subs)
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if origin is list:
        item = _compile_hint(args[0]) if args else _always
        return lambda v: isinstance(v, list) and all(map(item, v))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            each = _compile_hint(args[0])
            return lambda v: isinstance(v, tuple) and all(map(each, v))
        if not args:
            return lambda v: isinstance(v, tuple)
        subs = [_compile_hint(a) for a in args]
        return lambda v: (
            isinstance(v, tuple)
            and len(v) == len(subs)
            and all(c(x) for c, x in zip(subs, v, strict=True))
        )
    if origin is frozenset:
        item = _compile_hint(args[0]) if args else _always
        return lambda v: isinstance(v, frozenset) and all(map(item, v))
    if origin is not None or not isinstance(hint, type):
        return _always  # dicts, callables, literals...: not checked
    return lambda v: isinstance(v, hint)


class _Decoder:
    def __init__(self, version: int = FORMAT_VERSION) -> None:
        self.reg = _registry()
        self.version = version
        self.expansions: Any = None  # placement and ShardMetadata objects shared by the specs
        # A range's int objects, shared by the lists it decodes to (each list its own): the
        # ``ranks`` of every row-wise table list every rank.
        self.ranges: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def value(self, obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, bool | int | str):
            return obj
        if isinstance(obj, float):
            return obj
        if isinstance(obj, list):
            if all(type(v) is int for v in obj):  # offsets, sizes, ranks: nothing to decode
                if self.version >= 2 and _is_range(obj):
                    raise _fail(where, "an int progression must be written as $range")
                return list(obj)
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if not isinstance(obj, dict):  # pragma: no cover - json gives nothing else
            raise _fail(where, f"unexpected JSON value {type(obj).__name__}")
        keys = set(obj)
        if keys == {"$tuple"}:
            return tuple(
                self.value(v, f"{where}[{i}]")
                for i, v in enumerate(self.list(obj, "$tuple", where))
            )
        if keys == {"$frozenset"}:
            items = [self.value(v, f"{where}{{}}") for v in self.list(obj, "$frozenset", where)]
            try:
                return frozenset(items)
            except TypeError as e:
                raise _fail(where, f"unhashable frozenset item ({e})") from None
        if keys == {"$range"} and self.version >= 2:
            return self.range(obj["$range"], where)
        if keys == {"$float"}:
            text = obj["$float"]
            if text not in ("nan", "inf", "-inf"):
                raise _fail(where, f"bad $float {text!r}")
            return float(text)
        if keys == {"$e", "$v"}:
            return self.enum(obj["$e"], obj["$v"], where)
        if keys == {"$t", "$s"}:
            if obj["$t"] != _REMOTE_DEVICE or not isinstance(obj["$s"], str):
                raise _fail(where, f"unknown string-backed type {obj['$t']!r}")
            try:
                return self.reg.placement(obj["$s"])
            except Exception as e:
                raise _fail(where, f"bad placement {obj['$s']!r} ({e})") from None
        if keys == {"$t", "$f"}:
            return self.object(obj["$t"], obj["$f"], where)
        raise _fail(where, f"unexpected object with keys {sorted(map(str, keys))}")

    def range(self, args: Any, where: str) -> list[int]:
        if not (isinstance(args, list) and len(args) == 3 and all(type(v) is int for v in args)):
            raise _fail(where, f"$range holds [start, stop, step] ints, got {args!r:.80}")
        start, stop, step = args
        if step == 0:
            raise _fail(where, "$range step 0")
        n = len(range(start, stop, step))
        if n < 4 or n > _MAX_EXPANSION or start + n * step != stop:
            raise _fail(where, f"$range {args} is not canonical (4 to {_MAX_EXPANSION} items)")
        key = (start, stop, step)
        items = self.ranges.get(key)
        if items is None:
            items = self.ranges[key] = tuple(range(start, stop, step))
        return list(items)

    def spec(self, fields: Any, where: str) -> Any:
        from fastinit.plan import compact

        if self.version < 2:
            return None
        if not (isinstance(fields, dict) and set(fields) == {"shards"}):
            raise _fail(where, "EnumerableShardingSpec holds exactly its shards")
        raw = fields["shards"]
        if not (isinstance(raw, dict) and set(raw) == {"$runs"} and isinstance(raw["$runs"], list)):
            raise _fail(f"{where}.shards", 'expected {"$runs": [...]}')
        try:
            runs = [layout.ShardRun.from_json(r) for r in raw["$runs"]]
            if sum(r.count for r in runs) > _MAX_EXPANSION:
                raise layout.LayoutError(f"more than {_MAX_EXPANSION} shards")
            layout.check_runs(runs)
        except layout.LayoutError as e:
            raise _fail(f"{where}.shards", str(e)) from None
        if self.expansions is None:
            self.expansions = layout.Expansions()
        return compact.CompactShardingSpec(runs, self.expansions)

    def list(self, obj: dict[str, Any], key: str, where: str) -> list[Any]:
        items = obj[key]
        if not isinstance(items, list):
            raise _fail(where, f"{key} must hold a list, got {type(items).__name__}")
        return items

    def enum(self, name: Any, member: Any, where: str) -> enum.Enum:
        cls = self.reg.enums.get(name) if isinstance(name, str) else None
        if cls is None:
            raise _fail(where, f"enum {name!r} is not in the codec's allowlist")
        if not isinstance(member, str) or member not in cls.__members__:
            raise _fail(where, f"{name} has no member {member!r}")
        return cls.__members__[member]

    def object(self, name: Any, fields: Any, where: str) -> Any:
        cls = self.reg.objects.get(name) if isinstance(name, str) else None
        if cls is None:
            raise _fail(where, f"type {name!r} is not in the codec's allowlist")
        if not isinstance(fields, dict):
            raise _fail(where, f"the fields of {name} must be an object")
        if name == "EnumerableShardingSpec":
            spec = self.spec(fields, where)
            if spec is not None:
                return spec
        known = _field_names(cls)
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise _fail(where, f"{name} has no field(s) {unknown}")
        hints = self.reg.hints.get(name, {})
        kwargs: dict[str, Any] = {}
        for field, raw in fields.items():
            value = self.value(raw, f"{where}.{field}")
            hint = hints.get(field, Any)
            # a $range is a list of ints by construction: check the hint on its first items
            sample = value[:2] if isinstance(raw, dict) and "$range" in raw else value
            if not _matches(sample, hint):
                raise _fail(
                    f"{where}.{field}",
                    f"expected {_type_name(hint)}, got {type(value).__name__} {value!r:.80}",
                )
            kwargs[field] = value
        try:
            return cls(**kwargs)
        except Exception as e:
            raise _fail(where, f"cannot build {name}: {type(e).__name__}: {e}") from None

    def module_plan(self, obj: Any, where: str) -> Any:
        from torchrec.distributed.types import (
            EmbeddingModuleShardingPlan,
            ModuleShardingPlan,
            ParameterSharding,
        )

        if isinstance(obj, dict) and set(obj) == {"$t", "$items"}:
            if obj["$t"] != _EMBEDDING_PLAN:
                raise _fail(where, f"unknown module plan type {obj['$t']!r}")
            out = EmbeddingModuleShardingPlan()
            for i, item in enumerate(self.list(obj, "$items", where)):
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise _fail(f"{where}[{i}]", "expected [parameter name, ParameterSharding]")
                name, raw = item
                if name in out:
                    raise _fail(where, f"parameter {name!r} appears twice")
                ps = self.value(raw, f"{where}[{name!r}]")
                if not isinstance(ps, ParameterSharding):
                    raise _fail(f"{where}[{name!r}]", "expected a ParameterSharding")
                out[name] = ps
            return out
        plan = self.value(obj, where)
        if not isinstance(plan, ModuleShardingPlan):
            raise _fail(where, "expected a module sharding plan")
        return plan


def decode_plan(data: bytes) -> ShardingPlan:
    """Decodes bytes written by :func:`encode_plan`; never executes code named in the data.

    Args:
        data: the encoded plan (possibly untrusted).

    Returns:
        The ``ShardingPlan``, with modules and parameters in their encoded order.

    Raises:
        PlanDecodeError: the bytes are truncated, foreign (wrong magic), of another format
            version, not canonical JSON, or hold a type or value the plan cannot have.
    """
    from torchrec.distributed.types import ShardingPlan

    if not isinstance(data, bytes | bytearray | memoryview):
        raise PlanDecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER_LEN:
        if MAGIC.startswith(data[: len(MAGIC)]):
            raise PlanDecodeError(f"truncated plan: {len(data)} bytes, header needs {_HEADER_LEN}")
        raise PlanDecodeError("not a fastinit plan (wrong magic)")
    if data[: len(MAGIC)] != MAGIC:
        raise PlanDecodeError(
            f"not a fastinit plan (wrong magic {data[: len(MAGIC)]!r}, expected {MAGIC!r})"
        )
    (version,) = _HEADER.unpack_from(data, len(MAGIC))
    if version not in _READABLE_VERSIONS:
        raise PlanDecodeError(
            f"plan format version {version} is not supported (this fastinit reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))})"
        )
    try:
        root = json.loads(data[_HEADER_LEN:].decode("utf-8"), parse_constant=_no_constant)
    except PlanDecodeError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PlanDecodeError(
            f"truncated or malformed plan body: {type(e).__name__}: {e}"
        ) from None
    if not (isinstance(root, dict) and set(root) == {"plan"} and isinstance(root["plan"], list)):
        raise PlanDecodeError('malformed plan: the body must be {"plan": [...]}')
    decoder = _Decoder(version)
    modules: dict[str, Any] = {}
    try:
        for i, item in enumerate(root["plan"]):
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise _fail(f"plan[{i}]", "expected [module path, module plan]")
            path, raw = item
            if path in modules:
                raise _fail("plan", f"module {path!r} appears twice")
            modules[path] = decoder.module_plan(raw, f"plan[{path!r}]")
    except RecursionError:
        raise PlanDecodeError("malformed plan: nested too deeply") from None
    return ShardingPlan(plan=modules)


def _no_constant(name: str) -> Any:
    raise PlanDecodeError(f"malformed plan body: bare {name} is not canonical JSON")
