"""Shard layouts as rules: a sharding spec whose size does not grow with the number of ranks.

A row-wise table on N ranks has N shards, but they follow a rule: ranks ``r0, r0 + 1, ...``, a
block of rows each, a remainder, then empty shards. :class:`ShardRun` is that rule for a stretch of
consecutive shards (``count`` shards of the same sizes, offsets and rank advancing by a fixed step,
the device either the same string or ``rank % modulus``); a spec is a short tuple of runs.
Row-wise, table-row-wise, column blocks and grid shards are at most a few runs per table at any
world size; an irregular layout is one run per shard, exactly as long as before.

:func:`runs_of` finds the runs of a shard list (greedy, maximal, so the runs of a layout are
unique: the codec writes them and the same shards are always the same bytes). This module
imports no torch at import time; the ``EnumerableShardingSpec`` that holds only the runs,
``CompactShardingSpec``, lives in :mod:`fastinit.plan.compact`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
import re
from array import array
from collections.abc import Iterable, Iterator, MutableSequence, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from fastinit.errors import LayoutError

if TYPE_CHECKING:
    from torch.distributed._shard.metadata import ShardMetadata

__all__ = [
    "ShardRun",
    "SharedShards",
    "LazyShards",
    "Expansions",
    "runs_of",
    "check_runs",
    "validate_runs",
    "LayoutError",
]

_PLACEMENT = re.compile(r"^rank:(\d+)/(.+)$")
_INDEXED = re.compile(r"^([a-z_]+):(\d+)$")


@dataclasses.dataclass(frozen=True, slots=True)
class ShardRun:
    """``count`` consecutive shards following one rule.

    Shard ``j`` (``0 <= j < count``) has sizes ``sizes``, offsets ``offsets + j * step``, rank
    ``rank + j * rank_step`` and placement ``rank:<rank>/<device>`` where, if ``modulus`` is 0,
    ``device`` is the whole device string (``"cpu"``), else ``device`` is a device type and the
    index is the shard's rank modulo ``modulus`` (``"cuda"`` → ``cuda:<rank % modulus>``).
    A placement that names no rank (an RPC worker) is a run of one with ``rank`` None and
    ``device`` the whole placement string.
    """

    count: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    step: tuple[int, ...]
    rank: int | None
    rank_step: int
    device: str
    modulus: int

    def rank_at(self, j: int) -> int | None:
        return None if self.rank is None else self.rank + j * self.rank_step

    def placement_at(self, j: int) -> str:
        if self.rank is None:
            return self.device
        r = self.rank + j * self.rank_step
        if self.modulus:
            return f"rank:{r}/{self.device}:{r % self.modulus}"
        return f"rank:{r}/{self.device}"

    def offsets_at(self, j: int) -> list[int]:
        return [o + j * s for o, s in zip(self.offsets, self.step, strict=True)]

    def to_json(self) -> list[Any]:
        return [
            self.count,
            list(self.sizes),
            list(self.offsets),
            list(self.step),
            self.rank,
            self.rank_step,
            self.device,
            self.modulus,
        ]

    @classmethod
    def from_json(cls, obj: Any) -> ShardRun:
        if not (isinstance(obj, list) and len(obj) == 8):
            raise LayoutError(f"a shard run is a list of 8 items, got {obj!r:.80}")
        count, sizes, offsets, step, rank, rank_step, device, modulus = obj
        ints = (count, rank_step, modulus)
        if not all(type(v) is int for v in ints) or not (rank is None or type(rank) is int):
            raise LayoutError(f"a shard run's count, ranks and modulus are ints: {obj!r:.80}")
        vecs = (sizes, offsets, step)
        if not all(isinstance(v, list) and all(type(x) is int for x in v) for v in vecs):
            raise LayoutError(f"a shard run's sizes, offsets and step are int lists: {obj!r:.80}")
        if not isinstance(device, str):
            raise LayoutError(f"a shard run's device is a string: {obj!r:.80}")
        return cls(
            count, tuple(sizes), tuple(offsets), tuple(step), rank, rank_step, device, modulus
        )


# ---- finding the runs -----------------------------------------------------------------------------


def _parse(placement: Any) -> tuple[int | None, str, str | None, int | None]:
    """``(rank, device string, device type, device index)`` of a placement."""
    text = str(placement)
    m = _PLACEMENT.match(text)
    if m is None:
        return None, text, None, None
    device = m.group(2)
    d = _INDEXED.match(device)
    if d is None:
        return int(m.group(1)), device, None, None
    return int(m.group(1)), device, d.group(1), int(d.group(2))


def _spec_modulus(parsed: Sequence[tuple[int | None, str, str | None, int | None]]) -> int:
    """One more than the largest device index of the spec (0 if none): the canonical modulus."""
    top = -1
    for _, _, _, index in parsed:
        if index is not None and index > top:
            top = index
    return top + 1


def _form(
    p: tuple[int | None, str, str | None, int | None], modulus: int
) -> tuple[str, int] | None:
    """How a placement is written in a run: (device, modulus) or None for a rank-less one."""
    rank, device, dtype, index = p
    if rank is None:
        return None
    if dtype is not None and modulus and index == rank % modulus:
        return dtype, modulus
    return device, 0


#: Shard lists at least this long find their runs with numpy (:func:`_runs_of_array`).
_ARRAY_MIN = 32
_PARSED: dict[str, tuple[int | None, str, str | None, int | None]] = {}
_PARSED_MAX = 1 << 16


def _parse_cached(text: str) -> tuple[int | None, str, str | None, int | None]:
    got = _PARSED.get(text)
    if got is None:
        got = _parse(text)
        if len(_PARSED) < _PARSED_MAX:
            _PARSED[text] = got
    return got


def runs_of(shards: Sequence[ShardMetadata]) -> tuple[ShardRun, ...]:
    """The canonical runs of ``shards``: greedy and maximal, in shard order.

    A run starts at a shard and, if the next shard has the same sizes and the same placement form,
    takes the offset and rank differences of those two as its steps and extends while every
    further shard matches exactly. One pass over the shards; long lists (a row-wise table on
    thousands of ranks) compare their consecutive differences with numpy.
    """
    if len(shards) >= _ARRAY_MIN:
        got = _runs_of_array(shards)
        if got is not None:
            return got
    return _runs_of_list(shards)


def _runs_of_array(shards: Sequence[ShardMetadata]) -> tuple[ShardRun, ...] | None:
    """:func:`runs_of` on arrays of the shards' offsets, sizes and ranks: the Python work is a
    few C-level sweeps over the shards (one attribute each) and one step per run, no string or
    object per shard. None when the shards do not fit int64 arrays of one width (the list
    version decides those)."""
    import numpy as np

    n = len(shards)
    offs_l = list(map(operator.attrgetter("shard_offsets"), shards))
    sizes_l = list(map(operator.attrgetter("shard_sizes"), shards))
    if any(type(v) is not int for v in (*offs_l[0], *sizes_l[0])):
        return None  # e.g. bools or numpy ints: their runs hold what the list version keeps
    try:
        dims = set(map(len, chain(offs_l, sizes_l)))
        if len(dims) != 1:
            return None
        (d,) = dims
        # array("q") takes exactly what compares as an int (no floats, no strings)
        offs = np.frombuffer(array("q", chain.from_iterable(offs_l)), dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        return None
    offs = offs.reshape(n, d)
    # same_size[k]: shard k + 1 has shard k's sizes (compared as the list version compares)
    same_size = np.fromiter(map(operator.eq, sizes_l, sizes_l[1:]), dtype=bool, count=n - 1)
    got = _placement_arrays(list(map(operator.attrgetter("placement"), shards)))
    if got is None:
        return None
    fid, ranks, forms_by_id, rankless = got
    # eq[k]: shard k + 1 has shard k's sizes and placement form (one that names a rank)
    eq = (fid[1:] == fid[:-1]) & (fid[:-1] >= 0) & same_size
    diffs = np.concatenate([offs[1:] - offs[:-1], (ranks[1:] - ranks[:-1])[:, None]], axis=1)
    # cont[k]: shard k + 1 continues the run holding shards k - 1 and k (same step)
    cont = np.zeros(n, dtype=bool)
    if n > 2:
        cont[1:-1] = eq[1:] & eq[:-1] & (diffs[1:] == diffs[:-1]).all(axis=1)
    breaks = np.flatnonzero(~cont)
    runs: list[ShardRun] = []
    i = 0
    while i < n:
        sz = tuple(sizes_l[i])
        off = tuple(offs_l[i])
        if fid[i] < 0:
            runs.append(ShardRun(1, sz, off, (0,) * len(sz), None, 0, rankless[i], 0))
            i += 1
            continue
        form = forms_by_id[int(fid[i])]
        rank = int(ranks[i])
        if i + 1 >= n or not eq[i]:
            runs.append(ShardRun(1, sz, off, (0,) * len(sz), rank, 0, form[0], form[1]))
            i += 1
            continue
        k = int(breaks[np.searchsorted(breaks, i + 1)])  # the run's last shard
        step = diffs[i].tolist()
        runs.append(ShardRun(k - i + 1, sz, off, tuple(step[:-1]), rank, step[-1], *form))
        i = k + 1
    return tuple(runs)


def _placement_arrays(
    placements: list[Any],
) -> tuple[Any, Any, dict[int, tuple[str, int]], dict[int, str]] | None:
    """Per shard, the id of its placement form (-1: names no rank) and its rank (0 if none),
    as int64 arrays; the forms by id; the placement string of each rank-less shard.

    torch's own placements (``_remote_device`` objects of ``rank:<r>/<device>``) are read by
    attribute: their ranks as one array, their devices (a handful of distinct ones) parsed
    once each. Anything else is read through its string, one parse per distinct string. Both
    give what :func:`_parse` gives for ``str(placement)``.
    """
    import numpy as np

    n = len(placements)
    fast = _remote_placements(placements)
    if fast is not None:
        ranks, device_of, dev_texts = fast
        parsed = [_parse_device(t) for t in dev_texts]
        modulus = _spec_modulus([(0, t, dt, ix) for t, (dt, ix) in zip(dev_texts, parsed)])
        form_id: dict[tuple[str, int], int] = {}
        on_rule = np.empty(len(dev_texts), dtype=np.int64)  # form if index == rank % modulus
        off_rule = np.empty(len(dev_texts), dtype=np.int64)  # form otherwise
        index = np.full(len(dev_texts), -1, dtype=np.int64)
        for u, (t, (dtype, ix)) in enumerate(zip(dev_texts, parsed, strict=True)):
            off_rule[u] = form_id.setdefault((t, 0), len(form_id))
            if dtype is not None and modulus and ix is not None:
                on_rule[u] = form_id.setdefault((dtype, modulus), len(form_id))
                index[u] = ix
            else:
                on_rule[u] = off_rule[u]
        if len(dev_texts) == 1:
            matched = (index[0] == ranks % modulus) if modulus else np.zeros(n, dtype=bool)
            fid = np.where(matched, on_rule[0], off_rule[0])
        else:
            dev = device_of
            matched = (index[dev] == ranks % modulus) if modulus else np.zeros(n, dtype=bool)
            fid = np.where(matched, on_rule[dev], off_rule[dev])
        return fid, ranks, {v: k for k, v in form_id.items()}, {}
    texts = [str(p) for p in placements]
    unique = {t: _parse_cached(t) for t in dict.fromkeys(texts)}
    modulus = _spec_modulus(list(unique.values()))
    ids: dict[tuple[str, int] | None, int] = {None: -1}
    of_text: dict[str, int] = {}
    for t, p in unique.items():
        form = _form(p, modulus)
        of_text[t] = ids.setdefault(form, len(ids) - 1) if form is not None else -1
    fid = np.fromiter(map(of_text.__getitem__, texts), dtype=np.int64, count=n)
    ranks = np.fromiter(
        ((p[0] if p[0] is not None else 0) for p in map(unique.__getitem__, texts)),
        dtype=np.int64,
        count=n,
    )
    rankless = {int(i): texts[i] for i in np.flatnonzero(fid < 0)}
    forms = {v: k for k, v in ids.items() if k is not None}
    return fid, ranks, forms, rankless


def _parse_device(text: str) -> tuple[str | None, int | None]:
    """``(device type, device index)`` of a placement's device string, as :func:`_parse`."""
    d = _INDEXED.match(text)
    return (None, None) if d is None else (d.group(1), int(d.group(2)))


