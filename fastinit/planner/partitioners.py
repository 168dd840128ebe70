"""Mirrors ``torchrec/distributed/planner/partitioners.py`` (written against torchrec 1.8.0).

``GreedyPerfPartitioner.partition`` replayed on option indices and flat per-device arrays
(``Search``, with ``_State``, ``_Hosts`` and ``_device_place``): uniform shards placed with vector
operations, device-placed shards on the least-loaded device that fits (``_establish_minheap``,
``_device_partition``, ``OrderedDeviceHardware.__lt__``), column-wise key-value options as
``_column_wise_device_partition`` places them, host-placed groups as ``_multi_hosts_partition``,
``_cohost_partition`` and ``_get_host_level_devices`` do, proposals partitioned together
(``Search.evaluate_batch``); ``NoopPerfModel.rate`` (``perf_models.py``) as ``Search._rate``.
``Opt`` is the per-option data the search reads (from a ``types.CompactOption``). Used by
``FastPlanner`` (``planners.py``); registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from torchrec.distributed.planner.types import (
    PartitionByType,
    Topology,
)
from torchrec.distributed.types import ShardingType

from fastinit.errors import FastinitError
from fastinit.planner import perf_models as _pm
from fastinit.planner import types as _ty
from fastinit.planner.types import CW_KEY_VALUE, DEVICE, HOST, UNIFORM

# Relative slack for pruning: a float sum of n non-negative terms is within n * 2**-53 of the exact
# sum; 1e-9 covers a million terms with room to spare.
PRUNE_SLACK = 1e-9


class Opt:
    """Per sharding option data the search reads, computed once from the option's description.

    Shards are not built here: a data-parallel option at thousands of ranks has thousands of alike
    shards, so values are kept per distinct shard (``st_d``, ``pf_d``, ``tot_d``) with each shard's
    index (``st_pos``, ``pf_pos``; None when every shard has the first). Per-shard lists (``st``,
    ``pf``, ``tot``) are kept only for the options placed shard by shard (device and host), which
    have few shards. Sums over shards are taken over per-shard sequences built in C, by the same
    built-ins as the stock code (``sum``, ``max``), so they are the stock floats.
    """

    __slots__ = (
        "c",
        "so",
        "fqn",
        "path",
        "group",
        "kind",
        "sharding_type",
        "n",
        "st_d",
        "st_pos",
        "pf_d",
        "pf_pos",
        "tot_d",
        "st",
        "pf",
        "tot",
        "tot_sum",
        "tot_exact",
        "tot_min",
        "tot_max",
        "total_storage",
        "total_perf",
        "greedy_key",
        "_vecs",
        "const",
        "score_depth",
        "score_sum",
    )

    def __init__(self, c: _ty.CompactOption) -> None:
        so = c.so
        self.c = c
        self.so = so
        self.fqn = so.fqn
        self.path = so.path
        self.group = so.dependency or so.fqn
        pb = so.partition_by
        if pb == PartitionByType.UNIFORM.value:
            self.kind = UNIFORM
        elif pb == PartitionByType.DEVICE.value:
            is_cw_kv = (
                so.compute_kernel == "key_value"
                and so.sharding_type == ShardingType.COLUMN_WISE.value
            )
            self.kind = CW_KEY_VALUE if is_cw_kv else DEVICE
        elif pb == PartitionByType.HOST.value:
            self.kind = HOST
        else:
            raise Unsupported(f"partition_by={pb}")
        self.sharding_type = so.sharding_type
        n = self.n = c.n
        if not n:
            raise Unsupported("an option without shards")
        st_d = self.st_d = c.st
        self.st_pos = c.st_pos
        # Perf fields (perf_fields order) -> the five that Perf.total adds up
        pf_d = self.pf_d = [(f[0], f[1], f[2], f[3], f[5]) for f in c.pf]
        self.pf_pos = c.pf_pos
        if not all(type(v) is int and v >= 0 for t in st_d for v in t):
            raise Unsupported("non-integer or negative storage")
        if not all(type(v) in (int, float) and math.isfinite(v) for t in pf_d for v in t):
            raise Unsupported("non-finite perf")
        # Perf.total = fwd_compute + bwd_compute + fwd_comms + bwd_comms + prefetch_compute
        tot_d = self.tot_d = [t[0] + t[2] + t[1] + t[3] + t[4] for t in pf_d]
        if not all(math.isfinite(t) for t in tot_d):
            raise Unsupported("non-finite perf total")
        tot = self.tot_full()
        # proposers._sharding_option_score: max([...]) / sum([...]) of the shards' perf totals
        self.score_depth = max(tot_d)
        self.score_sum = sum(tot)
        # the exact sum (what math.fsum rounds), as an integer multiple of 2**-EXACT_BITS
        if self.pf_pos is None:
            self.tot_exact = n * exact(tot_d[0])
        else:
            pf_counts = _counts(self.pf_pos, len(tot_d), n)
            self.tot_exact = sum(k * exact(t) for k, t in zip(pf_counts, tot_d))
        self.tot_sum = self.tot_exact / (1 << EXACT_BITS)
        self.tot_min = min(tot_d)
        self.tot_max = max(tot_d)
        if self.st_pos is None:
            h, d, x = st_d[0]
            self.total_storage = (n * h, n * d, n * x)
        else:
            counts = _counts(self.st_pos, len(st_d), n)
            h = sum(k * s[0] for k, s in zip(counts, st_d))
            d = sum(k * s[1] for k, s in zip(counts, st_d))
            x = sum(k * s[2] for k, s in zip(counts, st_d))
            self.total_storage = (h, d, x)
        # GreedyProposer.feedback: (max hbm, sum hbm, max ddr, sum ddr) over the shards
        self.greedy_key = (
            max(s[0] for s in st_d),
            self.total_storage[0],
            max(s[1] for s in st_d),
            self.total_storage[1],
        )
        self.const = self.kind == UNIFORM and len(st_d) == 1 and len(pf_d) == 1
        if self.kind == UNIFORM:
            # read through st_d/pf_d/vecs(): uniform options may have a shard per rank
            self.st: list[tuple[int, int, int]] = []
            self.pf: list[tuple[float, ...]] = []
            self.tot: list[float] = []
            self.total_perf = 0.0  # not read: uniform options are not sorted
        else:
            self.st = _expand(st_d, self.st_pos, n)
            self.pf = _expand(pf_d, self.pf_pos, n)
            self.tot = tot
            total_perf: float = 0  # ShardingOption.total_perf: a loop from 0, in shard order
            for t in tot:
                total_perf += t
            self.total_perf = total_perf
        self._vecs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def tot_full(self) -> list[float]:
        """Every shard's ``perf.total``, in shard order (built in C)."""
        return _expand(self.tot_d, self.pf_pos, self.n)

    def vecs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-shard storage (3 x n, int64), perf components (5 x n) and totals, as arrays."""
        if self._vecs is None:
            st = np.array(self.st_d, dtype=np.int64).T.reshape(3, len(self.st_d))
            pf = np.array(self.pf_d, dtype=np.float64).T.reshape(5, len(self.pf_d))
            tot = np.array(self.tot_d, dtype=np.float64)
            st_idx = np.zeros(self.n, dtype=np.intp) if self.st_pos is None else self.st_pos
            pf_idx = np.zeros(self.n, dtype=np.intp) if self.pf_pos is None else self.pf_pos
            self._vecs = (
                np.ascontiguousarray(st[:, st_idx]),
                np.ascontiguousarray(pf[:, pf_idx]),
                tot[pf_idx],
            )
        return self._vecs


def _expand(distinct: list[Any], pos: list[int] | None, n: int) -> list[Any]:
    """Per-shard values from distinct values and per-shard indices (None: all the first)."""
    if pos is None:
        return distinct[:1] * n
    return list(map(distinct.__getitem__, pos))


def _counts(pos: list[int] | None, k: int, n: int) -> list[int]:
    """How many shards have each of the ``k`` distinct values."""
    if pos is None:
        return [n] + [0] * (k - 1)
    out = [0] * k
    for p in pos:
        out[p] += 1
    return out


class Unsupported(FastinitError):
    """A search space or setting the fast search does not replay (the stock planner runs)."""


# Exact sums of floats: every finite double is an integer multiple of 2**-1074.
EXACT_BITS = 1100


def exact(x: float) -> int:
    """``x * 2**EXACT_BITS`` as an exact integer."""
    num, den = float(x).as_integer_ratio()
    return num << (EXACT_BITS + 1 - den.bit_length())


# ---- the partitioner, replayed on flat arrays ----------------------------------------------------


class _Cut(Exception):
    """A device's load passed the cutoff: the proposal cannot beat the best one found."""


