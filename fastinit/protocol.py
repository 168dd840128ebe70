"""fastinit's start-up messages: one record exchange, at most one plan message, one digest check.

Every message goes through :class:`Channel`, on the device the process group's backend serves
(:func:`comm_device`), with a bounded wait that raises :class:`~fastinit.errors.StartupError`.

1. :func:`exchange` — one ``all_gather`` of a fixed-size :class:`Record` per rank, then
   :func:`check_records`: the same error, of the same class, on every rank when any rank failed
   or the ranks disagree (model structure, planner inputs, explicit plans, ``init_parameters``,
   ``init_tables``).
2. :func:`agree_on_plan` — no message when every rank holds the same plan; otherwise one
   ``broadcast`` of the encoded plan from the first rank that holds it, checked against its digest.
3. :func:`verify_replicas` — after construction, one ``all_reduce`` of per-tensor digests of
   every replicated value (dense parameters and buffers, data-parallel tables), computed on the
   tensors' own device; only if some differ, one broadcast of rank 0's values of those tensors.

The layout of the record, the device rules and what a timeout does are in ``docs/startup.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import operator
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fastinit import errors, knobs, trace
from fastinit.errors import ReplicaMismatchWarning, StartupError, StartupMismatchError
from fastinit.plan.codec import decode_plan

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

__all__ = [
    "Channel",
    "Record",
    "ReplicaMismatchWarning",
    "agree_on_plan",
    "agreed_seed",
    "check_records",
    "comm_device",
    "exchange",
    "explicit_seeds",
    "normalize_seed",
    "Records",
    "PLAN_SOURCES",
    "build_record",
    "column",
    "plan_source",
    "replicated_tensors",
    "structure_of",
    "tensor_digests",
    "verify_replicas",
]

RECORD_VERSION = 2
_CLASS_BYTES = 32
_ERROR_BYTES = 384
#: The record's fields in wire order, each with its ``struct`` format; the struct, its size and
#: every field's offset (:data:`_FIELDS`) are derived from this one list.
_LAYOUT: tuple[tuple[str, str], ...] = (
    ("version", "B"),
    ("flags", "H"),
    ("fingerprint", "32s"),  # the planner fingerprint (the plan-cache key)
    ("structure", "32s"),  # sha256 of structure_of(module)
    ("plan_digest", "32s"),  # sha256 of the encoded plan this rank holds
    ("plan_len", "Q"),
    ("structure_len", "Q"),
    ("seed", "Q"),
    ("error_class", f"{_CLASS_BYTES}s"),
    ("error_len", "H"),
    ("error", f"{_ERROR_BYTES}s"),
)
_RECORD = struct.Struct("<" + "".join(fmt for _, fmt in _LAYOUT))


def _field_offsets(layout: Sequence[tuple[str, str]]) -> dict[str, tuple[int, int, bool]]:
    """``name -> (offset, size, is an int)`` of every field of a little-endian, unpadded
    ``struct`` layout."""
    out: dict[str, tuple[int, int, bool]] = {}
    offset = 0
    for name, fmt in layout:
        size = struct.calcsize("<" + fmt)
        out[name] = (offset, size, not fmt.endswith("s"))
        offset += size
    return out


#: Where each column of a packed record lies (the fields :meth:`Records.column` reads: the
#: record's fixed-size values, not the version or the error text): ``(offset, size, int?)``.
_FIELDS = {
    name: where
    for name, where in _field_offsets(_LAYOUT).items()
    if name not in ("version", "error_class", "error_len", "error")
}

HAS_PLAN = 1 << 0  # holds a plan (explicit, cached or planned here)
EXPLICIT = 1 << 1  # the plan was passed to setup
FAILED = 1 << 2  # this rank failed before the exchange; error class and text say how
VALIDATE = 1 << 3  # TorchRec's collective validation, as this rank resolved it
PLANNED = 1 << 4  # this rank ran the planner
FROM_CACHE = 1 << 5  # the plan came from the plan cache
SEED_GIVEN = 1 << 6  # ``seed=`` was passed (not torch.initial_seed())
INIT_PARAMETERS = 1 << 7  # setup(init_parameters=True)
DEFER_TABLES = 1 << 8  # setup(init_tables=False)

_MASK63 = (1 << 63) - 1
_DIGEST_MASK = (1 << 62) - 1  # digests are in [1, 2**62): negation cannot overflow int64
_META_DIGEST = 0
_CHECKSUM_CHUNK = 1 << 24  # elements per step of the device-side checksum


# -- the record ------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Record:
    """What one rank brings to the exchange; :meth:`pack` is always ``Record.SIZE`` bytes."""

    flags: int = 0
    fingerprint: bytes = b"\0" * 32
    structure: bytes = b"\0" * 32
    plan_digest: bytes = b"\0" * 32
    plan_len: int = 0
    structure_len: int = 0
    seed: int = 0
    error_class: str = ""
    error: str = ""

    SIZE = _RECORD.size

    @property
    def has_plan(self) -> bool:
        """This rank holds a plan (explicit, cached or planned here)."""
        return bool(self.flags & HAS_PLAN)

    @property
    def planned(self) -> bool:
        """This rank ran the planner."""
        return bool(self.flags & PLANNED)

    @property
    def validate(self) -> bool:
        """TorchRec's collective validation is on, as this rank resolved it."""
        return bool(self.flags & VALIDATE)

    def pack(self) -> bytes:
        """The record's ``Record.SIZE`` bytes (the error text truncated to fit)."""
        err = self.error.encode("utf-8", "replace")[:_ERROR_BYTES]
        return _RECORD.pack(
            RECORD_VERSION,
            self.flags,
            self.fingerprint,
            self.structure,
            self.plan_digest,
            self.plan_len,
            self.structure_len,
            self.seed,
            self.error_class.encode("ascii", "replace")[:_CLASS_BYTES],
            len(err),
            err,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Record:
        """The record packed in ``data``.

        Raises:
            StartupError: ``data`` was packed by another record version.
        """
        (version, flags, fp, st, pd, plen, slen, seed, ecls, elen, err) = _RECORD.unpack(data)
        if version != RECORD_VERSION:
            raise StartupError(
                f"start-up record version {version}, expected {RECORD_VERSION}: every rank must "
                "run the same fastinit"
            )
        return cls(
            flags=flags,
            fingerprint=fp,
            structure=st,
            plan_digest=pd,
            plan_len=plen,
            structure_len=slen,
            seed=seed,
            error_class=ecls.rstrip(b"\0").decode("ascii", "replace"),
            error=err[:elen].decode("utf-8", "replace"),
        )

    def fail(self, exc: BaseException) -> None:
        """Mark this record failed with ``exc`` (its fastinit class travels with it)."""
        self.flags |= FAILED
        cls = type(exc)
        known = isinstance(exc, StartupError | errors.CompatibilityError)
        self.error_class = cls.__name__ if known else ""
        self.error = f"{cls.__name__}: {exc}"


#: Where a rank's plan came from before the exchange (``build_record``'s ``source``).
PLAN_SOURCES = ("explicit", "cache", "planned")
_SOURCE_FLAGS = {"explicit": EXPLICIT, "cache": FROM_CACHE, "planned": PLANNED}


def build_record(
    *,
    structure: bytes,
    init_parameters: bool,
    init_tables: bool = True,
    validate: bool = False,
    seed: int = 0,
    seed_given: bool = False,
    fingerprint: bytes | None = None,
    source: str | None = None,
    encoded: bytes | None = None,
    failure: BaseException | None = None,
) -> Record:
    """This rank's record, from what its preparation found; the only place a record is filled.

    Args:
        structure: :func:`structure_of` the module (its digest and length travel).
        init_parameters: ``setup``'s ``init_parameters``.
        init_tables: ``setup``'s ``init_tables``.
        validate: TorchRec's collective validation, as this rank resolved it.
        seed: the seed, already normalised (:func:`normalize_seed`).
        seed_given: ``seed=`` was passed (not ``torch.initial_seed()``).
        fingerprint: the planner fingerprint (zeros when preparation failed before it).
        source: where the plan came from (``"explicit"``: passed to ``setup``, set even when its
            checks failed): one of :data:`PLAN_SOURCES`, or None (none here yet).
        encoded: the encoded plan this rank holds (its digest and length travel), or None.
        failure: the exception preparation raised, or None.

    Returns:
        The :class:`Record` (``Record.SIZE`` bytes when packed).
    """
    if source is not None and source not in PLAN_SOURCES:
        raise ValueError(f"plan source {source!r}: one of {PLAN_SOURCES} or None")
    record = Record(
        structure=hashlib.sha256(structure).digest(),
        structure_len=len(structure),
        seed=seed,
    )
    flags = INIT_PARAMETERS if init_parameters else 0
    flags |= 0 if init_tables else DEFER_TABLES
    flags |= (VALIDATE if validate else 0) | (SEED_GIVEN if seed_given else 0)
    if fingerprint is not None:
        record.fingerprint = fingerprint
    if source is not None:
        flags |= _SOURCE_FLAGS[source]
    if encoded is not None:
        record.plan_digest = hashlib.sha256(encoded).digest()
        record.plan_len = len(encoded)
        flags |= HAS_PLAN
    record.flags = flags
    if failure is not None:
        record.fail(failure)
    return record


def plan_source(record: Record) -> str:
    """Where ``record``'s rank got its plan: one of :data:`PLAN_SOURCES`, or ``"received"``."""
    if record.flags & EXPLICIT:
        return "explicit"
    if record.flags & FROM_CACHE:
        return "cache"
    if record.flags & PLANNED:
        return "planned"
    return "received"


def normalize_seed(seed: int) -> int:
    """A seed in ``[0, 2**63)``: itself when already there, else a hash of its decimal digits.

    Any Python int works (negative, ``>= 2**63``); the same input gives the same seed in every
    process. Raises ``TypeError`` for a non-integer.
    """
    value = operator.index(seed)
    if 0 <= value <= _MASK63:
        return value
    digest = hashlib.sha256(f"fastinit-seed\0{value}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


def structure_of(module: nn.Module) -> bytes:
    """Every parameter and buffer of ``module``: one ``name kind shape dtype`` line each, sorted.

    Its sha256 is the record's structure digest; its length travels too, so ranks that differ
    can exchange the lists themselves and name the first difference.
    """
    lines = []
    for kind, named in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            shape = "x".join(str(d) for d in t.shape)
            lines.append(f"{name}\t{kind}\t[{shape}]\t{str(t.dtype).removeprefix('torch.')}")
    lines.sort()
    return "\n".join(lines).encode("utf-8")


# -- the channel: every start-up message, on the group's device ---------------------------------


def comm_device(pg: dist.ProcessGroup | None, device: torch.device | None = None) -> torch.device:
    """The device start-up messages travel on for ``pg``.

    CPU whenever the group has a backend for CPU tensors (gloo, ``cpu:gloo,cuda:nccl``, the fake
    backend); otherwise CUDA (a plain NCCL group): ``device`` when it is a CUDA device with an
    index, else the group's bound device, else the current CUDA device.
    """
    if pg is None:
        return torch.device("cpu")
    types = {d.type for d in getattr(pg, "_device_types", ())}
    if not types:  # no per-device backends reported: go by the backend's name
        types = {"cuda"} if dist.get_backend(pg) == "nccl" else {"cpu"}
    if "cpu" in types:
        return torch.device("cpu")
    kind = "cuda" if "cuda" in types else sorted(types)[0]
    if device is not None and device.type == kind and device.index is not None:
        return device
    bound = getattr(pg, "bound_device_id", None)
    if bound is not None and bound.type == kind:
        return torch.device(bound)
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


class Channel:
    """Start-up collectives on ``pg``, on its device, each waited on for at most the timeout.

    Counts what it sends (``collectives``, ``bytes``). With ``pg`` None it sends nothing and
    every method returns this rank's own data: ``setup`` passes None for a world of one. A group
    of one rank still runs real collectives (``make gpu-check`` exercises NCCL that way).

    Args:
        pg: the process group (None: a world of one).
        device: setup's compute device (picks the CUDA device on an NCCL group).
    """

    def __init__(self, pg: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
        self.pg = pg
        self.world_size = dist.get_world_size(pg) if pg is not None else 1
        self.rank = dist.get_rank(pg) if pg is not None else 0
        self.device = comm_device(pg, device)
        self.timeout = knobs.get_collective_timeout()  # a bad value raises before any message
        self.collectives = 0
        self.bytes = 0
        self.ops: list[str] = []

    def _on_device(self) -> Any:
        if self.device.type == "cuda":
            # The current CUDA device is per thread: set it on the thread issuing the collective.
            return torch.cuda.device(self.device)

        return contextlib.nullcontext()

    def _wait(self, work: Any, what: str) -> None:
        timeout = self.timeout
        try:
            work.wait(timedelta(seconds=timeout))
        except Exception as e:
            raise StartupError(
                f"fastinit.setup on rank {self.rank}: the {what} failed — a peer died, hung or "
                f"has not called fastinit.setup (FASTINIT_COLLECTIVE_TIMEOUT={timeout:.0f}s): {e}"
            ) from e

    def _count(self, what: str, nbytes: int) -> None:
        self.collectives += 1
        self.bytes += nbytes
        self.ops.append(what)

    def _tensor(self, data: bytes | bytearray) -> torch.Tensor:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
        return t.to(dtype=torch.uint8, device=self.device)

    def all_gather_bytes(self, data: bytes, size: int, what: str) -> list[bytes]:
        """Every rank's ``data`` (each padded to ``size`` bytes)."""
        if self.pg is None:
            return [data]
        padded = data + b"\0" * (size - len(data))
        with self._on_device():
            mine = self._tensor(padded)
            # every rank's bytes land in one buffer, read back at once: one copy and one bytes
            # object per rank, not a tensor, a host copy and an array per rank
            flat = torch.empty((self.world_size, size), dtype=mine.dtype, device=mine.device)
            work = dist.all_gather(list(flat.unbind(0)), mine, group=self.pg, async_op=True)
            self._count(what, size)
            self._wait(work, what)
            data = flat.cpu().numpy().tobytes()
            return [data[r * size : (r + 1) * size] for r in range(self.world_size)]

    def broadcast_bytes(self, data: bytes | None, size: int, src: int, what: str) -> bytes:
        """``data`` of group rank ``src`` (``size`` bytes) on every rank."""
        if self.pg is None:
            assert data is not None
            return data
        with self._on_device():
            if self.rank == src:
                assert data is not None
                buf = self._tensor(data)
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            work = dist.broadcast(
                buf, src=dist.get_global_rank(self.pg, src), group=self.pg, async_op=True
            )
            self._count(what, size if self.rank == src else 0)
            self._wait(work, what)
            return bytes(buf.cpu().numpy())

    def all_reduce_max(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """The element-wise maximum of ``values`` (int64) over the ranks, on the CPU."""
        if self.pg is None:
            return values.cpu()
        with self._on_device():
            buf = values.to(self.device)
            work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.pg, async_op=True)
            self._count(what, buf.numel() * buf.element_size())
            self._wait(work, what)
            return buf.cpu()

    @torch.no_grad()
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int, what: str) -> None:
        """Group rank ``src``'s values of ``tensors`` into every rank's, in one broadcast."""
        if self.pg is None or not tensors:
            return
        sizes = [t.numel() * t.element_size() for t in tensors]
        with self._on_device():
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            if self.rank == src:
                offset = 0
                for t, n in zip(tensors, sizes, strict=True):
                    flat[offset : offset + n].copy_(_as_bytes(t))
                    offset += n
            work = dist.broadcast(
                flat, src=dist.get_global_rank(self.pg, src), group=self.pg, async_op=True
            )
            self._count(what, flat.numel() if self.rank == src else 0)
            self._wait(work, what)
            if self.rank != src:
                offset = 0
                for t, n in zip(tensors, sizes, strict=True):
                    _copy_bytes_into(t, flat[offset : offset + n])
                    offset += n


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _copy_bytes_into(t: torch.Tensor, data: torch.Tensor) -> None:
    data = data.to(t.device)
    if t.is_contiguous():
        t.detach().reshape(-1).view(torch.uint8).copy_(data)
    else:
        t.detach().copy_(data.clone().view(t.dtype).reshape(t.shape))  # clone: aligned


# -- 1. the record exchange --------------------------------------------------------------------


class Records(Sequence[Record]):
    """Every rank's record, kept as the bytes received and unpacked when read: at 8,192 ranks,
    no 8,192 long-lived objects for the garbage collector to trace."""

    def __init__(self, data: Sequence[bytes]) -> None:
        self._data = data
        for d in data:  # every record's version, checked once
            if d[0] != RECORD_VERSION:
                Record.unpack(d)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [Record.unpack(d) for d in self._data[index]]
        return Record.unpack(self._data[index])

    def __iter__(self) -> Iterator[Record]:
        return (Record.unpack(d) for d in self._data)

    def column(self, field: str) -> list[Any]:
        """Field ``field`` of every rank's record, read from the bytes (no record built)."""
        start, size, is_int = _FIELDS[field]
        end = start + size
        if is_int:
            return [int.from_bytes(d[start:end], "little") for d in self._data]
        return [d[start:end] for d in self._data]


def column(records: Sequence[Record], field: str) -> list[Any]:
    """Field ``field`` of every record, by rank."""
    if isinstance(records, Records):
        return records.column(field)
    return [getattr(rec, field) for rec in records]


def exchange(channel: Channel, mine: Record, structure: bytes) -> Records:
    """One ``all_gather`` of the records, then :func:`check_records` (raises on every rank)."""
    with trace.span("fastinit.record_all_gather"):
        data = channel.all_gather_bytes(mine.pack(), Record.SIZE, "start-up record all_gather")
        records = Records(data)
    check_records(records, channel, structure)
    return records


def _group_ranks(values: Sequence[bytes]) -> str:
    groups: dict[bytes, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return "; ".join(f"ranks {ranks} have {v.hex()[:12]}" for v, ranks in groups.items())


def _error_class(names: Iterable[str]) -> type[StartupError]:
    found = {getattr(errors, n, None) for n in names}
    if len(found) == 1:
        cls = found.pop()
        if isinstance(cls, type) and issubclass(cls, StartupError):
            return cls
    return StartupError


def check_records(
    records: Sequence[Record], channel: Channel | None = None, structure: bytes = b""
) -> None:
    """Raise the same error on every rank unless the records agree.

    In order: a rank that failed before the exchange (its error class, e.g.
    :class:`~fastinit.errors.PlanMismatchError`, is raised as itself when every failing rank
    reports the same class; otherwise :class:`StartupError`), ``init_parameters`` or
    ``init_tables`` that differs,
    an explicit plan on some ranks only or different explicit plans, a different model structure
    (naming the first differing parameter or buffer; this gathers the ranks' structure lists,
    one extra collective on this error path only), different planner inputs.
    """
    flags = column(records, "flags")
    failed = [(r, records[r]) for r, f in enumerate(flags) if f & FAILED]
    if failed:
        by_text: dict[str, list[int]] = {}
        for r, rec in failed:
            by_text.setdefault(rec.error, []).append(r)
        lines = "; ".join(f"ranks {ranks}: {text}" for text, ranks in by_text.items())
        cls = _error_class(rec.error_class for _, rec in failed)
        raise cls(f"fastinit.setup failed on {len(failed)} rank(s): {lines}")
    init = [bool(f & INIT_PARAMETERS) for f in flags]
    if len(set(init)) > 1:
        ranks = [r for r, v in enumerate(init) if v]
        raise StartupMismatchError(
            f"init_parameters=True on ranks {ranks} only; pass the same value on every rank"
        )
    deferred = [bool(f & DEFER_TABLES) for f in flags]
    if len(set(deferred)) > 1:
        ranks = [r for r, v in enumerate(deferred) if v]
        raise StartupMismatchError(
            f"init_tables=False on ranks {ranks} only; pass the same value on every rank"
        )
    explicit = [bool(f & EXPLICIT) for f in flags]
    if any(explicit) and not all(explicit):
        ranks = [r for r, e in enumerate(explicit) if e]
        raise StartupMismatchError(
            f"an explicit plan was passed on ranks {ranks} only; pass it on every rank or none"
        )
    if all(explicit):
        digests = column(records, "plan_digest")
        if len(set(digests)) > 1:
            raise StartupMismatchError(
                "ranks were given different explicit plans: " + _group_ranks(digests)
            )
    structures = column(records, "structure")
    if len(set(structures)) > 1:
        first = ""
        if channel is not None:
            lengths = column(records, "structure_len")
            lists = channel.all_gather_bytes(
                structure, max(lengths), "structure all_gather (error path)"
            )
            first = _first_difference([s[:n] for s, n in zip(lists, lengths, strict=True)])
        raise StartupMismatchError(
            "the model differs across ranks (parameter and buffer names, shapes, dtypes): "
            + _group_ranks(structures)
            + (f". First difference: {first}" if first else "")
            + ". Every rank must build the same model."
        )
    fps = column(records, "fingerprint")
    if len(set(fps)) > 1:
        raise StartupMismatchError(
            "planner inputs differ across ranks (module tables, sharders, topology, constraints "
            "or planner settings): " + _group_ranks(fps) + ". Every rank must build the same model."
        )
    if not any(f & HAS_PLAN for f in flags):
        raise StartupError("no rank holds a plan after planning (internal error)")


def _first_difference(lists: Sequence[bytes]) -> str:
    """The first name (in sorted order) whose entry differs across the ranks' structure lists."""
    entries: list[dict[str, str]] = []
    for data in lists:
        table = {}
        for line in data.decode("utf-8", "replace").split("\n"):
            if line:
                name, _, rest = line.partition("\t")
                table[name] = rest.replace("\t", " ")
        entries.append(table)
    for name in sorted(set().union(*entries)):
        seen: dict[str, list[int]] = {}
        for r, table in enumerate(entries):
            seen.setdefault(table.get(name, "missing"), []).append(r)
        if len(seen) > 1:
            sides = "; ".join(f"{desc} on ranks {ranks}" for desc, ranks in seen.items())
            return f"{name!r}: {sides}"
    return ""


def explicit_seeds(records: Sequence[Record]) -> list[int]:
    """Every rank's seed, by rank, when any rank passed ``seed=``; else empty."""
    if any(f & SEED_GIVEN for f in column(records, "flags")):
        return column(records, "seed")
    return []


def agreed_seed(records: Sequence[Record]) -> int:
    """Rank 0's seed, which every rank uses; warns when explicit seeds differ across ranks."""
    seeds = column(records, "seed")
    given = [bool(f & SEED_GIVEN) for f in column(records, "flags")]
    if any(given) and len(set(seeds)) > 1:
        groups: dict[int, list[int]] = {}
        for r, s in enumerate(seeds):
            groups.setdefault(s, []).append(r)
        listing = "; ".join(f"seed {s} on ranks {ranks}" for s, ranks in groups.items())
        warnings.warn(
            f"fastinit.setup: ranks passed different seeds ({listing}); every rank uses rank 0's "
            f"seed {seeds[0]}, so replicated values agree",
            ReplicaMismatchWarning,
            stacklevel=3,
        )
    return seeds[0]


# -- 2. the plan -------------------------------------------------------------------------------


def agree_on_plan(
    channel: Channel, records: Sequence[Record], encoded: bytes | None
) -> tuple[ShardingPlan, bytes] | None:
    """The plan every rank uses: None when every rank already holds the same one (keep yours),
    else the plan of the first rank holding one and its bytes as they travelled, in one
    broadcast checked against its digest."""
    holders = [r for r, f in enumerate(column(records, "flags")) if f & HAS_PLAN]
    src = holders[0]
    if len(holders) == len(records) and len(set(column(records, "plan_digest"))) == 1:
        return None

    source = records[src]
    with trace.span("fastinit.plan_broadcast"):
        data = channel.broadcast_bytes(
            encoded if channel.rank == src else None, source.plan_len, src, "plan broadcast"
        )
    if hashlib.sha256(data).digest() != source.plan_digest:
        raise StartupError(
            f"rank {channel.rank}: the plan received from rank {src} fails its digest check"
        )
    return decode_plan(data), data


# -- 3. the replicated values ------------------------------------------------------------------


def replicated_tensors(module: nn.Module, plan: ShardingPlan) -> list[tuple[str, torch.Tensor]]:
    """Every value that must be equal on all ranks, sorted by name: the parameters and buffers
    outside the sharded modules, and the data-parallel tables inside them.

    Args:
        module: the sharded model's module (``DistributedModelParallel.module``).
        plan: its plan.
    """
    modules = dict(module.named_modules())
    sharded = [p for p in plan.plan if p in modules]
    out: dict[str, torch.Tensor] = {}
    if "" not in sharded:
        prefixes = tuple(f"{p}." for p in sharded)
        for named in (module.named_parameters(), module.named_buffers()):
            for name, t in named:
                if not name.startswith(prefixes):
                    out[name] = t
    for path in sharded:
        module_plan = plan.plan[path]
        if not isinstance(module_plan, Mapping):
            continue
        dp = {n for n, ps in module_plan.items() if ps.sharding_type == "data_parallel"}
        if not dp:
            continue
        prefix = f"{path}." if path else ""
        for name, t in modules[path].named_parameters():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in dp:
                out[prefix + name] = t
    return sorted(out.items())


def _fold(digest: bytes) -> int:
    return (int.from_bytes(digest[:8], "little") & _DIGEST_MASK) or 1


def _header(t: torch.Tensor) -> bytes:
    return f"{t.dtype}|{list(t.shape)}".encode()


def _cpu_digest(t: torch.Tensor) -> int:
    h = hashlib.sha256(_header(t))
    if t.numel():
        h.update(_as_bytes(t).numpy().data)
    return _fold(h.digest())


def device_checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted integer checksum of ``t``'s bytes, computed on ``t``'s device: a
    one-element int64 tensor in ``[1, 2**62)``. Integer sums are exact, so it is the same
    whatever the reduction order; only 2 scalars per chunk of 16 Mi elements reach memory."""
    raw = _as_bytes(t)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    n = words.numel()
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, n, _CHECKSUM_CHUNK):
        chunk = words[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(
            start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=t.device
        )
        s1 += chunk.sum()
        s2 += (chunk * (weights * 0x9E3779B1)).sum()
    head = _fold(hashlib.sha256(_header(t)).digest())
    mixed = (s2 * 0x5851F42D4C957F2D + s1 * 0x2545F491 + head) & _DIGEST_MASK
    return torch.where(mixed == 0, torch.ones_like(mixed), mixed)


def tensor_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 digest per tensor, computed where the tensor lives: sha256 of the bytes for a
    CPU tensor, :func:`device_checksum` on an accelerator (no copy of the values to the host).
    A tensor still on the meta device gets 0."""
    values: list[torch.Tensor] = []
    for t in tensors:
        if t.device.type == "meta" or t.layout != torch.strided:
            values.append(torch.tensor(_META_DIGEST, dtype=torch.int64))
        elif t.device.type == "cpu":
            values.append(torch.tensor(_cpu_digest(t), dtype=torch.int64))
        else:
            values.append(device_checksum(t))
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    devices = {v.device for v in values}
    if len(devices) > 1:
        values = [v.cpu() for v in values]
    return torch.stack(values)


def verify_replicas(
    channel: Channel,
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    seeds: Sequence[int] = (),
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Check that every rank holds the same ``named`` tensors; where not, broadcast rank 0's.

    One ``all_reduce`` (max of ``digest`` and of ``-digest``: equal everywhere iff max == -max of
    the negated) of one int64 per tensor, whatever the world size; then, only if some differ, one
    broadcast of those tensors' bytes from rank 0, with a :class:`ReplicaMismatchWarning` naming
    them (and the ranks' seeds, when they differ).

    Args:
        channel: the start-up channel.
        named: ``(name, tensor)`` in the same order on every rank (:func:`replicated_tensors`).
        seeds: every rank's seed, from the records (named in the warning when they differ).
        log: where to report (besides the warning).

    Returns:
        The names of the tensors that differed and were broadcast.
    """
    if channel.pg is None or not named:
        return []
    with trace.span("fastinit.verify_replicas", tensors=len(named)):
        digests = tensor_digests([t for _, t in named])
        reduced = channel.all_reduce_max(torch.cat([digests, -digests]), "replica digest check")
        n = len(named)
        high, low = reduced[:n], -reduced[n:]
        differ = [i for i in range(n) if int(high[i]) != int(low[i])]
        meta = [named[i][0] for i in differ if int(low[i]) == _META_DIGEST]
        if meta:
            raise StartupMismatchError(
                f"{len(meta)} replicated tensor(s) are still on the meta device on some ranks "
                f"only, e.g. {meta[:3]}; materialise them the same way on every rank"
            )
        if not differ:
            return []
        names = [named[i][0] for i in differ]
        with trace.span("fastinit.replica_broadcast", tensors=len(names)):
            channel.broadcast_tensors([named[i][1] for i in differ], 0, "replica broadcast")
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    message = (
        f"fastinit.setup: {len(names)} replicated tensor(s) differed across ranks and were set "
        f"to rank 0's values: {shown}"
    )
    if len(set(seeds)) > 1:
        message += f" (the ranks passed different seeds, by rank: {list(seeds)})"
    warnings.warn(message, ReplicaMismatchWarning, stacklevel=3)
    if log is not None:
        log(message)
    return names