def _remote_placements(placements: list[Any]) -> tuple[Any, Any, list[str]] | None:
    """For placements that are all torch ``_remote_device`` objects naming a rank (no worker
    name) and a ``torch.device``: their ranks (int64), the index of each one's device among
    the distinct devices (int64; 0 when there is one), and the distinct devices' strings.
    None otherwise. ``str`` of such a placement is ``rank:<rank>/<device>`` (torch's
    ``__repr__``), so these give what parsing its string gives."""
    import numpy as np
    import torch
    from torch.distributed.remote_device import _remote_device

    if set(map(type, placements)) != {_remote_device}:
        return None
    if set(map(operator.attrgetter("_worker_name"), placements)) != {None}:
        return None
    rank_list = list(map(operator.attrgetter("_rank"), placements))
    if set(map(type, rank_list)) != {int}:
        return None  # None (no rank), or a rank torch's parser would not have made
    try:
        ranks = np.frombuffer(array("q", rank_list), dtype=np.int64)
    except OverflowError:
        return None
    if ranks.min() < 0:
        return None  # "rank:-1/..." names no rank
    devices = list(map(operator.attrgetter("_device"), placements))
    distinct = dict.fromkeys(devices)
    if any(type(d) is not torch.device for d in distinct):
        return None
    texts = [str(d) for d in distinct]
    if len(set(texts)) != len(texts) or not all(texts):
        return None  # equal strings of unequal devices: leave them to the string path
    if len(distinct) == 1:
        device_of = np.zeros(len(placements), dtype=np.int64)
    else:
        at = {d: i for i, d in enumerate(distinct)}
        device_of = np.fromiter(map(at.__getitem__, devices), dtype=np.int64, count=len(devices))
    return ranks, device_of, texts


