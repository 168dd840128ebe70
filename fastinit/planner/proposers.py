"""Mirrors ``torchrec/distributed/planner/proposers.py`` (written against torchrec 1.8.0).

``GridSearchProposer``, ``GreedyProposer`` and ``UniformProposer`` (``load``, ``propose``,
``feedback``) replayed on option indices as ``GridReplay``, ``GreedyReplay`` and
``UniformReplay``: the same proposals in the same order, handed over as the positions of the
proposal vector that change; ``_sharding_option_score`` as ``_score``. Used by ``FastPlanner``
(``planners.py``); registered in ``fastinit/ports.py``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from decimal import Decimal
from functools import reduce

from torchrec.distributed.planner.proposers import GreedyProposer

from fastinit.planner import _torchrec as _tr
from fastinit.planner.partitioners import Opt, Unsupported

logger: logging.Logger = logging.getLogger(__name__)


def _score(opt: Opt, use_depth: bool) -> float:
    """``proposers._sharding_option_score``: ``max`` or ``sum`` of the shards' ``perf.total``.

    Computed as the stock function does (``max([...])`` / ``sum([...])`` of the same list), once.
    """
    return opt.score_depth if use_depth else opt.score_sum


def _by_fqn(opts: Sequence[Opt], indices: Sequence[int]) -> dict[str, list[int]]:
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

Changes = list[tuple[int, int]]


class ProposerReplay:
    """The proposal sequence of one stock proposer, as changes of the proposal vector."""

    needs_rating: bool = False

    def propose(self) -> Changes | None:
        """The current proposal as changes from this proposer's previous one; None when done."""
        raise NotImplementedError

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Write back state the stock proposer carries between ``plan`` calls."""


class GridReplay(ProposerReplay):
    """``GridSearchProposer``: ``itertools.product`` of the per-table lists, as an odometer."""

    def __init__(self, opts: Sequence[Opt], lists: list[list[int]], max_proposals: int) -> None:
        self._lists = [sorted(lst, key=lambda i: _score(opts[i], True)) for lst in lists]
        total = reduce(lambda a, b: a * b, (len(lst) for lst in self._lists), 1)
        self._next: Changes | None = None
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

    def propose(self) -> Changes | None:
        return self._next

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        changes: Changes = []
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


class GreedyReplay(ProposerReplay):
    """``GreedyProposer``: each step moves the table with the largest storage to its next option."""

    def __init__(
        self, opts: Sequence[Opt], lists: list[list[int]], proposer: GreedyProposer
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
        self._next: Changes | None = [(f, lst[0]) for f, lst in enumerate(self._lists)]
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

    def propose(self) -> Changes | None:
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


class UniformReplay(ProposerReplay):
    """``UniformProposer``: per sharding type held by every table, each table's best option."""

    def __init__(self, opts: Sequence[Opt], fqn_pos: dict[str, int], use_depth: bool) -> None:
        by_type: dict[str, dict[str, list[int]]] = {}
        for i, o in enumerate(opts):
            by_type.setdefault(o.sharding_type, {}).setdefault(o.fqn, []).append(i)
        self._proposals: list[Changes] = []
        for by_fqn in by_type.values():
            for lst in by_fqn.values():
                lst.sort(key=lambda i: _score(opts[i], use_depth))
            if by_fqn.keys() == fqn_pos.keys():
                changes = [(fqn_pos[fqn], lst[0]) for fqn, lst in by_fqn.items()]
                if [f for f, _ in changes] != list(range(len(changes))):
                    raise Unsupported("a uniform proposal lists tables in another order")
                self._proposals.append(changes)
        self._index = 0

    def propose(self) -> Changes | None:
        if self._index < len(self._proposals):
            return self._proposals[self._index]
        return None

    def feedback(self, partitionable: bool, perf_rating: float | None) -> None:
        self._index += 1
