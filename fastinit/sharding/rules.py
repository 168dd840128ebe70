"""What torch and TorchRec compute from a shard list, computed from its runs instead.

A row-wise table on N ranks has N shards; the checks and derived metadata that torch's
``ShardedTensor._init_from_local_shards_and_global_metadata`` and TorchRec's fused optimizer
compute per shard are, for a layout given by :class:`~fastinit.plan.layout.ShardRun` s, a
function of the runs. Each function here gives the same answer as the per-shard code it names,
in O(runs), or None where the runs do not decide it cheaply (the caller then builds the shards
and runs the per-shard code).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from fastinit.plan.layout import Expansions, LazyShards, ShardRun

__all__ = [
    "local_count",
    "ranks_in",
    "infer_spec",
    "state_shards",
    "index_of",
]


def local_count(runs: Sequence[ShardRun], rank: int) -> int | None:
    """How many shards are placed on ``rank``; None if a placement names no rank."""
    n = 0
    for run in runs:
        if run.rank is None:
            return None
        if run.rank_step == 0:
            if run.rank == rank:
                n += run.count
        else:
            q, rem = divmod(rank - run.rank, run.rank_step)
            if rem == 0 and 0 <= q < run.count:
                n += 1
    return n


def ranks_in(runs: Sequence[ShardRun], ranks: frozenset[int], lo: int, hi: int) -> int | None:
    """The first shard rank not in ``ranks`` (whose smallest is ``lo``, largest ``hi``), or None.
    O(runs) when ``ranks`` is every rank from ``lo`` to ``hi``."""
    contiguous = len(ranks) == hi - lo + 1
    for run in runs:
        if run.rank is None:
            continue
        last = run.rank + (run.count - 1) * run.rank_step
        if contiguous and lo <= min(run.rank, last) and max(run.rank, last) <= hi:
            continue
        for j in range(run.count):
            r = run.rank + j * run.rank_step
            if r not in ranks:
                return r
    return None


def _dims(offsets: Sequence[int]) -> list[int]:
    return [d for d, o in enumerate(offsets) if o != 0]


def _chunk_dim(runs: Sequence[ShardRun]) -> tuple[bool, int | None]:
    """torch's ``_infer_sharding_spec_from_shards_metadata`` first loop: ``(decided, dim)``.
    Within a run of non-negative steps, shard 0's non-zero dims are those of its offsets and
    every later shard's those of its offsets or steps; the loop's state does not change when the
    same dims repeat, so one visit per distinct pattern gives torch's answer."""
    csd: int | None = None
    for run in runs:
        if any(s < 0 for s in run.step):
            return False, None
        patterns = [_dims(run.offsets)]
        if run.count > 1:
            patterns.append(
                [d for d, (o, s) in enumerate(zip(run.offsets, run.step, strict=True)) if o or s]
            )
        for dims in patterns:
            if not dims:
                continue
            if len(dims) != 1:
                return True, None
            if not csd:  # torch's test: dim 0 counts as unset
                csd = dims[0]
            elif csd != dims[0]:
                return True, None
    return True, csd


def _sums_ordered(runs: Sequence[ShardRun], dim: int | None) -> bool:
    """Whether the shards' sort keys (the sum of the offsets, or the offset along ``dim``) never
    decrease in shard order, so that a stable sort keeps the shard order."""
    last: int | None = None
    for run in runs:
        first = sum(run.offsets) if dim is None else run.offsets[dim]
        step = sum(run.step) if dim is None else run.step[dim]
        if run.count > 1 and step < 0:
            return False
        if last is not None and first < last:
            return False
        last = first + (run.count - 1) * step
    return True