def _runs_of_list(shards: Sequence[ShardMetadata]) -> tuple[ShardRun, ...]:
    parsed = [_parse(s.placement) for s in shards]
    modulus = _spec_modulus(parsed)
    forms = [_form(p, modulus) for p in parsed]
    runs: list[ShardRun] = []
    n = len(shards)
    i = 0
    while i < n:
        a = shards[i]
        sizes = tuple(a.shard_sizes)
        offsets = tuple(a.shard_offsets)
        form = forms[i]
        if form is None:
            runs.append(ShardRun(1, sizes, offsets, (0,) * len(sizes), None, 0, parsed[i][1], 0))
            i += 1
            continue
        rank0 = parsed[i][0]
        assert rank0 is not None
        count = 1
        step: tuple[int, ...] = (0,) * len(sizes)
        rank_step = 0
        if i + 1 < n and forms[i + 1] == form and tuple(shards[i + 1].shard_sizes) == sizes:
            b = shards[i + 1]
            step = tuple(y - x for x, y in zip(offsets, b.shard_offsets, strict=True))
            rank_b = parsed[i + 1][0]
            assert rank_b is not None
            rank_step = rank_b - rank0
            count = 2
            while i + count < n:
                c = shards[i + count]
                if forms[i + count] != form or parsed[i + count][0] != rank0 + count * rank_step:
                    break
                if tuple(c.shard_sizes) != sizes:
                    break
                if any(
                    o != o0 + count * s
                    for o, o0, s in zip(c.shard_offsets, offsets, step, strict=True)
                ):
                    break
                count += 1
        runs.append(ShardRun(count, sizes, offsets, step, rank0, rank_step, form[0], form[1]))
        i += count
    return tuple(runs)


