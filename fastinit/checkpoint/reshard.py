"""Which stored shards overlap a new shard: interval arithmetic on shard runs.

A stored layout is a tuple of :class:`~fastinit.plan.layout.ShardRun` (row-wise over N ranks
is one or two runs, table-wise one shard, column-wise, table-row-wise and grid a few runs). For a
new chunk ``[a, a + n)`` (per dim), the shards ``j`` of a run that overlap it form an interval in
``j`` on every dim whose offset advances with ``j`` (solved in O(1)), and a yes/no on the dims
that do not: the overlapping shards are found in O(runs + overlaps), never O(world size). This
covers every TorchRec sharding type (data-parallel tables are replicated values and read whole).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["StoredShard", "overlapping", "shards_of_rank", "overlap_volume"]


@dataclasses.dataclass(frozen=True, slots=True)
class StoredShard:
    """One stored shard: its index in the layout, its rank, offsets and sizes."""

    index: int
    rank: int | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _j_range(run: Any, offsets: Sequence[int], sizes: Sequence[int]) -> range:
    """The shard indices ``j`` of ``run`` whose box overlaps the box (offsets, sizes)."""
    lo, hi = 0, run.count
    for d, (a, n) in enumerate(zip(offsets, sizes, strict=True)):
        o, s, z = run.offsets[d], run.step[d], run.sizes[d]
        if n <= 0 or z <= 0:
            return range(0)
        b = a + n
        # shard j covers [o + j*s, o + j*s + z); overlap iff o + j*s < b and o + j*s + z > a
        if s == 0:
            if not (o < b and o + z > a):
                return range(0)
        elif s > 0:
            hi = min(hi, _ceil_div(b - o, s))  # j*s < b - o
            lo = max(lo, (a - z - o) // s + 1)  # j*s > a - z - o
        else:  # offsets decreasing with j: same inequalities, divided by a negative step
            t = -s
            hi = min(hi, (o + z - a - 1) // t + 1)  # j*t < o + z - a
            lo = max(lo, (o - b) // t + 1)  # j*t > o - b
        if lo >= hi:
            return range(0)
    return range(lo, hi)


def overlapping(
    runs: Sequence[Any], offsets: Sequence[int], sizes: Sequence[int]
) -> Iterator[StoredShard]:
    """The stored shards (of the layout ``runs``) that overlap the chunk (offsets, sizes)."""
    base = 0
    for run in runs:
        if len(run.offsets) != len(offsets):
            raise ValueError(f"a {len(run.offsets)}-d layout cannot hold a {len(offsets)}-d chunk")
        for j in _j_range(run, offsets, sizes):
            yield StoredShard(base + j, run.rank_at(j), tuple(run.offsets_at(j)), run.sizes)
        base += run.count


def shards_of_rank(runs: Sequence[Any], rank: int) -> Iterator[StoredShard]:
    """The stored shards of one rank (O(runs))."""
    base = 0
    for run in runs:
        if run.rank is not None:
            if run.rank_step == 0:
                js: Sequence[int] = range(run.count) if run.rank == rank else ()
            else:
                q, r = divmod(rank - run.rank, run.rank_step)
                js = (q,) if r == 0 and 0 <= q < run.count else ()
            for j in js:
                yield StoredShard(base + j, rank, tuple(run.offsets_at(j)), run.sizes)
        base += run.count


def overlap_volume(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> int:
    """Elements in the intersection of two boxes."""
    v = 1
    for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size, strict=True):
        n = min(ao + an, bo + bn) - max(ao, bo)
        if n <= 0:
            return 0
        v *= n
    return v