class _CutType:
    """The type of ``CUT``, what ``Search.evaluate`` returns for a partition it stopped."""


CUT = _CutType()


class _ScalarType:
    """The type of ``SCALAR``: a proposal that left ``Search.evaluate_batch`` (evaluate it alone)."""


SCALAR = _ScalarType()


def _partition_classes(opts: Sequence[Opt]) -> list[int]:
    """A class per option: options of one table that the partitioner and the rating treat alike.

    ``Search.evaluate`` and ``Search._rate`` read of a non-uniform option only its kind, its
    group, module path and table, its shard count, per-shard storage and perf, and its totals;
    a device-placed option's sharding type is not read (a one-shard column-wise option is placed
    as a table-wise one). Two proposals whose options are alike position by position get the
    same ranks and the same rating. Uniform options keep a class of their own.
    """
    seen: dict[tuple[Any, ...], int] = {}
    out = []
    for i, o in enumerate(opts):
        if o.kind == UNIFORM:
            key: tuple[Any, ...] = ("uniform", i)
        else:
            key = (
                o.fqn,
                o.group,
                o.path,
                o.kind,
                o.sharding_type if o.kind != DEVICE else "",
                o.n,
                tuple(o.st),
                tuple(o.pf),
                tuple(o.tot),
                o.total_perf,
                o.total_storage,
            )
        out.append(seen.setdefault(key, len(seen)))
    return out