def check_runs(runs: Sequence[ShardRun]) -> None:
    """Raise :class:`LayoutError` unless ``runs`` are what :func:`runs_of` gives for their
    shards (well formed, maximal, canonical modulus), in O(runs + modulus)."""
    if not runs:
        raise LayoutError("a sharding spec has at least one shard")
    dims = len(runs[0].sizes)
    top = -1
    moduli = set()
    for k, run in enumerate(runs):
        if run.count < 1:
            raise LayoutError(f"shard run {k} has count {run.count}")
        if not (len(run.sizes) == len(run.offsets) == len(run.step) == dims):
            raise LayoutError(f"shard run {k} has {len(run.sizes)} dims, expected {dims}")
        if any(v < 0 for v in run.sizes) or any(v < 0 for v in run.offsets):
            raise LayoutError(f"shard run {k} has a negative size or offset")
        last = run.offsets_at(run.count - 1)
        if any(v < 0 for v in last):
            raise LayoutError(f"shard run {k} steps to a negative offset")
        if run.rank is None:
            if run.count != 1 or run.rank_step or run.modulus or any(run.step):
                raise LayoutError(f"shard run {k} without a rank must be a single shard")
            if _PLACEMENT.match(run.device):
                raise LayoutError(f"shard run {k} names a rank in its placement")
            continue
        if run.rank < 0 or run.rank_at(run.count - 1) < 0:  # type: ignore[operator]
            raise LayoutError(f"shard run {k} has a negative rank")
        if run.count == 1 and (run.rank_step or any(run.step)):
            raise LayoutError(f"shard run {k} of one shard has steps")
        if run.modulus:
            if run.modulus < 0 or not _INDEXED.match(f"{run.device}:0"):
                raise LayoutError(f"shard run {k} has a bad indexed device {run.device!r}")
            moduli.add(run.modulus)
            span = min(run.count, run.modulus)
            top = max(top, max(run.rank_at(j) % run.modulus for j in range(span)))  # type: ignore[operator]
        else:
            if ":" in run.device and _INDEXED.match(run.device) is None:
                raise LayoutError(f"shard run {k} has a bad device {run.device!r}")
            d = _INDEXED.match(run.device)
            if d is not None:
                top = max(top, int(d.group(2)))
    modulus = top + 1
    if moduli and moduli != {modulus}:
        raise LayoutError(f"shard runs index devices modulo {sorted(moduli)}, expected {modulus}")
    for k in range(len(runs) - 1):
        a, b = runs[k], runs[k + 1]
        if a.rank is None or b.rank is None:
            continue
        b_form = (b.device, b.modulus)
        if b_form != (a.device, a.modulus) or b.sizes != a.sizes:
            continue
        if a.modulus == 0 and _indexed_could_be(a, modulus):
            continue
        if a.count == 1:
            raise LayoutError(f"shard runs {k} and {k + 1} are one run (not canonical)")
        if b.rank == a.rank_at(a.count) and list(b.offsets) == a.offsets_at(a.count):
            raise LayoutError(f"shard runs {k} and {k + 1} are one run (not canonical)")
    for k, run in enumerate(runs):
        if run.modulus == 0 and run.rank is not None and _indexed_could_be(run, modulus):
            raise LayoutError(f"shard run {k} writes an indexed device literally (not canonical)")


