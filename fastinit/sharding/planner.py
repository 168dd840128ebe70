"""``FastPlanner``: TorchRec's ``EmbeddingShardingPlanner`` plan, found much sooner.

The stock planner (torchrec 1.8.0) evaluates every proposal its proposers make by deep-copying the
devices and the proposal, placing every shard with Python objects, and rating the result. Most of
its time goes to those copies, to per-shard estimator work repeated for identical shards, and to
deep copies of the search space and of each new best plan.

``FastPlanner`` runs the same search and returns the same plan:

* the same enumeration, with estimators that compute each distinct shard once
  (``mirror.planner.enumerators.FastEnumerator``), so the search space holds the same numbers. Shards are
  described, not built (``mirror.planner.types.CompactOption``: a data-parallel option's ``W`` alike shards
  are one size, one storage, one perf and a count); only the chosen options' shards are built;
* the same proposers (grid search, the two greedy ones, uniform), replayed on indices, in the
  same order, with the same proposal cache. Proposals are streamed as the positions that change
  (``_Stream``): hashing, de-duplication and rating bounds cost the changes, not the table count;
* the same greedy partitioner, replayed on flat per-device arrays: uniform (data-parallel,
  row-wise) shards are placed with vector operations, table-wise and column-wise shards go to the
  least-loaded device that fits (what the stock min-heap walk computes), table-row-wise and
  table-column-wise groups to the first host, in the stock host order, where they fit. Floating
  point sums are made in the stock order, so ratings are bit-identical;
* proposals that cannot win are not partitioned. With the stock proposers (grid search, the two
  greedy ones, uniform) the whole proposal sequence is known before any rating, and the stock
  loop keeps the first proposal with the lowest rating. So every proposal gets a lower bound of
  its rating (the average load per rank, and the load of the rank holding its largest shard),
  proposals are partitioned in increasing order of that bound, and the search stops when the
  next bound exceeds the best rating found. With a timeout, or a greedy proposer with a
  ``threshold`` (its proposals depend on ratings), proposals run one by one in stock order and a
  proposal is skipped only when its bound already reaches the best rating. Either way the plan is
  the stock plan; only ``_num_plans`` (partitions actually run) is smaller.

When the search finds no plan, the last failed proposal is partitioned once more by the stock
partitioner to raise exactly the stock error. Settings the fast search does not replay (a custom
partitioner, performance model or proposer, a plan loader, grid sharding, ...) make ``plan`` call
the stock ``EmbeddingShardingPlanner.plan``: same plan, stock speed.

The cost model (how each stage grows with tables, ranks and proposals) is in docs/planner.md.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from decimal import Decimal
from functools import reduce
from time import perf_counter
from typing import Any, cast

import numpy as np
from torch import nn
from torchrec.distributed.planner.constants import MAX_SIZE
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.perf_models import NoopPerfModel
from torchrec.distributed.planner.planners import (
    EmbeddingShardingPlanner,
    to_sharding_plan,
    validate_compute_kernels,
    validate_modules_inclusion_in_sharding_plan,
    validate_rank_assignment,
)
from torchrec.distributed.planner.proposers import (
    GreedyProposer,
    GridSearchProposer,
    UniformProposer,
)
from torchrec.distributed.planner.storage_reservations import (
    FixedAbsoluteStorageReservation,
    HeuristicalStorageReservation,
)
from torchrec.distributed.planner.types import (
    Enumerator,
    ParameterConstraints,
    PartitionByType,
    Partitioner,
    PerfModel,
    PlanDebugStats,
    PlanLoader,
    PlannerError,
    PlannerErrorType,
    Proposer,
    ShardingOption,
    Stats,
    Storage,
    StorageReservation,
    Topology,
)
from torchrec.distributed.planner.utils import bytes_to_gb, reset_shard_rank, storage_repr_in_gb
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType

from fastinit.sharding import _torchrec as _tr
from fastinit.sharding.mirror.planner import enumerators as _en
from fastinit.sharding.mirror.planner import types as _ty

__all__ = ["FastPlanner"]

logger: logging.Logger = logging.getLogger(__name__)

_UNIFORM = 0
_DEVICE = 1
_HOST = 2
_CW_KEY_VALUE = 3

# Relative slack for pruning: a float sum of n non-negative terms is within n * 2**-53 of the exact
# sum; 1e-9 covers a million terms with room to spare.
_PRUNE_SLACK = 1e-9


class _Opt:
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
            self.kind = _UNIFORM
        elif pb == PartitionByType.DEVICE.value:
            is_cw_kv = (
                so.compute_kernel == "key_value"
                and so.sharding_type == ShardingType.COLUMN_WISE.value
            )
            self.kind = _CW_KEY_VALUE if is_cw_kv else _DEVICE
        elif pb == PartitionByType.HOST.value:
            self.kind = _HOST
        else:
            raise _Unsupported(f"partition_by={pb}")
        self.sharding_type = so.sharding_type
        n = self.n = c.n
        if not n:
            raise _Unsupported("an option without shards")
        st_d = self.st_d = c.st
        self.st_pos = c.st_pos
        # Perf fields (_perf_fields order) -> the five that Perf.total adds up
        pf_d = self.pf_d = [(f[0], f[1], f[2], f[3], f[5]) for f in c.pf]
        self.pf_pos = c.pf_pos
        if not all(type(v) is int and v >= 0 for t in st_d for v in t):
            raise _Unsupported("non-integer or negative storage")
        if not all(type(v) in (int, float) and math.isfinite(v) for t in pf_d for v in t):
            raise _Unsupported("non-finite perf")
        # Perf.total = fwd_compute + bwd_compute + fwd_comms + bwd_comms + prefetch_compute
        tot_d = self.tot_d = [t[0] + t[2] + t[1] + t[3] + t[4] for t in pf_d]
        if not all(math.isfinite(t) for t in tot_d):
            raise _Unsupported("non-finite perf total")
        tot = self.tot_full()
        # proposers._sharding_option_score: max([...]) / sum([...]) of the shards' perf totals
        self.score_depth = max(tot_d)
        self.score_sum = sum(tot)
        # the exact sum (what math.fsum rounds), as an integer multiple of 2**-_EXACT_BITS
        if self.pf_pos is None:
            self.tot_exact = n * _exact(tot_d[0])
        else:
            pf_counts = _counts(self.pf_pos, len(tot_d), n)
            self.tot_exact = sum(k * _exact(t) for k, t in zip(pf_counts, tot_d))
        self.tot_sum = self.tot_exact / (1 << _EXACT_BITS)
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
        self.const = self.kind == _UNIFORM and len(st_d) == 1 and len(pf_d) == 1
        if self.kind == _UNIFORM:
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


class _Unsupported(Exception):
    """A search space or setting the fast search does not replay (the stock planner runs)."""


def _score(opt: _Opt, use_depth: bool) -> float:
    """``proposers._sharding_option_score``: ``max`` or ``sum`` of the shards' ``perf.total``.

    Computed as the stock function does (``max([...])`` / ``sum([...])`` of the same list), once.
    """
    return opt.score_depth if use_depth else opt.score_sum


def _by_fqn(opts: Sequence[_Opt], indices: Sequence[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in indices:
        out.setdefault(opts[i].fqn, []).append(i)
    return out


# ---- proposers, replayed on option indices -------------------------------------------------------
#
# Every stock proposer (grid search, greedy, uniform) proposes one option per table (fqn), listed
# in the order the tables first appear in the search space. A proposal is therefore a vector:
# position f holds the option chosen for the f-th table. Consecutive proposals of one proposer
# differ in few positions (greedy: exactly one), so each replay hands over only the positions
# that change, as ``(f, option index)`` pairs; the first proposal lists every position.

_Changes = list[tuple[int, int]]


class _ProposerReplay:
    """The proposal sequence of one stock proposer, as changes of the proposal vector."""

    needs_rating: bool = False

    def propose(self) -> _Changes | None:
        """The current proposal as changes from this proposer's previous one; None when done."""
        raise NotImplementedError

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Write back state the stock proposer carries between ``plan`` calls."""


class _GridReplay(_ProposerReplay):
    """``GridSearchProposer``: ``itertools.product`` of the per-table lists, as an odometer."""

    def __init__(self, opts: Sequence[_Opt], lists: list[list[int]], max_proposals: int) -> None:
        self._lists = [sorted(lst, key=lambda i: _score(opts[i], True)) for lst in lists]
        total = reduce(lambda a, b: a * b, (len(lst) for lst in self._lists), 1)
        self._next: _Changes | None = None
        if total > max_proposals:
            # the stock message; a product of thousands of lengths has more digits than
            # int -> str allows by default, hence Decimal (as stock does above 1e6)
            shown = f"{Decimal(total):.2e}" if total > 1e6 else total
            logger.info(
                "Skipping grid search proposer as there are too many proposals.\n"
                f"Total proposals to search: {shown}\n"
                f"Max proposals allowed: {max_proposals}\n"
            )
            return
        self._idx = [0] * len(self._lists)
        # itertools.product advances the last position fastest; positions with one option never move
        self._movable = [f for f, lst in enumerate(self._lists) if len(lst) > 1][::-1]
        if self._lists:
            self._next = [(f, lst[0]) for f, lst in enumerate(self._lists)]

    def propose(self) -> _Changes | None:
        return self._next

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        changes: _Changes = []
        for f in self._movable:
            lst = self._lists[f]
            i = self._idx[f] + 1
            if i < len(lst):
                self._idx[f] = i
                changes.append((f, lst[i]))
                self._next = changes
                return
            self._idx[f] = 0
            changes.append((f, lst[0]))
        self._next = None


class _GreedyReplay(_ProposerReplay):
    """``GreedyProposer``: each step moves the table with the largest storage to its next option."""

    def __init__(
        self, opts: Sequence[_Opt], lists: list[list[int]], proposer: GreedyProposer
    ) -> None:
        self._proposer = proposer
        use_depth, threshold, best, inferior = _tr.greedy_proposer_state(proposer)
        self._threshold = threshold if threshold else None
        self.needs_rating = self._threshold is not None
        self._best = best
        self._inferior = inferior
        self._lists = [sorted(lst, key=lambda i: _score(opts[i], use_depth)) for lst in lists]
        self._keys = {i: opts[i].greedy_key for lst in self._lists for i in lst}
        self._cur: list[int] | None = [0] * len(self._lists)
        self._next: _Changes | None = [(f, lst[0]) for f, lst in enumerate(self._lists)]
        if not self._lists:
            self._cur = None
        self._heap: list[tuple[tuple[int, ...], int, int]] = []
        for f in range(len(self._lists)):
            self._push(f)

    def _push(self, f: int) -> None:
        assert self._cur is not None
        idx = self._cur[f]
        lst = self._lists[f]
        if idx + 1 < len(lst):
            key = self._keys[lst[idx]]
            heapq.heappush(self._heap, (tuple(-k for k in key), f, idx))

    def propose(self) -> _Changes | None:
        if not self._cur:
            return None
        return self._next

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        assert self._cur is not None
        if self._threshold and perf_rating:
            self._inferior += 1
            if perf_rating < self._best:
                self._best = perf_rating
                self._inferior = 0
            if self._inferior > self._threshold:
                self._cur = None
                return
        heap = self._heap
        while heap and heap[0][2] != self._cur[heap[0][1]]:
            heapq.heappop(heap)
        # stock: the first fqn (in order) with the largest storage tuple, strictly above zero
        if heap and tuple(-k for k in heap[0][0]) > (0, 0, 0, 0):
            _, f, _ = heapq.heappop(heap)
            self._cur[f] += 1
            self._next = [(f, self._lists[f][self._cur[f]])]
            self._push(f)
        else:
            self._cur = None

    def finish(self) -> None:
        _tr.set_greedy_proposer_state(self._proposer, self._best, self._inferior)


class _UniformReplay(_ProposerReplay):
    """``UniformProposer``: per sharding type held by every table, each table's best option."""

    def __init__(self, opts: Sequence[_Opt], fqn_pos: dict[str, int], use_depth: bool) -> None:
        by_type: dict[str, dict[str, list[int]]] = {}
        for i, o in enumerate(opts):
            by_type.setdefault(o.sharding_type, {}).setdefault(o.fqn, []).append(i)
        self._proposals: list[_Changes] = []
        for by_fqn in by_type.values():
            for lst in by_fqn.values():
                lst.sort(key=lambda i: _score(opts[i], use_depth))
            if by_fqn.keys() == fqn_pos.keys():
                changes = [(fqn_pos[fqn], lst[0]) for fqn, lst in by_fqn.items()]
                if [f for f, _ in changes] != list(range(len(changes))):
                    raise _Unsupported("a uniform proposal lists tables in another order")
                self._proposals.append(changes)
        self._index = 0

    def propose(self) -> _Changes | None:
        if self._index < len(self._proposals):
            return self._proposals[self._index]
        return None

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        self._index += 1


