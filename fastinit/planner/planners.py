"""Mirrors ``torchrec/distributed/planner/planners.py`` (written against torchrec 1.8.0).

``FastPlanner``: TorchRec's ``EmbeddingShardingPlanner`` plan, found much sooner.

The stock planner (torchrec 1.8.0) evaluates every proposal its proposers make by deep-copying the
devices and the proposal, placing every shard with Python objects, and rating the result. Most of
its time goes to those copies, to per-shard estimator work repeated for identical shards, and to
deep copies of the search space and of each new best plan.

``FastPlanner`` runs the same search and returns the same plan:

* the same enumeration, with estimators that compute each distinct shard once
  (``enumerators.FastEnumerator``), so the search space holds the same numbers. Shards are
  described, not built (``types.CompactOption``: a data-parallel option's ``W`` alike shards
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

The proposers are replayed in ``proposers.py``, the partitioner in ``partitioners.py``;
``EmbeddingShardingPlanner.__init__`` and ``.plan`` are ported here (``FastPlanner``), with the
proposal stream (``_Stream``). Registered in ``fastinit/ports.py``. The cost model (how each
stage grows with tables, ranks and proposals) is in docs/planner.md.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import logging
import time
from collections.abc import Callable, Sequence
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
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from fastinit import compat, ports
from fastinit.planner import _torchrec as _tr
from fastinit.planner import enumerators as _en
from fastinit.planner import types as _ty
from fastinit.planner.partitioners import (
    CUT,
    EXACT_BITS,
    PRUNE_SLACK,
    SCALAR,
    Opt,
    Search,
    Unsupported,
    exact,
)
from fastinit.planner.proposers import (
    Changes,
    GreedyReplay,
    GridReplay,
    ProposerReplay,
    UniformReplay,
)
from fastinit.planner.types import UNIFORM

__all__ = ["FastPlanner"]

logger: logging.Logger = logging.getLogger(__name__)


# ---- the proposal sequence, kept as changes -------------------------------------------------------


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
        opts: Sequence[Opt],
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
        self._v_umin = [exact(o.tot_min) if o.kind == UNIFORM else 0 for o in opts]
        self._nu = [0.0 if o.kind == UNIFORM else o.tot_max for o in opts]
        self._s_tot = 0
        self._s_umin = 0
        self._heap: list[tuple[float, int, int]] = []
        self._log_f: list[int] = []
        self._log_o: list[int] = []
        self._ckpt_at: list[int] = [0]
        self._ckpt_vec: list[list[int]] = [list(self.cur)]
        self._interval = max(64, n_tables // 16)
        self.ends: list[int] = []

    def apply(self, changes: Changes) -> int:
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
        """A lower bound of the current proposal's rating (``Search.lower_bound``)."""
        heap, cur = self._heap, self.cur
        while heap and cur[heap[0][1]] != heap[0][2]:
            heapq.heappop(heap)
        largest = -heap[0][0] if heap else 0.0
        scale = 1 << EXACT_BITS
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


_Best = tuple[list[int], list[list[int]]]


def _proposal_storage(opts: Sequence[Opt], proposal: Sequence[int]) -> Storage:
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

    #: the offline search partitions proposals together (``Search.evaluate_batch``) when at least
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
                except Unsupported as e:
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
                raise Unsupported(str(e)) from e
        if hasattr(self, "_search_space"):  # 1.9: get_search_space() gives it (built on demand)
            cast(Any, self)._search_space = None
            self._fastinit_space = space
        if not space:
            return ShardingPlan({})

        opts = [Opt(c) for c in space]
        seen: set[tuple[str, str, str]] = set()
        fqn_pos: dict[str, int] = {}
        lists: list[list[int]] = []
        for i, o in enumerate(opts):
            k = (o.fqn, o.so.sharding_type, o.so.compute_kernel)
            if k in seen:
                # the stock proposal cache keys on option hashes; keep its semantics exactly
                raise Unsupported("two options with the same fqn, sharding type and kernel")
            seen.add(k)
            f = fqn_pos.setdefault(o.fqn, len(fqn_pos))
            if f == len(lists):
                lists.append([])
            lists[f].append(i)
        sort_by, balance_modules = _tr.partitioner_settings(self._partitioner)
        search = Search(
            opts,
            storage_constraint,
            rating_world_size=_tr.perf_model_world_size(self._perf_model),
            sort_by_perf=sort_by == "perf",
            balance_modules=balance_modules,
        )

        replays: list[ProposerReplay] = []
        for p in self._proposers:
            if type(p) is GridSearchProposer:
                replays.append(GridReplay(opts, lists, _tr.grid_max_proposals(p)))
            elif type(p) is GreedyProposer:
                replays.append(GreedyReplay(opts, lists, p))
            else:
                replays.append(UniformReplay(opts, fqn_pos, _tr.uniform_proposer_use_depth(p)))

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
        self, replays: list[ProposerReplay], search: Search, stream: _Stream
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
            if result is CUT:
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
            return search.evaluate_cut(vec, best_rating * (1 + PRUNE_SLACK))

        batching = search.batch_ok and lbs is not None
        handled = [False] * len(order)
        p = 0
        while p < len(order):
            if handled[p]:
                p += 1
                continue
            j = order[p]
            if lbs is not None and best is not None and lbs[j] * (1 - PRUNE_SLACK) > best_rating:
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
                    and lbs[order[q]] * (1 - PRUNE_SLACK) <= best_rating
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
                if r is SCALAR:
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
        self, replays: list[ProposerReplay], search: Search, stream: _Stream
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
                    and stream.bound() * (1 - PRUNE_SLACK) >= best_perf_rating
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
        opts: list[Opt],
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
        self._log_stats(
            sharding_plan,
            best_plan,
            sharders,
            start_time,
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
        opts: list[Opt],
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
        self._log_stats(sharding_plan, last_proposal, sharders, start_time, end_time=end_time)
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

    def _log_stats(
        self,
        sharding_plan: ShardingPlan,
        best_plan: list[ShardingOption],
        sharders: list[ModuleSharder[nn.Module]],
        start_time: float,
        end_time: float | None = None,
        **extra: Any,
    ) -> None:
        """Every stats logger's ``log`` call, with the arguments the stock planner passes
        (``extra``: ``debug_stats`` on success); ``end_time`` now unless given."""
        run_time = (perf_counter() if end_time is None else end_time) - start_time
        for stats in self._stats:
            stats.log(
                sharding_plan=sharding_plan,
                topology=self._topology,
                batch_size=self._batch_size,
                storage_reservation=self._storage_reservation,
                num_proposals=self._num_proposals,
                num_plans=self._num_plans,
                run_time=run_time,
                best_plan=best_plan,
                constraints=self._constraints,
                enumerator=self._enumerator,
                sharders=sharders,
                debug=self._debug,
                **extra,
            )