def _indexed_could_be(run: ShardRun, modulus: int) -> bool:
    """Whether a literal-device run's first shard would be written ``rank % modulus``."""
    d = _INDEXED.match(run.device)
    return bool(d and modulus and int(d.group(2)) == run.rank % modulus)  # type: ignore[operator]


def validate_runs(runs: Sequence[ShardRun], shape: Sequence[int], where: str) -> None:
    """Raise :class:`LayoutError` unless the shards of ``runs`` lie inside ``shape``, do not
    overlap and cover it exactly; O(runs²) on the runs' bounding boxes, never per shard."""
    dims = len(shape)
    covered = 0
    boxes: list[tuple[list[int], list[int]]] = []
    for k, run in enumerate(runs):
        if len(run.sizes) != dims:
            raise LayoutError(f"{where}: shards have {len(run.sizes)} dims, the table {dims}")
        last = run.offsets_at(run.count - 1)
        ends = [o + s for o, s in zip(last, run.sizes, strict=True)]
        starts = list(run.offsets)
        if any(e > d for e, d in zip(ends, shape, strict=True)) or any(
            o + s > d for o, s, d in zip(run.offsets, run.sizes, shape, strict=True)
        ):
            raise LayoutError(
                f"{where}: shard run {k} ({run.count} shards of {list(run.sizes)} from "
                f"{list(run.offsets)}) lies outside the table's shape {list(shape)}"
            )
        volume = math.prod(run.sizes)
        covered += volume * run.count
        if volume == 0:
            continue
        if run.count > 1 and not any(
            abs(st) >= sz for st, sz in zip(run.step, run.sizes, strict=True)
        ):
            raise LayoutError(f"{where}: the shards of run {k} overlap one another")
        lo = [min(a, b) for a, b in zip(starts, last, strict=True)]
        hi = [max(a, b) + s for a, b, s in zip(starts, last, run.sizes, strict=True)]
        boxes.append((lo, hi))
    total = math.prod(shape)
    if covered != total:
        raise LayoutError(f"{where}: the shards cover {covered} of the table's {total} elements")
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (alo, ahi), (blo, bhi) = boxes[i], boxes[j]
            if all(a < d and c < b for a, b, c, d in zip(alo, ahi, blo, bhi, strict=True)):
                # Bounding boxes meet (interleaved runs): coverage by volume already holds, so
                # an overlap would leave a hole elsewhere; the exact check is done per shard.
                _check_pairwise(runs, where)
                return