# ---- the proposal sequence, kept as changes -------------------------------------------------------

# Exact sums of floats: every finite double is an integer multiple of 2**-1074.
_EXACT_BITS = 1100


def _exact(x: float) -> int:
    """``x * 2**_EXACT_BITS`` as an exact integer."""
    num, den = float(x).as_integer_ratio()
    return num << (_EXACT_BITS + 1 - den.bit_length())


class _Stream:
    """The proposals of all proposers, in order, as one vector updated by changes.

    For the current proposal it keeps, updated per change (so a proposal costs its changes, not
    the table count): a 64-bit Zobrist hash of the vector, the exact sums behind the rating's
    lower bound, and the largest non-uniform shard. Any earlier proposal's vector is rebuilt from
    a checkpoint and the change log (checkpoints every ``T / 16`` changes: rebuilding costs
    ``O(T)``, and the checkpoints take ``O(16 x changes)`` memory).
    """

    def __init__(
        self,
        opts: Sequence[_Opt],
        n_tables: int,
        rating_ws: int,
        classes: Sequence[int] | None = None,
    ) -> None:
        self.n_tables = n_tables
        self.rating_ws = rating_ws
        self.cur = [-1] * n_tables
        # a private generator with a fixed seed: the same hashes every run, no global RNG drawn
        rng = np.random.default_rng(0x5EED)
        self._z = rng.integers(1, 1 << 62, size=len(opts), dtype=np.int64).tolist()
        self.h = 0
        # the same for the vector of partition classes (``_partition_classes``): proposals that
        # partition and rate alike share ``hc``
        self.classes = list(classes) if classes is not None else list(range(len(opts)))
        zc = rng.integers(1, 1 << 62, size=max(self.classes, default=-1) + 1, dtype=np.int64)
        self._zc = [int(zc[c]) for c in self.classes]
        self.hc = 0
        self.hcs: list[int] = []
        self._v_tot = [o.tot_exact for o in opts]
        self._v_umin = [_exact(o.tot_min) if o.kind == _UNIFORM else 0 for o in opts]
        self._nu = [0.0 if o.kind == _UNIFORM else o.tot_max for o in opts]
        self._s_tot = 0
        self._s_umin = 0
        self._heap: list[tuple[float, int, int]] = []
        self._log_f: list[int] = []
        self._log_o: list[int] = []
        self._ckpt_at: list[int] = [0]
        self._ckpt_vec: list[list[int]] = [list(self.cur)]
        self._interval = max(64, n_tables // 16)
        self.ends: list[int] = []

    def apply(self, changes: _Changes) -> int:
        """Make ``changes`` the current proposal; returns its index in the stream."""
        cur = self.cur
        z, zc, v_tot, v_umin, nu = self._z, self._zc, self._v_tot, self._v_umin, self._nu
        for f, o in changes:
            old = cur[f]
            if old == o:
                continue
            if old >= 0:
                self.h ^= z[old]
                self.hc ^= zc[old]
                self._s_tot -= v_tot[old]
                self._s_umin -= v_umin[old]
            self.h ^= z[o]
            self.hc ^= zc[o]
            self._s_tot += v_tot[o]
            self._s_umin += v_umin[o]
            heapq.heappush(self._heap, (-nu[o], f, o))
            cur[f] = o
            self._log_f.append(f)
            self._log_o.append(o)
        n_log = len(self._log_f)
        if n_log - self._ckpt_at[-1] >= self._interval:
            self._ckpt_at.append(n_log)
            self._ckpt_vec.append(list(cur))
        self.ends.append(n_log)
        self.hcs.append(self.hc)
        return len(self.ends) - 1

    def class_vector(self, s: int) -> list[int]:
        """The partition classes of proposal ``s``, position by position."""
        return list(map(self.classes.__getitem__, self.vector(s)))

    def bound(self) -> float:
        """A lower bound of the current proposal's rating (``_Search.lower_bound``)."""
        heap, cur = self._heap, self.cur
        while heap and cur[heap[0][1]] != heap[0][2]:
            heapq.heappop(heap)
        largest = -heap[0][0] if heap else 0.0
        scale = 1 << _EXACT_BITS
        avg = (self._s_tot / scale) / self.rating_ws
        return max(avg, self._s_umin / scale + largest)

    def vector(self, s: int) -> list[int]:
        """The vector of proposal ``s`` of the stream."""
        end = self.ends[s]
        k = bisect.bisect_right(self._ckpt_at, end) - 1
        vec = list(self._ckpt_vec[k])
        log_f, log_o = self._log_f, self._log_o
        for p in range(self._ckpt_at[k], end):
            vec[log_f[p]] = log_o[p]
        return vec

    def find(self, seen: dict[int, list[int]], s: int) -> int | None:
        """The earlier proposal in ``seen`` equal to the current one (``s``), else record ``s``."""
        earlier = seen.get(self.h)
        if earlier is None:
            seen[self.h] = [s]
            return None
        for e in earlier:
            if self.vector(e) == self.cur:
                return e
        earlier.append(s)
        return None


# ---- the partitioner, replayed on flat arrays ----------------------------------------------------


class _Cut(Exception):
    """A device's load passed the cutoff: the proposal cannot beat the best one found."""


class _CutType:
    """The type of ``_CUT``, what ``_Search.evaluate`` returns for a partition it stopped."""


_CUT = _CutType()


class _ScalarType:
    """The type of ``_SCALAR``: a proposal that left ``_Search.evaluate_batch`` (evaluate it alone)."""


_SCALAR = _ScalarType()


def _partition_classes(opts: Sequence[_Opt]) -> list[int]:
    """A class per option: options of one table that the partitioner and the rating treat alike.

    ``_Search.evaluate`` and ``_Search._rate`` read of a non-uniform option only its kind, its
    group, module path and table, its shard count, per-shard storage and perf, and its totals;
    a device-placed option's sharding type is not read (a one-shard column-wise option is placed
    as a table-wise one). Two proposals whose options are alike position by position get the
    same ranks and the same rating. Uniform options keep a class of their own.
    """
    seen: dict[tuple[Any, ...], int] = {}
    out = []
    for i, o in enumerate(opts):
        if o.kind == _UNIFORM:
            key: tuple[Any, ...] = ("uniform", i)
        else:
            key = (
                o.fqn,
                o.group,
                o.path,
                o.kind,
                o.sharding_type if o.kind != _DEVICE else "",
                o.n,
                tuple(o.st),
                tuple(o.pf),
                tuple(o.tot),
                o.total_perf,
                o.total_storage,
            )
        out.append(seen.setdefault(key, len(seen)))
    return out


class _Search:
    """``GreedyPerfPartitioner.partition`` + ``NoopPerfModel.rate`` on option indices.

    Device state lives in flat lists indexed by device: remaining ``hbm``/``ddr``/``ssd`` (ints)
    and the five ``Perf`` components that ``Perf.total`` adds up, accumulated shard by shard in the
    stock order, so every comparison sees the stock floats.
    """

    #: hosts per block in ``evaluate_batch``'s search for the least loaded host
    host_block = 32

    def __init__(
        self,
        opts: list[_Opt],
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
            raise _Unsupported("devices are not ranks 0..n-1 of the rated world")
        st0 = [(d.storage.hbm, d.storage.ddr, d.storage.ssd) for d in devices]
        if not all(type(v) is int for s in st0 for v in s):
            raise _Unsupported("non-integer device storage")
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
            raise _Unsupported("non-numeric device perf")
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
            raise _Unsupported("hosts reach past the devices")
        self.all_tot_nonneg = all(t >= 0 for o in opts for t in o.tot_d)
        # every perf component >= 0 (options and devices): a device's load, summed in any order,
        # is then within n * 2**-53 of its exact value and never decreases as shards are placed,
        # so a partition may stop once a load exceeds the best rating (``evaluate``'s ``cutoff``)
        self.can_cut = all(v >= 0 for o in opts for t in o.pf_d for v in t) and all(
            v >= 0 for p in pf0 for v in p
        )
        self.classes = _partition_classes(opts)
        kinds = np.array([o.kind for o in opts])
        uniform = kinds == _UNIFORM
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
        ``n * 2**-53`` of the exact sums). Called with ``cutoff = best * (1 + _PRUNE_SLACK)``, a
        proposal that is stopped has a rating above ``best``. Without ``can_cut`` (a negative
        perf component) the partition runs to the end.

        Returns:
            what ``evaluate`` returns, or ``_CUT`` where the partition stopped.
        """
        try:
            return self._evaluate(proposal, cutoff if self.can_cut else None)
        except _Cut:
            return _CUT

    def _evaluate(
        self, proposal: Sequence[int], cutoff: float | None
    ) -> tuple[list[list[int]], float] | None:
        opts = self.opts
        n_dev = self.n_dev
        dev_ranks = self.ranks
        assigned: list[list[int] | None] = [None] * len(proposal)

        # 1. uniform options (data parallel, row wise), in proposal order
        uni = [pos for pos, i in enumerate(proposal) if opts[i].kind == _UNIFORM]
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
            if opts[i].kind != _UNIFORM:
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
                if kind == _HOST:
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
                if kind == _CW_KEY_VALUE:
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
        """``NoopPerfModel.rate``: per-rank sums in proposal order, then the maximum."""
        opts = self.opts
        perfs = np.zeros(self.rating_ws, dtype=np.float64)
        run_r: list[int] = []
        run_t: list[float] = []
        for pos, i in enumerate(proposal):
            o = opts[i]
            if o.kind == _UNIFORM and o.n == self.rating_ws:
                if run_r:
                    np.add.at(perfs, run_r, run_t)
                    run_r, run_t = [], []
                if o.const:
                    perfs += o.tot_d[0]
                else:
                    perfs += o.vecs()[2]
            else:
                run_r.extend(ranks[pos])
                run_t.extend(o.tot if o.kind != _UNIFORM else o.tot_full())
        if run_r:
            np.add.at(perfs, run_r, run_t)
        return float(perfs.max())

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
        are not the alike ones of the scalar path, leaves the batch: its entry is ``_SCALAR``
        and the caller evaluates it alone.

        Returns:
            per proposal ``(ranks getter, rating)`` or ``_SCALAR``; None where the batch does not
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
            if o.kind == _UNIFORM:
                if o.n != n_dev or not o.const:
                    alive[mem] = False
                    continue
                for arr, v in zip(bst, o.st_d[0]):
                    arr[mem] -= v
                for arr_f, v_f in zip(bpf, o.pf_d[0]):
                    arr_f[mem] += v_f
                uni_cols.append((f, i, mem))
            elif o.kind == _DEVICE or (
                o.kind == _HOST and o.sharding_type == ShardingType.TABLE_COLUMN_WISE.value
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
            if o.kind == _HOST:
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
                    self.ranks if kinds[i] == _UNIFORM else [] for i in vec.tolist()
                ]
                for f, _, _, idx, j in rec:
                    p = int(np.searchsorted(idx, m))
                    if p < len(idx) and idx[p] == m:
                        out[f].append(int(j[p]))
                return out

            return build

        return [(ranks_of(m), ratings[m]) if alive[m] else _SCALAR for m in range(n_b)]

    def _cw_kv_place(
        self, o: _Opt, heap: list[tuple[float, int, int, int]], state: _State
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

    def apply(self, o: _Opt, s: int, j: int, undo: list[tuple[Any, ...]] | None) -> None:
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

    def __init__(self, search: _Search, state: _State) -> None:
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
    o: _Opt,
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


_Best = tuple[list[int], list[list[int]]]


def _proposal_storage(opts: Sequence[_Opt], proposal: Sequence[int]) -> Storage:
    """The sum of every shard's storage in ``proposal`` (integers: any order gives the same)."""
    h = d = x = 0
    for i in proposal:
        a, b, c = opts[i].total_storage
        h, d, x = h + a, d + b, x + c
    return Storage(h, d, x)


# ---- the planner ---------------------------------------------------------------------------------


_PLAN = "torchrec.distributed.planner.planners:EmbeddingShardingPlanner.plan"


def _reservation_text(reservation: StorageReservation) -> str:
    """The storage-reservation part of the stock "no plan" message, in the installed release's
    words: 1.8.0 reads ``_percentage`` of any other reservation (an ``AttributeError`` where it
    has none, as stock raises); 1.9 describes ``SKUAwareStorageReservation`` and names a
    reservation without a percentage."""
    from fastinit import ports

    res = _tr.storage_reservation_details(reservation)
    legacy = ports.mirrors_release(_PLAN, "torchrec 1.8.0")
    sku_aware = _tr.sku_aware_reservation_class()
    if isinstance(reservation, HeuristicalStorageReservation):
        return (
            f"\n\t  Storage reservation percentage: {res['percentage']}, "
            f"\n\t  Per rank reservation for dense storage: {storage_repr_in_gb(res['dense_storage'])}, "
            f"\n\t  Per rank reservation for kjt storage: {storage_repr_in_gb(res['kjt_storage'])}, "
        )
    if isinstance(reservation, FixedAbsoluteStorageReservation):
        return f"\n\t  Storage reservation: {round(bytes_to_gb(res['hbm_reserved_bytes']), 3)} GB per device, "
    if not legacy and sku_aware is not None and isinstance(reservation, sku_aware):
        sku = _tr.sku_aware_reservation_details(reservation)
        static_base = (
            f"Measured model base: {round(bytes_to_gb(sku['model_base_bytes']), 3)} GB"
            if sku["model_base_bytes"] is not None
            else f"Home-anchored margin: {round(bytes_to_gb(sku['margin_bytes']), 3)} GB"
        )
        return (
            f"\n\t  {static_base}, "
            f"\n\t  Per rank reservation for dense storage: {storage_repr_in_gb(res['dense_storage'])}, "
            f"\n\t  Per rank reservation for kjt storage: {storage_repr_in_gb(res['kjt_storage'])}, "
            f"\n\t  Runtime overhead: {round(bytes_to_gb(sku['runtime_overhead_bytes']), 3)} GB"
        )
    if legacy:
        return f"\n\t  Storage reservation percentage: {_tr.reservation_percentage(reservation)}, "
    percentage = res["percentage"]
    if percentage is not None:
        return f"\n\t  Storage reservation percentage: {percentage}, "
    return f"\n\t  Storage reservation: {type(reservation).__name__}, "


class FastPlanner(EmbeddingShardingPlanner):
    """``EmbeddingShardingPlanner`` that returns the same plan, much sooner.

    Takes the arguments of ``torchrec.distributed.planner.EmbeddingShardingPlanner`` (1.8.0) and
    returns, for the same inputs, the same ``ShardingPlan`` (sharding types, compute kernels,
    ranks, shard offsets and sizes, placements, cache parameters, ...), or raises the same
    ``PlannerError`` with the same message when nothing fits. ``collective_plan`` is inherited.

    Args:
        topology (Optional[Topology]): the topology of the current process group.
        batch_size (Optional[int]): the batch size of the model.
        enumerator (Optional[Enumerator]): the enumerator to use. By default, TorchRec's
            ``EmbeddingEnumerator`` with estimators that compute each distinct shard once.
        storage_reservation (Optional[StorageReservation]): the storage reservation to use.
        proposer (Optional[Union[Proposer, List[Proposer]]]): the proposer(s) to use.
        partitioner (Optional[Partitioner]): the partitioner to use.
        performance_model (Optional[PerfModel]): the performance model to use.
        stats (Optional[Union[Stats, List[Stats]]]): the stats to use.
        constraints (Optional[Dict[str, ParameterConstraints]]): per table constraints.
        debug (bool): whether to print debug information.
        callbacks (Optional[List[Callable]]): callback functions applied to the best plan.
        timeout_seconds (Optional[int]): timeout for planning in seconds.
        plan_loader (Optional[PlanLoader]): loads a stored plan (planned by the stock planner).

    Example::

        ebc = EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta"))
        planner = FastPlanner(topology=Topology(world_size=8, compute_device="cuda"))
        plan = planner.plan(module=ebc, sharders=[EmbeddingBagCollectionSharder()])
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator: Enumerator | None = None,
        storage_reservation: StorageReservation | None = None,
        proposer: Proposer | list[Proposer] | None = None,
        partitioner: Partitioner | None = None,
        performance_model: PerfModel | None = None,
        stats: Stats | list[Stats] | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        debug: bool = True,
        callbacks: list[Callable[[list[ShardingOption]], list[ShardingOption]]] | None = None,
        timeout_seconds: int | None = None,
        plan_loader: PlanLoader | None = None,
    ) -> None:
        from fastinit import compat

        compat.require("planner")
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator,
            storage_reservation=storage_reservation,
            proposer=proposer,
            partitioner=partitioner,
            performance_model=performance_model,
            stats=stats,
            constraints=constraints,
            debug=debug,
            callbacks=callbacks,
            timeout_seconds=timeout_seconds,
            plan_loader=plan_loader,
        )
        if enumerator is None:
            self._enumerator = _en.FastEnumerator(
                topology=self._topology,
                batch_size=self._batch_size,
                constraints=constraints,
            )
        #: why the last ``plan`` call ran the stock planner (None: the fast search ran)
        self.fallback_reason: str | None = None
        self._num_cut = 0
        self._num_twins = 0
        self._num_batched = 0

    #: the offline search partitions proposals together (``_Search.evaluate_batch``) when at least
    #: ``_batch_min`` of them have a bound below the best rating found, up to ``_batch_max``
    _batch_min = 8
    _batch_max = 512

    if hasattr(EmbeddingShardingPlanner, "get_search_space"):  # torchrec 1.9

        def get_search_space(self) -> list[ShardingOption] | None:
            """The enumerated search space of the last ``plan`` (as the stock planner keeps it),
            its options' shards built on first call."""
            space = self.__dict__.pop("_fastinit_space", None)
            if space is not None:
                self._search_space = [c.materialise() for c in space]
            return cast(Any, super()).get_search_space()

    def _static_blocker(self) -> str | None:
        if self.plan_loader is not None:
            return "plan_loader is set"
        if type(self._partitioner) is not GreedyPerfPartitioner:
            return f"partitioner {type(self._partitioner).__name__}"
        if type(self._perf_model) is not NoopPerfModel:
            return f"performance model {type(self._perf_model).__name__}"
        for p in self._proposers:
            if type(p) not in (GridSearchProposer, GreedyProposer, UniformProposer):
                return f"proposer {type(p).__name__}"
        return None

    def plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
    ) -> ShardingPlan:
        """Provides the sharding plan ``EmbeddingShardingPlanner.plan`` provides, sooner.

        Args:
            module (nn.Module): the module to shard.
            sharders (List[ModuleSharder[nn.Module]]): the sharders to use for sharding.

        Returns:
            ShardingPlan: the sharding plan for the module.
        """
        # Planning allocates a few objects per shard (hundreds of thousands at hundreds of ranks)
        # and frees nothing until it returns: pausing the cyclic collector meanwhile halves the
        # time. It is switched back on, as it was, before returning.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        self.__dict__.pop("_fastinit_space", None)
        try:
            self.fallback_reason = self._static_blocker()
            if self.fallback_reason is None:
                try:
                    return self._fast_plan(module, sharders)
                except _Unsupported as e:
                    self.fallback_reason = str(e)
            logger.info(f"FastPlanner: running the stock planner ({self.fallback_reason})")
            return super().plan(module, sharders)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _fast_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
    ) -> ShardingPlan:
        self._num_proposals = 0
        self._num_plans = 0
        #: partitions stopped early (a load above the best rating) and proposals that took the
        #: ranks and rating of an alike one; neither is in ``_num_plans``
        self._num_cut = 0
        self._num_twins = 0
        self._num_batched = 0
        start_time = perf_counter()
        storage_constraint: Topology = self._storage_reservation.reserve(
            topology=self._topology,
            batch_size=self._batch_size,
            module=module,
            sharders=sharders,
            constraints=self._constraints,
        )
        if isinstance(self._enumerator, _en.FastEnumerator):
            space = self._enumerator.enumerate_compact(module=module, sharders=sharders)
        else:
            try:
                space = [
                    _ty.CompactOption.from_option(so)
                    for so in self._enumerator.enumerate(module=module, sharders=sharders)
                ]
            except _ty.CompactUnsupported as e:
                raise _Unsupported(str(e)) from e
        if hasattr(self, "_search_space"):  # 1.9: get_search_space() gives it (built on demand)
            cast(Any, self)._search_space = None
            self._fastinit_space = space
        if not space:
            return ShardingPlan({})

        opts = [_Opt(c) for c in space]
        seen: set[tuple[str, str, str]] = set()
        fqn_pos: dict[str, int] = {}
        lists: list[list[int]] = []
        for i, o in enumerate(opts):
            k = (o.fqn, o.so.sharding_type, o.so.compute_kernel)
            if k in seen:
                # the stock proposal cache keys on option hashes; keep its semantics exactly
                raise _Unsupported("two options with the same fqn, sharding type and kernel")
            seen.add(k)
            f = fqn_pos.setdefault(o.fqn, len(fqn_pos))
            if f == len(lists):
                lists.append([])
            lists[f].append(i)
        sort_by, balance_modules = _tr.partitioner_settings(self._partitioner)
        search = _Search(
            opts,
            storage_constraint,
            rating_world_size=_tr.perf_model_world_size(self._perf_model),
            sort_by_perf=sort_by == "perf",
            balance_modules=balance_modules,
        )

        replays: list[_ProposerReplay] = []
        for p in self._proposers:
            if type(p) is GridSearchProposer:
                replays.append(_GridReplay(opts, lists, _tr.grid_max_proposals(p)))
            elif type(p) is GreedyProposer:
                replays.append(_GreedyReplay(opts, lists, p))
            else:
                replays.append(_UniformReplay(opts, fqn_pos, _tr.uniform_proposer_use_depth(p)))

        stream = _Stream(opts, len(lists), search.rating_ws, search.classes)
        if self._timeout_seconds or any(r.needs_rating for r in replays):
            best, last_failed, lowest_storage = self._search_online(replays, search, stream)
        else:
            best, last_failed, lowest_storage = self._search_offline(replays, search, stream)

        if best is not None:
            return self._finish(module, sharders, opts, best, start_time)
        self._raise_no_plan(
            sharders, storage_constraint, opts, last_failed, lowest_storage, start_time
        )
        raise AssertionError("unreachable")

    def _search_offline(
        self, replays: list[_ProposerReplay], search: _Search, stream: _Stream
    ) -> tuple[_Best | None, list[int] | None, Storage]:
        """The search when the proposal sequence does not depend on feedback (no timeout).

        The stock loop keeps the first proposal, in proposal order, whose rating is the lowest of
        all partitionable proposals (a new plan must be strictly better). The whole sequence is
        known up front here, so proposals are evaluated in increasing order of a lower bound of
        their rating, and the search stops when the next bound exceeds the best rating found.
        Proposals are streamed as changes (``_Stream``): hashing, de-duplication and bounds cost
        ``O(changes)`` per proposal; only evaluated proposals are rebuilt as vectors.
        """
        ids: list[int] = []  # stream index of each distinct proposal, in proposal order
        lbs_list: list[float] = []
        seen: dict[int, list[int]] = {}
        for replay in replays:
            changes = replay.propose()
            while changes is not None:
                s = stream.apply(changes)
                if stream.find(seen, s) is None:
                    ids.append(s)
                    lbs_list.append(stream.bound())
                replay.feedback(True, None)
                changes = replay.propose()
            replay.finish()
        del seen
        n = self._num_proposals = len(ids)

        lbs: np.ndarray | None = None
        order: Sequence[int] = range(n)
        if search.all_tot_nonneg and n > 1:
            lbs = np.array(lbs_list, dtype=np.float64)
            order = np.argsort(lbs, kind="stable").tolist()

        best: _Best | None = None
        best_idx = -1
        best_rating: float = MAX_SIZE
        failed: list[int] = []
        # proposals partitioned so far, by class hash: (j, result); a proposal whose options are
        # alike (``_partition_classes``) to an evaluated one's gets its ranks and rating
        done: dict[int, list[tuple[int, Any]]] = {}

        def twin_result(s: int) -> tuple[bool, Any]:
            for j2, res2 in done.get(stream.hcs[s], ()):
                if stream.class_vector(ids[j2]) == stream.class_vector(s):
                    return True, res2
            return False, None

        def take(j: int, vec: list[int], result: Any, twin: bool) -> None:
            """The stock rule: the first proposal (in proposal order) with the lowest rating."""
            nonlocal best, best_idx, best_rating
            if twin:
                self._num_twins += 1
            if result is None:
                failed.append(j)
                return
            if result is _CUT:
                # stopped above an earlier best rating: above the best one now
                if not twin:
                    self._num_cut += 1
                return
            if not twin:
                self._num_plans += 1
            ranks, rating = result
            if rating < best_rating or (
                best is not None and rating == best_rating and j < best_idx
            ):
                best, best_idx, best_rating = (vec, ranks), j, rating

        def cutoff_evaluate(vec: list[int]) -> Any:
            if best is None or not search.can_cut:
                return search.evaluate(vec)
            return search.evaluate_cut(vec, best_rating * (1 + _PRUNE_SLACK))

        batching = search.batch_ok and lbs is not None
        handled = [False] * len(order)
        p = 0
        while p < len(order):
            if handled[p]:
                p += 1
                continue
            j = order[p]
            if lbs is not None and best is not None and lbs[j] * (1 - _PRUNE_SLACK) > best_rating:
                break
            batch: list[int] = []
            batch_at: list[int] = []
            if batching and best is not None and lbs is not None:
                # every proposal whose bound is below the best rating found so far is
                # partitioned (or stopped) one by one anyway: partition alike ones together
                # (those that differ from the first in few tables: the merged list stays short)
                ref = search.canon[np.array(stream.vector(ids[j]), dtype=np.intp)]
                limit = max(8, len(ref) // 32)
                q = p
                while (
                    q < len(order)
                    and len(batch) < self._batch_max
                    and q - p < 4 * self._batch_max
                    and lbs[order[q]] * (1 - _PRUNE_SLACK) <= best_rating
                ):
                    if not handled[q]:
                        other = search.canon[np.array(stream.vector(ids[order[q]]), dtype=np.intp)]
                        if int(np.count_nonzero(other != ref)) <= limit:
                            batch.append(order[q])
                            batch_at.append(q)
                    q += 1
                if len(batch) < self._batch_min:
                    batch, batch_at = [], []
            if not batch:
                s = ids[j]
                vec = stream.vector(s)
                twin, result = twin_result(s)
                if not twin:
                    result = cutoff_evaluate(vec)
                    done.setdefault(stream.hcs[s], []).append((j, result))
                take(j, vec, result, twin)
                handled[p] = True
                p += 1
                continue
            # the batch: twins of earlier proposals, and of one another, take their results
            entries: list[tuple[int, list[int], int | None, Any]] = []
            pending: list[list[int]] = []
            pending_j: list[int] = []
            local: dict[int, list[int]] = {}
            for jb in batch:
                s = ids[jb]
                vec = stream.vector(s)
                twin, result = twin_result(s)
                if twin:
                    entries.append((jb, vec, None, result))
                    continue
                cls = stream.class_vector(s)
                for k in local.get(stream.hcs[s], ()):
                    if stream.class_vector(ids[pending_j[k]]) == cls:
                        break
                else:
                    k = len(pending)
                    local.setdefault(stream.hcs[s], []).append(k)
                    pending.append(vec)
                    pending_j.append(jb)
                entries.append((jb, vec, k, None))
            results = search.evaluate_batch(pending)
            if results is None:
                batching = False
                continue
            for k, r in enumerate(results):
                if r is _SCALAR:
                    results[k] = cutoff_evaluate(pending[k])
                else:
                    self._num_batched += 1
                jk = pending_j[k]
                done.setdefault(stream.hcs[ids[jk]], []).append((jk, results[k]))
            for jb, vec, at, result in entries:
                if at is None:
                    take(jb, vec, result, True)
                else:
                    take(jb, vec, results[at], pending_j[at] != jb)
            for q in batch_at:
                handled[q] = True
        if best is not None and callable(best[1]):
            best = (best[0], best[1]())

        lowest_storage = Storage(MAX_SIZE, MAX_SIZE, MAX_SIZE)
        last_failed: list[int] | None = None
        if best is None and failed:
            last_failed = stream.vector(ids[max(failed)])
            for j in sorted(failed):
                current = _proposal_storage(search.opts, stream.vector(ids[j]))
                if current < lowest_storage:
                    lowest_storage = current
        return best, last_failed, lowest_storage

    def _search_online(
        self, replays: list[_ProposerReplay], search: _Search, stream: _Stream
    ) -> tuple[_Best | None, list[int] | None, Storage]:
        """The stock proposal loop, proposal by proposal (a timeout, or feedback-driven proposers)."""
        lowest_storage = Storage(MAX_SIZE, MAX_SIZE, MAX_SIZE)
        best_perf_rating: float = MAX_SIZE
        seen: dict[int, list[int]] = {}
        # stream index of a proposal -> (partitionable, rating); partitionable None: pruned
        cache: dict[int, tuple[bool | None, float | None]] = {}
        best: _Best | None = None
        last_failed: list[int] | None = None
        can_prune = search.all_tot_nonneg
        start = time.time()
        for replay in replays:
            changes = replay.propose()
            while changes is not None:
                if self._timeout_seconds:
                    elapsed = time.time() - start
                    if elapsed > self._timeout_seconds:
                        logger.info(
                            f"Exceeded time limit of {self._timeout_seconds}s. Took {elapsed}s"
                        )
                        break
                s = stream.apply(changes)
                proposal = stream.cur
                earlier = stream.find(seen, s)
                if earlier is not None:
                    partitionable, rating = cache[earlier]
                    if partitionable is None and replay.needs_rating:
                        # pruned earlier, but this proposer's feedback reads the rating
                        result = search.evaluate(proposal)
                        partitionable = result is not None
                        rating = result[1] if result is not None else None
                        cache[earlier] = (partitionable, rating)
                    replay.feedback(bool(partitionable), rating)
                    changes = replay.propose()
                    continue

                self._num_proposals += 1
                if (
                    can_prune
                    and best is not None
                    and not replay.needs_rating
                    and stream.bound() * (1 - _PRUNE_SLACK) >= best_perf_rating
                ):
                    cache[s] = (None, None)
                    replay.feedback(True, None)
                    changes = replay.propose()
                    continue
                result = search.evaluate(proposal)
                if result is not None:
                    ranks, rating = result
                    self._num_plans += 1
                    if rating < best_perf_rating:
                        best_perf_rating = rating
                        best = (list(proposal), ranks)
                    cache[s] = (True, rating)
                    replay.feedback(True, rating)
                else:
                    last_failed = list(proposal)
                    current = _proposal_storage(search.opts, proposal)
                    if current < lowest_storage:
                        lowest_storage = current
                    cache[s] = (False, None)
                    replay.feedback(False, None)
                changes = replay.propose()
            replay.finish()
        return best, last_failed, lowest_storage

    def _finish(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
        opts: list[_Opt],
        best: _Best,
        start_time: float,
    ) -> ShardingPlan:
        proposal, ranks = best
        best_plan = [opts[i].c.materialise() for i in proposal]
        if self._callbacks:
            # callbacks may change the options: hand them copies, as the stock planner does
            best_plan = _ty.copy_sharding_options(best_plan)
        for so, r in zip(best_plan, ranks):
            for shard, rank in zip(so.shards, r):
                shard.rank = rank
        for callback in self._callbacks:
            best_plan = callback(best_plan)
        self._best_plan = best_plan
        sharding_plan = to_sharding_plan(best_plan, self._topology)

        end_time = perf_counter()
        for stats in self._stats:
            stats.log(
                sharding_plan=sharding_plan,
                topology=self._topology,
                batch_size=self._batch_size,
                storage_reservation=self._storage_reservation,
                num_proposals=self._num_proposals,
                num_plans=self._num_plans,
                run_time=end_time - start_time,
                best_plan=best_plan,
                constraints=self._constraints,
                enumerator=self._enumerator,
                sharders=sharders,
                debug=self._debug,
                debug_stats=PlanDebugStats(
                    planner_type=self.__class__.__name__,
                    timeout_seconds=self._timeout_seconds,
                ),
            )
        validate_modules_inclusion_in_sharding_plan(sharding_plan, module, sharders)
        validate_rank_assignment(sharding_plan, self._topology)
        validate_compute_kernels(best_plan)
        return sharding_plan

    def _raise_no_plan(
        self,
        sharders: list[ModuleSharder[nn.Module]],
        storage_constraint: Topology,
        opts: list[_Opt],
        last_failed: list[int] | None,
        lowest_storage: Storage,
        start_time: float,
    ) -> None:
        """Raise the stock planner's "no plan" error (planners.py, 1.8.0), word for word."""
        last_planner_error: PlannerError | None = None
        last_proposal: list[ShardingOption] = []
        if last_failed is not None:
            last_proposal = [opts[i].c.materialise() for i in last_failed]
            try:
                self._partitioner.partition(
                    proposal=last_proposal, storage_constraint=storage_constraint
                )
            except PlannerError as e:
                last_planner_error = e
            else:  # pragma: no cover - the fast and stock partitioners disagree
                raise AssertionError(
                    "the stock partitioner placed a proposal FastPlanner could not"
                )
            finally:
                reset_shard_rank(last_proposal)

        global_storage_capacity = reduce(
            lambda x, y: x + y, [device.storage for device in self._topology.devices]
        )
        global_storage_constraints = reduce(
            lambda x, y: x + y, [device.storage for device in storage_constraint.devices]
        )
        storage_reservation_solution = _reservation_text(self._storage_reservation)
        no_plan_solution = (
            f"Planner evaluated {self._num_proposals} proposals."
            "\nPossible solutions:"
            f"\n  1) Increase the number of devices ({self._topology.world_size})"
            f"\n  2) Reduce the model size ("
            f"\n\t  Global storage: {round(bytes_to_gb(global_storage_capacity.hbm), 3)} GB, "
            f"\n\t  Per rank hardware memory: {storage_repr_in_gb(self._topology.devices[0].storage)}, "
            f"{storage_reservation_solution}"
            f"\n\t  Global storage available for model parallel: {storage_repr_in_gb(global_storage_constraints)}, "
            f"\n\t  Global storage requirement for model parallel: {storage_repr_in_gb(lowest_storage)})"
            f"\n  3) Reduce local batch size ({self._batch_size})"
            "\n  4) Remove planner constraints that might be reducing search space or available storage\n"
        )
        last_planner_error_info = f"Last planner error: \n\t{last_planner_error}\n"

        end_time = perf_counter()
        sharding_plan = ShardingPlan(plan={})
        for sharding_option in last_proposal:
            for shard in sharding_option.shards:
                shard.rank = -1
        for stats in self._stats:
            stats.log(
                sharding_plan=sharding_plan,
                topology=self._topology,
                batch_size=self._batch_size,
                storage_reservation=self._storage_reservation,
                num_proposals=self._num_proposals,
                num_plans=self._num_plans,
                run_time=end_time - start_time,
                best_plan=last_proposal,
                constraints=self._constraints,
                sharders=sharders,
                enumerator=self._enumerator,
                debug=self._debug,
            )
        if not lowest_storage.fits_in(global_storage_constraints):
            raise PlannerError(
                error_type=PlannerErrorType.INSUFFICIENT_STORAGE,
                message="Unable to find a plan for this model because of insufficient storage. \n"
                + no_plan_solution
                + last_planner_error_info,
            )
        raise PlannerError(
            error_type=PlannerErrorType.STRICT_CONSTRAINTS,
            message="Unable to find a plan for this model because of the strict constraints. \n"
            + no_plan_solution
            + last_planner_error_info,
        )