class Search:
    """``GreedyPerfPartitioner.partition`` + ``NoopPerfModel.rate`` on option indices.

    Device state lives in flat lists indexed by device: remaining ``hbm``/``ddr``/``ssd`` (ints)
    and the five ``Perf`` components that ``Perf.total`` adds up, accumulated shard by shard in the
    stock order, so every comparison sees the stock floats.
    """

    #: hosts per block in ``evaluate_batch``'s search for the least loaded host
    host_block = 32

    def __init__(
        self,
        opts: list[Opt],
        storage_constraint: Topology,
        rating_world_size: int,
        sort_by_perf: bool,
        balance_modules: bool,
    ) -> None:
        self.opts = opts
        devices = storage_constraint.devices
        self.n_dev = len(devices)
        self.ranks = [d.rank for d in devices]
        self.lws = storage_constraint.local_world_size
        self.sort_by_perf = sort_by_perf
        self.balance_modules = balance_modules
        self.rating_ws = rating_world_size
        if self.ranks != list(range(self.n_dev)) or self.n_dev > rating_world_size:
            raise Unsupported("devices are not ranks 0..n-1 of the rated world")
        st0 = [(d.storage.hbm, d.storage.ddr, d.storage.ssd) for d in devices]
        if not all(type(v) is int for s in st0 for v in s):
            raise Unsupported("non-integer device storage")
        pf0 = [
            (
                d.perf.fwd_compute,
                d.perf.fwd_comms,
                d.perf.bwd_compute,
                d.perf.bwd_comms,
                d.perf.prefetch_compute,
            )
            for d in devices
        ]
        if not all(type(v) in (int, float) for p in pf0 for v in p):
            raise Unsupported("non-numeric device perf")
        self.st0_list = st0
        self.pf0_list = pf0
        self.st0 = np.array(st0, dtype=np.int64).T.copy().reshape(3, self.n_dev)
        self.pf0 = np.array(pf0, dtype=np.float64).T.copy().reshape(5, self.n_dev)
        # all devices start alike: uniform shards that are alike keep them alike (scalar path)
        self.same_devices = len(set(st0)) <= 1 and len(set(pf0)) <= 1
        group_size = storage_constraint.intra_group_size
        num_hosts = storage_constraint.world_size // group_size
        self.group_size = group_size
        self.hosts = [list(range(h * group_size, (h + 1) * group_size)) for h in range(num_hosts)]
        self.host_of = [-1] * self.n_dev
        for h, devs in enumerate(self.hosts):
            for j in devs:
                if j < self.n_dev:
                    self.host_of[j] = h
        if any(j >= self.n_dev for devs in self.hosts for j in devs):
            raise Unsupported("hosts reach past the devices")
        self.all_tot_nonneg = all(t >= 0 for o in opts for t in o.tot_d)
        # every perf component >= 0 (options and devices): a device's load, summed in any order,
        # is then within n * 2**-53 of its exact value and never decreases as shards are placed,
        # so a partition may stop once a load exceeds the best rating (``evaluate``'s ``cutoff``)
        self.can_cut = all(v >= 0 for o in opts for t in o.pf_d for v in t) and all(
            v >= 0 for p in pf0 for v in p
        )
        self.classes = _partition_classes(opts)
        kinds = np.array([o.kind for o in opts])
        uniform = kinds == UNIFORM
        self.lb_tot_sum = np.array([o.tot_sum for o in opts], dtype=np.float64)
        self.lb_uni_min = np.where(uniform, [o.tot_min for o in opts], 0.0)
        self.lb_nu_max = np.where(uniform, 0.0, [o.tot_max for o in opts])
        # the batched partition (``evaluate_batch``): devices alike, ranks 0..n-1 of the rated
        # world, hosts of ``group_size`` devices covering every device
        self.kinds = kinds
        self.batch_ok = (
            self.same_devices
            and self.n_dev == rating_world_size
            and bool(self.hosts)
            and len(self.hosts) * group_size == self.n_dev
            and all(o.group == o.fqn for o in opts)
            # every storage sum fits an int64: the batch holds storage in numpy
            and sum(abs(v) for o in opts for v in o.total_storage)
            + group_size * max((abs(v) for s in st0 for v in s), default=0)
            < 1 << 62
        )
        # the device-heap order of ``_device_place`` for device-placed options:
        # (load, rank % local_world_size, rank)
        first: dict[int, int] = {}
        self.canon = np.array(
            [first.setdefault(c, i) for i, c in enumerate(self.classes)], dtype=np.int64
        )
        self.dev_perm = np.array(
            sorted(range(self.n_dev), key=lambda j: (j % self.lws, j)), dtype=np.intp
        )

    # -- lower bound of the rating ---------------------------------------------------------------

    def lower_bounds(self, proposals: np.ndarray) -> np.ndarray:
        """A lower bound of each proposal's rating (rows of option indices); see ``lower_bound``."""
        avg = self.lb_tot_sum[proposals].sum(axis=1) / self.rating_ws
        one = self.lb_uni_min[proposals].sum(axis=1) + self.lb_nu_max[proposals].max(axis=1)
        return np.maximum(avg, one)

    def lower_bound(self, proposal: Sequence[int]) -> float:
        """A lower bound of the rating, valid when every shard perf total is >= 0.

        The most loaded rank carries at least the average load, and the rank that holds the
        largest non-uniform shard also holds one shard of every uniform option.
        """
        return float(self.lower_bounds(np.asarray([proposal]))[0])

    # -- partition + rating ----------------------------------------------------------------------

    def evaluate(self, proposal: Sequence[int]) -> tuple[list[list[int]], float] | None:
        """Partition and rate ``proposal``.

        Returns:
            ``(ranks per proposal position, rating)``, or ``None`` where the stock partitioner
            raises ``PlannerError``.
        """
        return self._evaluate(proposal, None)

    def evaluate_cut(
        self, proposal: Sequence[int], cutoff: float
    ) -> tuple[list[list[int]], float] | None | _CutType:
        """``evaluate``, stopped as soon as a device's load exceeds ``cutoff``.

        A device's load only grows as shards are placed, and the rating is at least the final
        load of every device (both summed in float from non-negative terms, so within a relative
        ``n * 2**-53`` of the exact sums). Called with ``cutoff = best * (1 + PRUNE_SLACK)``, a
        proposal that is stopped has a rating above ``best``. Without ``can_cut`` (a negative
        perf component) the partition runs to the end.

        Returns:
            what ``evaluate`` returns, or ``CUT`` where the partition stopped.
        """
        try:
            return self._evaluate(proposal, cutoff if self.can_cut else None)
        except _Cut:
            return CUT

    def _evaluate(
        self, proposal: Sequence[int], cutoff: float | None
    ) -> tuple[list[list[int]], float] | None:
        opts = self.opts
        n_dev = self.n_dev
        dev_ranks = self.ranks
        assigned: list[list[int] | None] = [None] * len(proposal)

        # 1. uniform options (data parallel, row wise), in proposal order
        uni = [pos for pos, i in enumerate(proposal) if opts[i].kind == UNIFORM]
        for pos in uni:
            if opts[proposal[pos]].n != n_dev:
                return None
            assigned[pos] = dev_ranks
        if self.same_devices and all(opts[proposal[pos]].const for pos in uni):
            h, d, x = self.st0_list[0]
            a, b, c, e, f = self.pf0_list[0]
            for pos in uni:
                o = opts[proposal[pos]]
                nh, nd, ns = o.st_d[0]
                h, d, x = h - nh, d - nd, x - ns
                pa, pb, pc_, pd, pe = o.pf_d[0]
                a, b, c, e, f = a + pa, b + pb, c + pc_, e + pd, f + pe
            if uni and (h < 0 or d < 0 or x < 0):
                return None
            hbm, ddr, ssd = [h] * n_dev, [d] * n_dev, [x] * n_dev
            fc, fcm, bc, bcm, pc = [a] * n_dev, [b] * n_dev, [c] * n_dev, [e] * n_dev, [f] * n_dev
            tot_l = [a + c + b + e + f] * n_dev
        else:
            st = self.st0.copy()
            pfa = self.pf0.copy()
            for pos in uni:
                st_vec, pf_vec, _ = opts[proposal[pos]].vecs()
                st -= st_vec
                pfa += pf_vec
            if uni and (st < 0).any():
                return None
            hbm, ddr, ssd = (row.tolist() for row in st)
            fc, fcm, bc, bcm, pc = (row.tolist() for row in pfa)
            tot_l = ((((pfa[0] + pfa[2]) + pfa[1]) + pfa[3]) + pfa[4]).tolist()
        state = _State(hbm, ddr, ssd, fc, fcm, bc, bcm, pc, tot_l)
        if cutoff is not None:
            if max(tot_l) > cutoff:
                raise _Cut
            state.cut = cutoff

        # 2. the other options, grouped by dependency (or fqn) and sorted as the stock partitioner
        groups: dict[str, list[int]] = {}
        for pos, i in enumerate(proposal):
            if opts[i].kind != UNIFORM:
                groups.setdefault(opts[i].group, []).append(pos)
        if groups:
            param_count: dict[str, int] = {}
            if self.balance_modules:
                for i in proposal:
                    p = opts[i].path
                    param_count[p] = param_count.get(p, 0) + 1
            keyed = []
            for positions in groups.values():
                o0 = opts[proposal[positions[0]]]
                if self.sort_by_perf:
                    perf_sum = o0.total_perf
                    for pos in positions[1:]:
                        perf_sum += opts[proposal[pos]].total_perf
                    k: list[Any] = [perf_sum]
                else:
                    gh, gd, gx = o0.total_storage
                    for pos in positions[1:]:
                        h2, d2, x2 = opts[proposal[pos]].total_storage
                        gh, gd, gx = gh + h2, gd + d2, gx + x2
                    k = [(gh, gd, gx)]
                if self.balance_modules:
                    k.insert(0, -param_count[o0.path])
                keyed.append((k, positions))
            keyed.sort(key=lambda kp: kp[0], reverse=True)

            lws = self.lws
            heap: list[tuple[float, int, int, int]] | None = None
            hosts = _Hosts(self, state) if self.hosts else None
            for _, positions in keyed:
                kind = opts[proposal[positions[0]]].kind
                if kind == HOST:
                    if hosts is None or not hosts.place_group(proposal, positions, assigned):
                        return None
                    heap = None
                    continue
                if len(positions) != 1:
                    raise AssertionError(
                        f"Unexpected length for sharding options: {len(positions)}"
                    )
                pos = positions[0]
                o = opts[proposal[pos]]
                if heap is None:
                    heap = [(tot_l[j], dev_ranks[j] % lws, dev_ranks[j], j) for j in range(n_dev)]
                    heapq.heapify(heap)
                if kind == CW_KEY_VALUE:
                    r = self._cw_kv_place(o, heap, state)
                else:
                    r = _device_place(o, heap, state, None)
                if r is None:
                    return None
                if hosts is not None:
                    hosts.touch(r)
                assigned[pos] = [dev_ranks[j] for j in r]

        ranks = cast(list[list[int]], assigned)
        return ranks, self._rate(proposal, ranks)

    def _rate(self, proposal: Sequence[int], ranks: list[list[int]]) -> float:
        """``NoopPerfModel.rate`` (``perf_models.noop_rate``)."""
        return _pm.noop_rate(self, proposal, ranks)

    # -- the batched partition -------------------------------------------------------------------

    def evaluate_batch(self, vecs: Sequence[Sequence[int]]) -> list[Any] | None:
        """``evaluate`` of several proposals together, each with its own per-device state.

        The proposals' non-uniform options are merged into one list in the stock group order
        (the stable sort by the stock key; a proposal's own groups are a subsequence of it), and
        each option is placed for every proposal holding it at once: the state of every device
        is a row per proposal, and each proposal takes the least loaded host (first in
        ``(summed load, host index)`` order) and device (``(load, rank % L, rank)``) under its
        own loads, with the same IEEE operations, in the same order, as ``evaluate``: the
        results are those of ``evaluate``, bit for bit. A proposal whose chosen host or device
        does not fit (the stock partitioner then tries the next one), or whose uniform options
        are not the alike ones of the scalar path, leaves the batch: its entry is ``SCALAR``
        and the caller evaluates it alone.

        Returns:
            per proposal ``(ranks getter, rating)`` or ``SCALAR``; None where the batch does not
            apply (options placed another way, groups of several tables).
        """
        if not self.batch_ok or not vecs:
            return None
        opts = self.opts
        n_b = len(vecs)
        # options of one partition class are placed and rated alike: each is replaced by the
        # first option of its class, so alike proposals share every merged option
        mat = self.canon[np.array(vecs, dtype=np.intp)]
        n_dev, lsz, n_hosts = self.n_dev, self.group_size, len(self.hosts)
        alive = np.ones(n_b, dtype=bool)
        ref = mat[0]
        same_col = (mat == ref).all(axis=0)
        every = np.arange(n_b)
        cols: list[tuple[int, int, np.ndarray]] = [
            (f, i, every) for f, i in zip(np.flatnonzero(same_col).tolist(), ref[same_col].tolist())
        ]
        for f in np.flatnonzero(~same_col).tolist():
            col = mat[:, f]
            for i in np.unique(col).tolist():
                cols.append((f, i, np.flatnonzero(col == i)))
        cols.sort(key=lambda c: (c[0], c[1]))

        # 1. uniform options, in proposal order (the alike-device, one-shard-value path)
        (h0, d0, x0), pf0 = self.st0_list[0], self.pf0_list[0]
        bst = [np.full(n_b, v, dtype=np.int64) for v in (h0, d0, x0)]
        bpf = [np.full(n_b, v, dtype=np.float64) for v in pf0]
        uni_cols: list[tuple[int, int, np.ndarray]] = []
        items: list[tuple[int, int, np.ndarray]] = []
        for f, i, mem in cols:
            o = opts[i]
            if o.kind == UNIFORM:
                if o.n != n_dev or not o.const:
                    alive[mem] = False
                    continue
                for arr, v in zip(bst, o.st_d[0]):
                    arr[mem] -= v
                for arr_f, v_f in zip(bpf, o.pf_d[0]):
                    arr_f[mem] += v_f
                uni_cols.append((f, i, mem))
            elif o.kind == DEVICE or (
                o.kind == HOST and o.sharding_type == ShardingType.TABLE_COLUMN_WISE.value
            ):
                items.append((f, i, mem))
            else:
                return None
        for arr in bst:
            alive &= arr >= 0
        # 2. the non-uniform options in the stock group order (one table per group)
        if self.balance_modules:
            param_count: dict[str, int] = {}
            for i in ref.tolist():
                p = opts[i].path
                param_count[p] = param_count.get(p, 0) + 1

        def key(item: tuple[int, int, np.ndarray]) -> list[Any]:
            o = opts[item[1]]
            k: list[Any] = [o.total_perf] if self.sort_by_perf else [o.total_storage]
            if self.balance_modules:
                k.insert(0, -param_count[o.path])
            return k

        items.sort(key=key, reverse=True)

        # per-device state, flat (proposal m, device j at m * n_dev + j): remaining storage
        # (the kinds some merged option needs; the others cannot bind, the base being >= 0), the
        # perf components in ``pf_d`` order (a row of 5 per device), and ``Perf.total``
        rows = [
            r
            for r in range(3)
            if any(opts[i].total_storage[r] or any(t[r] for t in opts[i].st) for _, i, _ in items)
        ]
        n_rows = len(rows)
        st = np.repeat(np.stack(bst)[rows].T, n_dev, axis=0)
        pf = np.repeat(np.stack(bpf).T, n_dev, axis=0)
        # State.apply / the uniform path: fwd_compute + bwd_compute + fwd_comms + bwd_comms + ...
        tot = (((pf[:, 0] + pf[:, 2]) + pf[:, 1]) + pf[:, 3]) + pf[:, 4]
        # per-host remaining storage (m * n_hosts + host) and summed load (``_Hosts._refresh``)
        hst = np.repeat(np.stack(bst)[rows].T * lsz, n_hosts, axis=0)
        col0 = np.zeros(n_b, dtype=np.float64)
        for _ in range(lsz):  # a loop from 0 over the host's devices
            col0 = col0 + tot[::n_dev]
        hsum_flat = np.repeat(col0, n_hosts)
        # the least loaded host, first in (summed load, host index) order, through blocks of
        # hosts: per block its least value and (first) host; the first block with the least value
        blk = min(self.host_block, n_hosts)
        n_blk = -(-n_hosts // blk)
        pad = n_blk * blk - n_hosts
        hs_pad = np.concatenate(
            [hsum_flat.reshape(n_b, n_hosts), np.full((n_b, pad), np.inf)], axis=1
        ).reshape(-1)
        blk_min = np.repeat(col0, n_blk).reshape(n_b, n_blk)
        blk_arg = np.tile(np.arange(n_blk, dtype=np.intp) * blk, (n_b, 1))
        blk_local = np.arange(blk)
        local = np.arange(lsz)
        perm = self.dev_perm
        rec: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []
        killed = 0

        def place(f: int, i: int, s: int, idx: np.ndarray, j: np.ndarray) -> np.ndarray | None:
            """Shard ``s`` of option ``i`` on device ``j[m]`` of proposal ``idx[m]`` where it
            fits; returns the mask of those placed (the others leave the batch), None: all."""
            nonlocal killed
            fi = idx * n_dev + j
            ok = None
            if n_rows:
                need = o_st[i][s]
                fits = (st[fi] >= need).all(axis=1)
                if not fits.all():
                    ok = fits
                    alive[idx[~ok]] = False
                    killed += 1
                    idx, j, fi = idx[ok], j[ok], fi[ok]
                st[fi] -= need
                hst[idx * n_hosts + j // lsz] -= need
            g = pf[fi] + o_pf[i][s]
            pf[fi] = g
            tot[fi] = (((g[:, 0] + g[:, 2]) + g[:, 1]) + g[:, 3]) + g[:, 4]
            rec.append((f, i, s, idx, j))
            return ok

        def refresh(idx: np.ndarray, host: np.ndarray) -> None:
            devs = tot[(idx * n_dev + host * lsz)[:, None] + local]
            hs_pad[idx * (n_blk * blk) + host] = np.add.accumulate(devs, axis=1)[:, -1]
            b = host // blk
            vals = hs_pad[(idx * (n_blk * blk) + b * blk)[:, None] + blk_local]
            arg = vals.argmin(axis=1)
            blk_arg[idx, b] = b * blk + arg
            blk_min[idx, b] = vals[np.arange(len(idx)), arg]

        def least_host(idx: np.ndarray) -> np.ndarray:
            mins = blk_min if idx is every else blk_min[idx]
            b = mins.argmin(axis=1)
            return blk_arg[idx, b]

        o_st: dict[int, np.ndarray] = {}
        o_pf: dict[int, np.ndarray] = {}
        for f, i, mem in items:
            if killed:
                mem = mem[alive[mem]]
                if not mem.size:
                    continue
            idx = mem
            o = opts[i]
            if i not in o_st:
                o_st[i] = np.array(o.st, dtype=np.int64)[:, rows].reshape(o.n, n_rows)
                o_pf[i] = np.array(o.pf, dtype=np.float64).reshape(o.n, 5)
            if o.kind == HOST:
                host = least_host(idx)
                if n_rows:
                    need = np.array(o.total_storage, dtype=np.int64)[rows]
                    fits = (hst[idx * n_hosts + host] >= need).all(axis=1)
                    if not fits.all():
                        alive[idx[~fits]] = False
                        killed += 1
                        idx, host = idx[fits], host[fits]
                for s in range(o.n):
                    if not idx.size:
                        break
                    base = idx * n_dev + host * lsz
                    j = host * lsz + tot[base[:, None] + local].argmin(axis=1)
                    ok = place(f, i, s, idx, j)
                    if ok is not None:
                        idx, host = idx[ok], host[ok]
                if idx.size:
                    refresh(idx, host)
            else:
                for s in range(o.n):
                    if not idx.size:
                        break
                    j = perm[tot.reshape(n_b, n_dev)[idx][:, perm].argmin(axis=1)]
                    ok = place(f, i, s, idx, j)
                    if ok is not None:
                        idx, j = idx[ok], j[ok]
                    refresh(idx, j // lsz)

        # 3. the rating (``_rate``): per-rank sums in proposal order, then the maximum
        perfs = np.zeros((n_b, n_dev), dtype=np.float64)
        flat = perfs.reshape(-1)
        events: list[tuple[int, int, int, Any, Any]] = [
            (f, -1, i, mem, None) for f, i, mem in uni_cols
        ]
        events.extend((f, s, i, idx, j) for f, i, s, idx, j in rec)
        events.sort(key=lambda e: (e[0], e[1]))
        for _, s, i, idx, j in events:
            if s < 0:
                perfs[idx] += opts[i].tot_d[0]
            else:
                flat[idx * n_dev + j] += opts[i].tot[s]
        ratings = perfs.max(axis=1).tolist()

        kinds = self.kinds

        def ranks_of(m: int) -> Callable[[], list[list[int]]]:
            def build() -> list[list[int]]:
                vec = mat[m]
                out: list[list[int]] = [
                    self.ranks if kinds[i] == UNIFORM else [] for i in vec.tolist()
                ]
                for f, _, _, idx, j in rec:
                    p = int(np.searchsorted(idx, m))
                    if p < len(idx) and idx[p] == m:
                        out[f].append(int(j[p]))
                return out

            return build

        return [(ranks_of(m), ratings[m]) if alive[m] else SCALAR for m in range(n_b)]

    def _cw_kv_place(
        self, o: Opt, heap: list[tuple[float, int, int, int]], state: _State
    ) -> list[int] | None:
        """``GreedyPerfPartitioner._column_wise_device_partition``: one shard per device."""
        if o.n > len(heap):
            return None
        used: set[int] = set()
        out: list[int] = []
        lws = self.lws
        tot_l = state.tot
        for s in range(o.n):
            nh, nd, ns = o.st[s]
            cands = sorted(
                (tot_l[j], self.ranks[j] % lws, self.ranks[j], j)
                for j in range(self.n_dev)
                if self.ranks[j] not in used
            )
            if not cands:
                return None
            for _, _, r, j in cands:
                if nh <= state.hbm[j] and nd <= state.ddr[j] and ns <= state.ssd[j]:
                    state.apply(o, s, j, None)
                    used.add(r)
                    out.append(j)
                    break
            else:
                return None
        heap[:] = [(tot_l[j], self.ranks[j] % lws, self.ranks[j], j) for j in range(self.n_dev)]
        heapq.heapify(heap)
        return out


class _State:
    """Per-device remaining storage and accumulated perf components."""

    __slots__ = ("hbm", "ddr", "ssd", "fc", "fcm", "bc", "bcm", "pc", "tot", "cut")

    def __init__(
        self,
        hbm: list[int],
        ddr: list[int],
        ssd: list[int],
        fc: list[float],
        fcm: list[float],
        bc: list[float],
        bcm: list[float],
        pc: list[float],
        tot: list[float],
    ) -> None:
        self.hbm, self.ddr, self.ssd = hbm, ddr, ssd
        self.fc, self.fcm, self.bc, self.bcm, self.pc = fc, fcm, bc, bcm, pc
        self.tot = tot
        #: a load above this stops the partition (``_Cut``); infinity: never
        self.cut = math.inf

    def save(self, j: int) -> tuple[Any, ...]:
        return (
            j,
            self.hbm[j],
            self.ddr[j],
            self.ssd[j],
            self.fc[j],
            self.fcm[j],
            self.bc[j],
            self.bcm[j],
            self.pc[j],
            self.tot[j],
        )

    def restore(self, saved: tuple[Any, ...]) -> None:
        j = saved[0]
        (
            self.hbm[j],
            self.ddr[j],
            self.ssd[j],
            self.fc[j],
            self.fcm[j],
            self.bc[j],
            self.bcm[j],
            self.pc[j],
            self.tot[j],
        ) = saved[1:]

    def apply(self, o: Opt, s: int, j: int, undo: list[tuple[Any, ...]] | None) -> None:
        """Place shard ``s`` of ``o`` on device ``j``: ``storage -= ...; perf += ...``."""
        if undo is not None:
            undo.append(self.save(j))
        nh, nd, ns = o.st[s]
        self.hbm[j] -= nh
        self.ddr[j] -= nd
        self.ssd[j] -= ns
        a, b, c, d, e = o.pf[s]
        fc = self.fc[j] = self.fc[j] + a
        fcm = self.fcm[j] = self.fcm[j] + b
        bc = self.bc[j] = self.bc[j] + c
        bcm = self.bcm[j] = self.bcm[j] + d
        pc = self.pc[j] = self.pc[j] + e
        # Perf.total: fwd_compute + bwd_compute + fwd_comms + bwd_comms + prefetch_compute
        t = self.tot[j] = fc + bc + fcm + bcm + pc
        if t > self.cut:
            raise _Cut


class _Hosts:
    """``GreedyPerfPartitioner._cohost_partition``, with host sums kept up to date.

    The stock partitioner sorts the hosts by their summed ``perf.total`` for every group and tries
    them in that order (a stable sort: ties by host index). Here the hosts sit in a heap keyed by
    ``(sum, host index)``; only the hosts whose devices changed are re-keyed, and hosts are popped
    in that order until one takes the group.
    """

    def __init__(self, search: Search, state: _State) -> None:
        self.search = search
        self.state = state
        self.sums: list[float] = [0.0] * len(search.hosts)
        self.version: list[int] = [0] * len(search.hosts)
        self.heap: list[tuple[float, int, int]] = []
        self.dirty: set[int] = set(range(len(search.hosts)))

    def touch(self, devices: list[int]) -> None:
        host_of = self.search.host_of
        for j in devices:
            h = host_of[j]
            if h >= 0:
                self.dirty.add(h)

    def _refresh(self) -> None:
        tot = self.state.tot
        hosts = self.search.hosts
        for h in self.dirty:
            perf: float = 0
            for j in hosts[h]:
                perf += tot[j]
            self.sums[h] = perf
            self.version[h] += 1
            heapq.heappush(self.heap, (perf, h, self.version[h]))
        self.dirty.clear()

    def place_group(
        self, proposal: Sequence[int], positions: list[int], assigned: list[list[int] | None]
    ) -> bool:
        opts = self.search.opts
        gh = gd = gx = 0
        for pos in positions:
            h, d, x = opts[proposal[pos]].total_storage
            gh, gd, gx = gh + h, gd + d, gx + x
        self._refresh()
        heap, version = self.heap, self.version
        popped: list[tuple[float, int, int]] = []
        try:
            while heap:
                entry = heapq.heappop(heap)
                if entry[2] != version[entry[1]]:
                    continue  # a stale key: the host has a newer one
                popped.append(entry)
                if self._try_host(entry[1], proposal, positions, assigned, gh, gd, gx):
                    return True
            return False
        finally:
            for entry in popped:
                heapq.heappush(heap, entry)

    def _try_host(
        self,
        h_idx: int,
        proposal: Sequence[int],
        positions: list[int],
        assigned: list[list[int] | None],
        gh: int,
        gd: int,
        gx: int,
    ) -> bool:
        """Place the group on host ``h_idx`` if it fits (else leave every device as it was)."""
        search = self.search
        opts = search.opts
        state = self.state
        devs = search.hosts[h_idx]
        sh = sd = sx = 0
        for j in devs:
            sh, sd, sx = sh + state.hbm[j], sd + state.ddr[j], sx + state.ssd[j]
        if not (gh <= sh and gd <= sd and gx <= sx):
            return False
        n_local = len(devs)
        undo: list[tuple[Any, ...]] = []
        heap: list[tuple[float, int, int, int]] | None = None
        trial: dict[int, list[int]] = {}
        success = True
        for pos in positions:
            o = opts[proposal[pos]]
            if o.sharding_type == ShardingType.TABLE_ROW_WISE.value:
                if o.n != n_local:
                    success = False
                    break
                for k, j in enumerate(devs):
                    nh, nd, ns = o.st[k]
                    if not (nh <= state.hbm[j] and nd <= state.ddr[j] and ns <= state.ssd[j]):
                        success = False
                        break
                    state.apply(o, k, j, undo)
                if not success:
                    break
                trial[pos] = [search.ranks[j] for j in devs]
                heap = None
            elif o.sharding_type == ShardingType.TABLE_COLUMN_WISE.value:
                if heap is None:
                    heap = [
                        (state.tot[j], search.ranks[j] % n_local, search.ranks[j], j) for j in devs
                    ]
                    heapq.heapify(heap)
                r = _device_place(o, heap, state, undo)
                if r is None:
                    success = False
                    break
                trial[pos] = [search.ranks[j] for j in r]
            else:
                success = False
                break
        if success:
            for pos, r in trial.items():
                assigned[pos] = r
            self.dirty.add(h_idx)
            return True
        for saved in reversed(undo):
            state.restore(saved)
        return False


def _device_place(
    o: Opt,
    heap: list[tuple[float, int, int, int]],
    state: _State,
    undo: list[tuple[Any, ...]] | None,
) -> list[int] | None:
    """``GreedyPerfPartitioner._device_partition``: each shard to the least loaded device that fits.

    The heap holds ``(perf.total, rank % local_world_size, rank, device index)``, the stock order.
    Returns the device index of each shard, or ``None`` where no device fits a shard.
    """
    out: list[int] = []
    hbm, ddr, ssd, tot = state.hbm, state.ddr, state.ssd, state.tot
    for s in range(o.n):
        nh, nd, ns = o.st[s]
        tmp = []
        while heap:
            entry = heap[0]
            j = entry[3]
            if nh <= hbm[j] and nd <= ddr[j] and ns <= ssd[j]:
                state.apply(o, s, j, undo)
                heapq.heapreplace(heap, (tot[j], entry[1], entry[2], j))
                out.append(j)
                break
            tmp.append(heapq.heappop(heap))
        else:
            heap.extend(tmp)
            return None
        for e in tmp:
            heapq.heappush(heap, e)
    return out