def _check_pairwise(runs: Sequence[ShardRun], where: str) -> None:
    from torch.distributed._shard.sharding_spec._internals import (
        validate_non_overlapping_shards_metadata,
    )

    try:
        validate_non_overlapping_shards_metadata(_expand(runs, {}))
    except ValueError as e:
        raise LayoutError(f"{where}: {e}") from None


# ---- the compact spec -------------------------------------------------------------------------------


class SharedShards(list):
    """A shard list whose ``ShardMetadata`` are shared with other lists of the same layout.

    ``checked`` is shared too: what was established about the layout (checks, derived
    metadata) is established once. A copy or deep copy shares both (``ShardMetadata`` are never
    mutated after construction); it pickles as a plain list.
    """

    __slots__ = ("checked",)

    def __init__(self, items: Any = (), checked: dict[Any, Any] | None = None) -> None:
        super().__init__(items)
        self.checked: dict[Any, Any] = checked if checked is not None else {}

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedShards:
        return SharedShards(self, self.checked)

    def __copy__(self) -> SharedShards:
        return SharedShards(self, self.checked)

    def __reduce__(self) -> Any:
        return (list, (list(self),))


class Expansions:
    """Shared by the specs of one decoded plan: one placement object per placement string, one
    set of ``ShardMetadata`` per distinct layout, and per layout one dict of what was
    established about it (``facts``)."""

    def __init__(self) -> None:
        self.placements: dict[str, Any] = {}
        self.layouts: dict[tuple[ShardRun, ...], SharedShards] = {}
        self.facts: dict[tuple[ShardRun, ...], dict[Any, Any]] = {}
        self.items: dict[tuple[ShardRun, ...], dict[int, Any]] = {}
        self.specs: dict[Any, Any] = {}  # sharding specs shared by layouts (rules.infer_spec)

    def facts_of(self, runs: tuple[ShardRun, ...]) -> dict[Any, Any]:
        got = self.facts.get(runs)
        if got is None:
            got = self.facts[runs] = {}
        return got

    def shards(self, runs: tuple[ShardRun, ...]) -> SharedShards:
        base = self.layouts.get(runs)
        if base is None:
            built = _expand(runs, self.placements)
            for i, md in self.items.get(runs, {}).items():
                built[i] = md  # the shards already handed out one by one
            base = self.layouts[runs] = SharedShards(built, self.facts_of(runs))
        return SharedShards(base, base.checked)

    def placement(self, text: str) -> Any:
        got = self.placements.get(text)
        if got is None:
            from torch.distributed.remote_device import _remote_device

            got = self.placements[text] = _remote_device(text)
        return got

    def shard_at(self, runs: tuple[ShardRun, ...], index: int) -> Any:
        """Shard ``index`` of ``runs`` (the object the expanded list will hold), in O(runs)."""
        base = self.layouts.get(runs)
        if base is not None:
            return base[index]
        memo = self.items.setdefault(runs, {})
        got = memo.get(index)
        if got is None:
            from torch.distributed._shard.metadata import ShardMetadata

            k = index
            for run in runs:
                if k < run.count:
                    got = object.__new__(ShardMetadata)
                    got.shard_offsets = run.offsets_at(k)
                    got.shard_sizes = list(run.sizes)
                    got.placement = self.placement(run.placement_at(k))
                    break
                k -= run.count
            else:
                raise IndexError(index)
            memo[index] = got
        return got


