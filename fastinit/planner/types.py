"""Mirrors ``torchrec/distributed/planner/types.py`` (written against torchrec 1.8.0).

``ShardingOption.__deepcopy__`` ported as ``copy_sharding_options`` (one memo for a whole list);
``Shard``, ``Storage`` and ``Perf`` built via ``object.__new__`` + ``__dict__`` (their 1.8.0 fields,
in declaration order); ``CompactOption``, a ``ShardingOption`` that may hold ``shards=[]`` until
``CompactOption.materialise`` builds them. Registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torchrec.distributed.planner.types import (
    Perf,
    Shard,
    ShardingOption,
    Storage,
)

from fastinit.errors import FastinitError

# How the partitioner places an option (its ``partition_by``), as the search's option data
# (``partitioners.Opt.kind``) holds it; column-wise key-value options have a kind of their own.
UNIFORM = 0
DEVICE = 1
HOST = 2
CW_KEY_VALUE = 3


# ---- deep copies of sharding options, without copy.deepcopy's per-object overhead --------------


def _copy_storage(s: Any, memo: dict[int, Any]) -> Any:
    if s is None:
        return None
    hit = memo.get(id(s))
    if hit is not None:
        return hit
    if type(s) is Storage and len(s.__dict__) == 3:
        new = Storage(hbm=s.hbm, ddr=s.ddr, ssd=s.ssd)
        memo[id(s)] = new
        return new
    return copy.deepcopy(s, memo)


def _copy_perf(p: Any, memo: dict[int, Any]) -> Any:
    if p is None:
        return None
    hit = memo.get(id(p))
    if hit is not None:
        return hit
    if type(p) is Perf and len(p.__dict__) == 6:
        new = Perf(
            fwd_compute=p.fwd_compute,
            fwd_comms=p.fwd_comms,
            bwd_compute=p.bwd_compute,
            bwd_comms=p.bwd_comms,
            input_dist_comms=p.input_dist_comms,
            prefetch_compute=p.prefetch_compute,
        )
        memo[id(p)] = new
        return new
    return copy.deepcopy(p, memo)


def _is_int_list(x: Any) -> bool:
    return type(x) is list and all(type(v) is int for v in x)


def _copy_shards(shards: Any, memo: dict[int, Any]) -> Any:
    if type(shards) is not list:
        return copy.deepcopy(shards, memo)
    out = []
    for s in shards:
        if (
            type(s) is Shard
            and len(s.__dict__) == 5
            and _is_int_list(s.size)
            and _is_int_list(s.offset)
            and (s.rank is None or type(s.rank) is int)
            and id(s) not in memo
        ):
            new = Shard(
                size=list(s.size),
                offset=list(s.offset),
                storage=_copy_storage(s.storage, memo),
                perf=_copy_perf(s.perf, memo),
                rank=s.rank,
            )
            memo[id(s)] = new
            out.append(new)
        else:
            out.append(copy.deepcopy(s, memo))
    return out


def copy_sharding_options(options: Sequence[ShardingOption]) -> list[ShardingOption]:
    """What ``copy.deepcopy(list(options))`` returns, built several times faster.

    ``ShardingOption.__deepcopy__`` (1.8.0) shares ``_tensor`` and ``_module`` and deep-copies every
    other attribute. This does the same, with one memo for the whole list (as ``deepcopy`` of a list
    does); shards, ``Storage`` and ``Perf`` of the stock types are rebuilt directly, anything else
    goes through ``copy.deepcopy``.

    Args:
        options: sharding options.

    Returns:
        Independent copies, in the same order.
    """
    memo: dict[int, Any] = {}
    out: list[ShardingOption] = []
    for so in options:
        if type(so) is not ShardingOption or id(so) in memo:
            out.append(copy.deepcopy(so, memo))
            continue
        new = object.__new__(ShardingOption)
        for k, v in so.__dict__.items():
            if k in ("_tensor", "_module"):
                setattr(new, k, v)
            elif k == "shards":
                setattr(new, k, _copy_shards(v, memo))
            else:
                setattr(new, k, copy.deepcopy(v, memo))
        memo[id(so)] = new
        out.append(new)
    return out


# ---- shards described, built on demand --------------------------------------------------------


def perf_fields(p: Perf) -> tuple[float, ...]:
    return (
        p.fwd_compute,
        p.fwd_comms,
        p.bwd_compute,
        p.bwd_comms,
        p.input_dist_comms,
        p.prefetch_compute,
    )


_new = object.__new__


def perf_from_fields(f: tuple[float, ...]) -> Perf:
    """``Perf(*fields)``, built without the dataclass ``__init__`` (same attributes, same order)."""
    p = _new(Perf)
    p.__dict__ = {
        "fwd_compute": f[0],
        "fwd_comms": f[1],
        "bwd_compute": f[2],
        "bwd_comms": f[3],
        "input_dist_comms": f[4],
        "prefetch_compute": f[5],
    }
    return p


def new_storage(hbm: Any, ddr: Any, ssd: Any) -> Storage:
    """``Storage(hbm, ddr, ssd)``, built without the dataclass ``__init__``."""
    st = _new(Storage)
    st.__dict__ = {"hbm": hbm, "ddr": ddr, "ssd": ssd}
    return st


def new_shard(size: list[int], offset: list[int]) -> Shard:
    """``Shard(size=size, offset=offset)``, built without the dataclass ``__init__``."""
    sh = _new(Shard)
    sh.__dict__ = {"size": size, "offset": offset, "storage": None, "perf": None, "rank": None}
    return sh


class CompactUnsupported(FastinitError):
    """An estimator result the compact search space cannot hold (the full one is built instead)."""


class CompactOption:
    """A ``ShardingOption`` whose shards are described by their distinct values, built on demand.

    A data-parallel option has one shard per rank, all alike: at thousands of ranks and tables,
    building a ``Shard``, a ``Storage`` and a ``Perf`` object per shard costs tens of millions of
    objects that the search never needs (it reads the distinct values and how often they occur).
    Here the option's ``shards`` list stays empty until ``materialise`` builds it, exactly as the
    stock enumerator and estimators would have (one ``Shard``/``Storage``/``Perf`` per shard).

    Attributes:
        so: the sharding option (``shards`` empty until materialised).
        n: the number of shards.
        sizes: the shard sizes, per shard; one entry when every shard has the same size and
            offset (``replicated``).
        offsets: the shard offsets, likewise.
        replicated: every shard has the same size and offset (data parallel).
        st: the distinct ``(hbm, ddr, ssd)`` storages.
        st_pos: per shard, its index in ``st``; None when every shard has ``st[0]``.
        pf: the distinct ``Perf`` fields (``perf_fields`` order).
        pf_pos: per shard, its index in ``pf``; None when every shard has ``pf[0]``.
    """

    __slots__ = ("so", "n", "sizes", "offsets", "replicated", "st", "st_pos", "pf", "pf_pos")

    def __init__(
        self,
        so: ShardingOption,
        sizes: list[list[int]],
        offsets: list[list[int]],
    ) -> None:
        self.so = so
        n = len(sizes)
        self.n = n
        self.replicated = n > 1 and sizes.count(sizes[0]) == n and offsets.count(offsets[0]) == n
        self.sizes = sizes[:1] if self.replicated else sizes
        self.offsets = offsets[:1] if self.replicated else offsets
        self.st: list[tuple[int, int, int]] = []
        self.st_pos: list[int] | None = None
        self.pf: list[tuple[float, ...]] = []
        self.pf_pos: list[int] | None = None

    @classmethod
    def from_option(cls, so: ShardingOption) -> CompactOption:
        """Describe an option whose shards are built and estimated (any estimator's types)."""
        shards = so.shards
        c = cls(so, [s.size for s in shards], [s.offset for s in shards])
        storages = [s.storage for s in shards]
        perfs = [s.perf for s in shards]
        if set(map(type, storages)) != {Storage} or set(map(type, perfs)) != {Perf}:
            raise CompactUnsupported("shard without a stock Storage or Perf estimate")
        c.st, c.st_pos = distinct_values([(x.hbm, x.ddr, x.ssd) for x in storages])
        c.pf, c.pf_pos = distinct_values([perf_fields(x) for x in perfs])
        return c

    def shard_sizes(self) -> list[list[int]]:
        """Every shard's size, as ``calculate_shard_sizes_and_offsets`` returned them."""
        return self.sizes * self.n if self.replicated else self.sizes

    def materialise(self) -> ShardingOption:
        """Build ``so.shards`` (once) and return ``so``."""
        so = self.so
        if so.shards or not self.n:
            return so
        n = self.n
        if self.replicated:
            sizes = self.sizes * n
            offsets = self.offsets * n
        else:
            sizes, offsets = self.sizes, self.offsets
        st_pos = self.st_pos if self.st_pos is not None else [0] * n
        pf_pos = self.pf_pos if self.pf_pos is not None else [0] * n
        st, pf = self.st, self.pf
        shards = []
        for size, offset, a, b in zip(sizes, offsets, st_pos, pf_pos):
            sh = new_shard(size, offset)
            sh.storage = new_storage(*st[a])
            sh.perf = perf_from_fields(pf[b])
            shards.append(sh)
        so.shards = shards
        return so


def distinct_values(values: list[Any]) -> tuple[list[Any], list[int] | None]:
    """``(distinct values in first-seen order, per value its index)``; None: all the first."""
    if not values:
        return [], None
    if values.count(values[0]) == len(values):
        return values[:1], None
    index: dict[Any, int] = {}
    out: list[Any] = []
    pos = []
    for v in values:
        k = index.get(v)
        if k is None:
            k = index[v] = len(out)
            out.append(v)
        pos.append(k)
    return out, pos