def _is_chunk_layout(runs: Sequence[ShardRun], dim: int) -> bool | None:
    """torch's test that the shards along ``dim`` are ``torch.chunk``'s: the sorted sizes and
    the sorted offsets equal the chunk ones. None where the runs do not decide it cheaply."""
    n = sum(r.count for r in runs)
    total = sum(r.sizes[dim] * r.count for r in runs)
    split = (total + n - 1) // n
    sizes: collections.Counter[int] = collections.Counter()
    for run in runs:
        sizes[run.sizes[dim]] += run.count
    want: collections.Counter[int] = collections.Counter()
    if split == 0:
        want[0] = n
    else:
        full = min(total // split, n)
        want[split] += full
        if full < n:
            want[total - full * split] += 1
            want[0] += n - full - 1
    want = +want
    if +sizes != want:
        return False
    # offsets: exactly {split * i for i < n}
    spans = []
    for run in runs:
        o, s = run.offsets[dim], run.step[dim]
        if split == 0:
            if o != 0 or (run.count > 1 and s != 0):
                return False
            continue
        if o % split:
            return False
        if run.count > 1 and s != split:
            return None if s > 0 and s % split == 0 else False
        spans.append((o // split, run.count))
    if split == 0:
        return True
    spans.sort()
    at = 0
    for start, count in spans:
        if start != at:
            return False
        at += count
    return at == n


def placements(runs: Sequence[ShardRun], exp: Expansions) -> list[Any]:
    """The placement of every shard, in order (the objects ``exp`` shares)."""
    out = []
    for run in runs:
        for j in range(run.count):
            out.append(exp.placement(run.placement_at(j)))
    return out


def infer_spec(shards: LazyShards) -> Any:
    """``_infer_sharding_spec_from_shards_metadata(shards)`` from the runs: a
    ``ChunkShardingSpec`` (one per placement sequence and dim, shared) or an
    ``EnumerableShardingSpec`` holding ``shards``; None where the per-shard code must run.
    The layout must already be checked (no overlap, inside the tensor)."""
    runs = shards.runs
    decided, dim = _chunk_dim(runs)
    if not decided:
        return None
    if dim is not None:
        if not _sums_ordered(runs, None):
            return None
        chunk = _is_chunk_layout(runs, dim)
        if chunk is None:
            return None
        if chunk:
            exp = shards._exp
            key = (
                "chunk",
                dim,
                tuple((r.count, r.rank, r.rank_step, r.device, r.modulus) for r in runs),
            )
            spec = exp.specs.get(key)
            if spec is None:
                from torch.distributed._shard.sharding_spec import ChunkShardingSpec

                spec = exp.specs[key] = ChunkShardingSpec(dim=dim, placements=placements(runs, exp))
            return spec
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    spec = object.__new__(EnumerableShardingSpec)  # its __post_init__ checks: done on the runs
    spec.shards = shards  # type: ignore[assignment]
    return spec


def _run(count: int, size: int, offset: int, step: int, like: ShardRun) -> ShardRun:
    return ShardRun(
        count,
        (size,),
        (offset,),
        (step if count > 1 else 0,),
        like.rank,
        like.rank_step,
        like.device,
        like.modulus,
    )


def state_shards(
    shards: LazyShards, kind: str, sharding_dim: int, is_grid: bool, grid_nodes: int
) -> tuple[tuple[ShardRun, ...], int] | None:
    """TorchRec's fused-optimizer state layouts (``get_optimizer_{single_value,rowwise,
    pointwise}_shard_metadata_and_global_metadata``, torchrec 1.8.0) as runs, with the state's
    first dimension (``None`` where the shard order would change: the caller builds them)."""
    runs = shards.runs
    n = len(shards)
    if any(r.rank is None for r in runs):
        return None
    out: list[ShardRun] = []
    if kind == "single":
        base = 0
        for run in runs:
            out.append(_run(run.count, 1, base, 1, run))
            base += run.count
        return tuple(out), n
    if kind == "pointwise":
        return tuple(runs), -1
    if sharding_dim == 1 and not _sums_ordered(runs, 1):
        return None  # TorchRec sorts the shards by column offset first
    rolling = 0
    base = 0
    for run in runs:
        size = run.sizes[0]
        if is_grid:
            out.append(_run(run.count, size, rolling, size, run))
            rolling += run.count * size
        elif sharding_dim == 1:
            out.append(_run(run.count, size, base * size, size, run))
        else:
            out.append(_run(run.count, size, run.offsets[0], run.step[0], run))
        base += run.count
    return tuple(out), (n if sharding_dim == 1 and not is_grid else 1) * grid_nodes


def index_of(shards: LazyShards, md: Any) -> int | None:
    """The index of ``md`` in ``shards``: by identity among the shards handed out one by one,
    else by value (the last equal shard, as a dict keyed by ``ShardMetadata`` keeps)."""
    exp = shards._exp
    for i, item in exp.items.get(shards.runs, {}).items():
        if item is md:
            return i
    found = None
    base = 0
    offsets = list(md.shard_offsets)
    sizes = list(md.shard_sizes)
    text = str(md.placement)
    rank = md.placement.rank() if md.placement is not None else None
    for run in shards.runs:
        if list(run.sizes) == sizes and run.rank is not None and rank is not None:
            if run.rank_step:
                q, rem = divmod(rank - run.rank, run.rank_step)
                js: Sequence[int] = [q] if rem == 0 and 0 <= q < run.count else []
            else:
                moving = [(d, s) for d, s in enumerate(run.step) if s]
                if moving:
                    d, s = moving[0]
                    q, rem = divmod(offsets[d] - run.offsets[d], s)
                    js = [q] if rem == 0 and 0 <= q < run.count else []
                else:
                    js = range(run.count) if run.rank == rank else []
            for j in js:
                if run.offsets_at(j) == offsets and run.placement_at(j) == text:
                    found = base + j
        base += run.count
    return found