class LazyShards(MutableSequence):
    """The shard list of a layout given by its runs, built (shared through an
    :class:`Expansions`) only when something reads more than single shards of it.

    It behaves as the list of its ``ShardMetadata`` (indexing, iteration, equality with a list,
    mutation), except that it is not a ``list`` instance. ``len`` and single items do not build
    the list. A copy shares the shards; a deep copy is a new lazy list of its own shards (built
    from the runs unless this one was built, and so possibly edited); it pickles as a plain list.
    ``checked`` holds what was established about the layout (shared by every lazy list of these
    runs in one :class:`Expansions`).
    """

    __slots__ = ("runs", "checked", "_exp", "_data", "_len")

    def __init__(self, runs: tuple[ShardRun, ...], expansions: Expansions) -> None:
        self.runs = runs
        self._exp = expansions
        self._data: list[Any] | None = None
        self._len = sum(r.count for r in runs)
        self.checked = expansions.facts_of(runs)

    @property
    def data(self) -> list[Any]:
        d = self._data
        if d is None:
            d = self._data = self._exp.shards(self.runs)
        return d

    @property
    def expanded(self) -> bool:
        return self._data is not None

    def __len__(self) -> int:
        return self._len if self._data is None else len(self._data)

    def __getitem__(self, index: Any) -> Any:
        if self._data is None and isinstance(index, int):
            n = self._len
            if index < 0:
                index += n
            if not 0 <= index < n:
                raise IndexError("list index out of range")
            return self._exp.shard_at(self.runs, index)
        return self.data[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.data[index] = value

    def __delitem__(self, index: Any) -> None:
        del self.data[index]

    def insert(self, index: int, value: Any) -> None:
        self.data.insert(index, value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def __reversed__(self) -> Iterator[Any]:
        return reversed(self.data)

    def __contains__(self, value: object) -> bool:
        return value in self.data

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self.data.sort(*args, **kwargs)

    def copy(self) -> list[Any]:
        return list(self.data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyShards):
            if not self.expanded and not other.expanded and self.runs == other.runs:
                return True
            return self.data == other.data
        if isinstance(other, list):
            return self.data == other
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Any) -> list[Any]:
        return self.data + list(other)

    def __radd__(self, other: Any) -> list[Any]:
        return list(other) + self.data

    def __repr__(self) -> str:
        return repr(self.data)

    def __copy__(self) -> LazyShards:
        if self._data is not None:
            return copy_list(self._data)  # type: ignore[return-value]
        return LazyShards(self.runs, self._exp)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self._data is not None:
            return copy.deepcopy(list(self._data), memo)
        return LazyShards(self.runs, Expansions())

    def __reduce__(self) -> Any:
        return (list, (list(self.data),))


def copy_list(items: list[Any]) -> list[Any]:
    return SharedShards(items, items.checked) if isinstance(items, SharedShards) else list(items)


def _expand(runs: Iterable[ShardRun], placements: dict[str, Any]) -> list[ShardMetadata]:
    """Every shard of ``runs``; placements are shared through ``placements`` (string → object).

    The runs are checked (:func:`check_runs`: non-negative offsets and sizes, equal lengths), so
    the ``ShardMetadata`` are filled in directly rather than re-validated one by one."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed.remote_device import _remote_device

    new = object.__new__
    out: list[ShardMetadata] = []
    append = out.append
    for run in runs:
        sizes = list(run.sizes)
        offsets = list(run.offsets)
        moving = [(d, s) for d, s in enumerate(run.step) if s]
        for j in range(run.count):
            text = run.placement_at(j)
            placement = placements.get(text)
            if placement is None:
                placement = placements[text] = _remote_device(text)
            md = new(ShardMetadata)
            if moving:
                here = offsets.copy()
                for d, s in moving:
                    here[d] += j * s
                md.shard_offsets = here
            else:
                md.shard_offsets = offsets.copy()
            md.shard_sizes = sizes.copy()
            md.placement = placement
            append(md)
    return out
