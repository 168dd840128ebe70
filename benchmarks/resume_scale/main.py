"""Resume at scale: one rank of N = 64 … 8,192 loading a checkpoint, fastinit against stock DCP.

    python -m benchmarks.resume_scale [--ranks 64,...,8192] [--stock-max 4096] [--rank R]
                                      [--model medium | --model-factory module:function]
                                      [--plan-factory module:function] [--quick]

Each point is one rank ``R`` of ``N`` on torch's fake process-group backend (``--rank``; by
default, from the plan at ``N``: of the ranks holding the most sharded tables' shards, the
highest-numbered — in the medium plan rank 252, holding a shard of every row-wise table and a
table-wise table, whose resharded load reads other ranks' files than rank 0's; rank 0 holds as
many but reads its N / 2 overlaps from rank 0 itself), each step in a fresh
process (``fastinit.testing.dist.call_fresh``), the model set up by ``fastinit.setup`` from the
plan (as ``make scale`` does), its state the model's ``state_dict`` and its fused optimizer's
(EXACT_ROWWISE_ADAGRAD: one momentum row per table row).

* **fastinit, same plan** — ``fastinit.checkpoint.save`` runs for real as rank ``R`` (its own
  shards) and as rank 0 (the index, the replicated values, the commit marker), on real files;
  no other rank's files exist (a same-plan load reads none). Then, in a fresh process, rank
  ``R`` runs ``fastinit.checkpoint.load`` and is timed.
* **fastinit, resharded** — a checkpoint saved by ``N / 2`` ranks: the ranks whose files rank
  ``R`` of ``N`` needs (the stored shards overlapping its new ones and, for optimizer-state
  layouts, each table's shard-0 rank, found from the two plans) run the real ``save`` as ranks
  of ``N / 2``, rank 0 last; then rank ``R`` of ``N`` loads it, reading the overlapping stored
  chunks from those ranks' ``.distcp`` files.
* **stock DCP** — the global ``.metadata`` that DCP's coordinator writes for the same state at
  ``N`` ranks, built with DCP's own classes: every rank's ``SavePlan`` from its shards
  (``_create_write_item_for_shard`` over the global shard metadata of each ShardedTensor, the
  replicated values in rank 0's), ``DefaultSavePlanner.create_global_plan`` (dedup and
  ``Metadata``), and ``FileSystemWriter.finish`` with one ``__<rank>_0.distcp`` per rank (lengths
  the tensors' bytes). Then rank ``R`` is timed doing what every rank of ``dcp.load`` does
  before it reads data: ``FileSystemReader.read_metadata`` (the unpickle) and
  ``DefaultLoadPlanner``'s ``set_up_planner`` + ``create_local_plan``. Not counted: the gather of
  every rank's load plan on rank 0 and the scatter back (a stock rank waits for it), nor the
  data read — the stock figure is a lower bound.

Measured per load: seconds, bytes read (``LoadReport``: tensor data, and index + metadata +
layout files; "other" is the process's ``rchar`` from ``/proc/self/io`` around the call less
those two), the rank's own data (its local shards + the replicated values), and the peak RSS during the call (sampled every
2 ms from ``/proc/self/statm``) above the RSS before it. Results: ``resume-scale.json``,
``resume-scale.md`` and ``resume-scale.png`` in ``benchmarks/results/resume-scale/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from benchmarks.scale.main import fit_exponent, plan_types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = [
    "ResumeScaleConfig",
    "write_plan",
    "prepare",
    "default_rank",
    "measured_rank",
    "needed_ranks",
    "save_ranks",
    "save_all",
    "measure_all",
    "write_stock_metadata",
    "run",
    "analyse",
    "format_table",
    "main",
]

RANKS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: The plan of ``make scale``: cycled over the tables.
# The table layouts the benchmark plans with: make scale's "mixed4" (benchmarks.scale.main.PLANS).
PLAN = "mixed4"


@dataclasses.dataclass(kw_only=True, slots=True)
class ResumeScaleConfig:
    """One ``make resume-scale`` run."""

    model: str = "medium"
    """A model of ``benchmarks.ttfb.trainer.MODELS`` (medium: 192 EBC + 64 EC tables)."""
    model_factory: str | None = None
    """``module:function`` returning the user's unsharded model (meta device); replaces ``model``."""
    plan_factory: str | None = None
    """``module:function(module, world_size, local_world_size) -> ShardingPlan``: the user's
    explicit plan (default: ``make scale``'s mixed plan through TorchRec's helpers)."""
    ranks: tuple[int, ...] = RANKS
    """World sizes N (the resharded load is from N / 2)."""
    stock_max: int = 4096
    """Largest N the stock ``.metadata`` is built at (its size and build time grow as N)."""
    local_world_size: int = 8
    """Ranks per host."""
    rank: int | None = None
    """The measured rank (negative: from the end, -1 is N - 1); None: :func:`default_rank`."""
    timeout_s: float = 1800.0
    """Per step (one fresh process)."""
    out: str = "benchmarks/results/resume-scale"
    """Where resume-scale.json/.md/.png go."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _config(obj: dict[str, Any]) -> ResumeScaleConfig:
    obj = dict(obj)
    obj["ranks"] = tuple(obj["ranks"])
    return ResumeScaleConfig(**obj)


# -- the model, the plan, one rank -------------------------------------------------------------


def _factory(ref: str) -> Any:
    import importlib

    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"a factory is module:function, got {ref!r}")
    return getattr(importlib.import_module(module), name)


def _module(config: ResumeScaleConfig) -> Any:
    if config.model_factory:
        return _factory(config.model_factory)()
    from benchmarks.ttfb.trainer import model_spec
    from fastinit.testing.models import build_model

    return build_model(model_spec(config.model), device="meta")


def write_plan(config_json: dict[str, Any], n: int, path: str) -> dict[str, Any]:
    """The plan for ``n`` ranks, encoded with fastinit's codec into ``path`` (every step decodes
    it, as a receiving rank would)."""
    from fastinit.plan.codec import encode_plan

    config = _config(config_json)
    module = _module(config)
    local = min(config.local_world_size, n)
    t0 = time.perf_counter()
    if config.plan_factory:
        plan = _factory(config.plan_factory)(module, n, local)
    else:
        from fastinit.testing.models import build_plan

        plan = build_plan(module, plan_types(module, PLAN), world_size=n, local_world_size=local)
    plan_s = time.perf_counter() - t0
    data = encode_plan(plan)
    with open(path, "wb") as f:
        f.write(data)
    return {"plan_bytes": len(data), "plan_s": plan_s}


def write_plans(config_json: dict[str, Any], worlds: Sequence[int], paths: Sequence[str]) -> Any:
    """:func:`write_plan` for each world size, in one process."""
    return [write_plan(config_json, n, p) for n, p in zip(worlds, paths, strict=True)]


def prepare(config_json: dict[str, Any], worlds: Sequence[int], paths: Sequence[str]) -> Any:
    """:func:`write_plans`, then :func:`measured_rank` at the first world size, in one process."""
    return {
        "plans": write_plans(config_json, worlds, paths),
        "measured": measured_rank(config_json, worlds[0], paths[0]),
    }


def _read_plan(path: str) -> Any:
    from fastinit.plan.codec import decode_plan

    with open(path, "rb") as f:
        return decode_plan(f.read())


_BACKEND = "fakestate"


def _join(n: int, rank: int, local: int) -> None:
    """Join a fake world of ``n`` as ``rank`` (leaving the current one, if any)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(
        {
            "LOCAL_WORLD_SIZE": str(local),
            "LOCAL_RANK": str(rank % local),
            "RANK": str(rank),
            "WORLD_SIZE": str(n),
        }
    )
    # TorchRec skips the sharded modules' state on a backend named "fake" (as benchmarks/scale/main.py).
    if _BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            _BACKEND, fake_pg._create_fake_pg, extended_api=True, devices=["cpu"]
        )
    dist.init_process_group(_BACKEND, store=FakeStore(), rank=rank, world_size=n)


@contextmanager
def _cpu_device_for_empty_shards() -> Iterator[None]:
    """On the fake backend, what a gloo rank sees: the device of a ShardedTensor with no local
    shard is the CPU. torch answers CPU only for a group whose backend is named "gloo" and asks
    CUDA otherwise (``sharded_tensor/_ops/tensor_ops.py``), which fails on this CPU-only build
    before DCP's load planner starts. Benchmark processes only; restored on exit."""
    import torch
    from torch.distributed._shard.sharded_tensor import _ops  # noqa: F401 (registers the ops)
    from torch.distributed._shard.sharded_tensor.api import _SHARDED_OPS

    key = torch.Tensor.device.__get__
    original = _SHARDED_OPS[key]

    def device(types: Any, args: Any = (), kwargs: Any = None, pg: Any = None) -> Any:
        st = args[0]
        if st._local_shards:
            return st._local_shards[0].tensor.device
        return torch.device("cpu")

    _SHARDED_OPS[key] = device
    try:
        yield
    finally:
        _SHARDED_OPS[key] = original


def _quiet() -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")


def _setup(config: ResumeScaleConfig, n: int, rank: int, plan_path: str) -> Any:
    """Rank ``rank`` of ``n``: the sharded model, as ``fastinit.setup`` builds it from the plan."""
    import torch

    import fastinit
    from benchmarks.ttfb.trainer import _sharders

    _join(n, rank, min(config.local_world_size, n))
    return fastinit.setup(
        _module(config),
        device=torch.device("cpu"),
        plan=_read_plan(plan_path),
        sharders=_sharders(),
        seed=0,
    )


def _optimizers(model: Any) -> dict[str, Any]:
    return {"optim": model.fused_optimizer}


def _state(model: Any) -> dict[str, Any]:
    """The nested state a checkpoint holds: the model's and the fused optimizer's."""
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _own_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's local data in ``state``: its shards and the replicated tensors."""
    return sum(_own_split(state))


def _own_split(state: dict[str, Any]) -> tuple[int, int]:
    """(bytes of this rank's local shards, bytes of the replicated tensors) in ``state``."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    sharded = replicated = 0
    for value in flat.values():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                sharded += shard.tensor.numel() * shard.tensor.element_size()
        elif isinstance(value, torch.Tensor):
            replicated += value.numel() * value.element_size()
    return sharded, replicated


# -- what one call reads and holds -------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


@contextmanager
def _watch() -> Iterator[dict[str, float]]:
    """Seconds, bytes read (``rchar``) and peak RSS above the start, of the block."""
    out: dict[str, float] = {}
    stop = threading.Event()
    peak = [_rss_mb()]
    before = peak[0]

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _rss_mb())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    rchar = _rchar()
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out["seconds"] = time.perf_counter() - t0
        out["rchar"] = _rchar() - rchar if rchar >= 0 else -1
        stop.set()
        thread.join()
        out["rss_before_mb"] = before
        out["peak_rss_mb"] = max(peak[0], _rss_mb())
        out["rss_growth_mb"] = out["peak_rss_mb"] - before


# -- fastinit: real saves, then the measured load ----------------------------------------------


def _shard_boxes(plan: Any, rank: int | None) -> dict[str, list[tuple[list[int], list[int], int]]]:
    """Table FQN -> (offsets, sizes, rank) of its shards, those on ``rank`` (None: all)."""
    from fastinit.plan.compact import expanded_plan

    out: dict[str, list[tuple[list[int], list[int], int]]] = {}
    for path, module_plan in expanded_plan(plan).plan.items():
        for table, ps in module_plan.items():
            spec = ps.sharding_spec
            if spec is None:  # data-parallel: replicated, in rank 0's files
                continue
            for md in spec.shards:
                r = md.placement.rank()
                if rank is None or r == rank:
                    out.setdefault(f"{path}.{table}", []).append(
                        (list(md.shard_offsets), list(md.shard_sizes), r)
                    )
    return out


def _overlap(a: tuple[list[int], list[int], int], b: tuple[list[int], list[int], int]) -> bool:
    return all(
        max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1])
    )


def _kinds(plan: Any) -> dict[str, str]:
    """Table FQN -> sharding type."""
    return {
        f"{path}.{table}": ps.sharding_type
        for path, module_plan in plan.plan.items()
        for table, ps in module_plan.items()
    }


def default_rank(plan_path: str, n: int) -> int:
    """The rank measured by default: of the ranks holding the most shards of sharded tables,
    the highest-numbered (rank 0 holds as many in the medium plan, but it also writes the index
    and reads its N / 2 overlaps from itself)."""
    counts = [0] * n
    for boxes in _shard_boxes(_read_plan(plan_path), None).values():
        for _, _, r in boxes:
            counts[r] += 1
    most = max(counts)
    return max(r for r, c in enumerate(counts) if c == most)


def measured_rank(config_json: dict[str, Any], n: int, plan_path: str) -> dict[str, Any]:
    """The rank a point measures (``config.rank`` or :func:`default_rank`) and what it holds:
    sharding type -> number of its shards."""
    config = _config(config_json)
    if config.rank is None:
        rank = default_rank(plan_path, n)
    else:
        rank = config.rank % n if config.rank < 0 else config.rank
        if not 0 <= rank < n:
            raise ValueError(f"--rank {config.rank} is not a rank of {n}")
    plan = _read_plan(plan_path)
    kinds = _kinds(plan)
    held: dict[str, int] = {}
    for table, boxes in _shard_boxes(plan, rank).items():
        held[kinds[table]] = held.get(kinds[table], 0) + len(boxes)
    return {"rank": rank, "holds": dict(sorted(held.items()))}


def needed_ranks(
    new_plan_path: str, n: int, old_plan_path: str, rank: int | None = None
) -> list[int]:
    """The ranks of the old (N / 2) checkpoint whose files rank ``rank`` (default ``n - 1``) of
    the new plan reads: those holding a stored shard that overlaps one of its new shards, and
    each of those tables' shard-0 rank (it records the optimizer-state layouts); rank 0 (the
    index, the replicated values) always. Computed from the two plans, outside any timing."""
    mine = _shard_boxes(_read_plan(new_plan_path), n - 1 if rank is None else rank)
    old = _shard_boxes(_read_plan(old_plan_path), None)
    ranks = {0}
    for table, boxes in mine.items():
        stored = old.get(table, [])
        if stored:
            ranks.add(stored[0][2])
        for box in boxes:
            ranks.update(s[2] for s in stored if _overlap(box, s))
    return sorted(ranks)


def save_ranks(
    config_json: dict[str, Any], n: int, ranks: Sequence[int], plan_path: str, ckpt_dir: str
) -> dict[str, Any]:
    """Write the parts of ``ranks`` of an ``n``-rank ``fastinit.checkpoint`` save for real, each
    as that rank, in this one process (``write_rank_files``: the same files ``save`` writes,
    without its collectives, which the fake backend cannot carry), then commit it with the
    ranks written (the marker records no manifest for the others: a load reads only these);
    the seconds and bytes of each."""
    import gc

    import torch

    from fastinit.checkpoint import commit as commits
    from fastinit.checkpoint.saving import write_rank_files

    _quiet()
    config = _config(config_json)
    save_id = os.urandom(16).hex()
    out: dict[str, Any] = {}
    written: dict[int, Any] = {}
    for rank in ranks:
        model = _setup(config, n, rank, plan_path)
        own = _own_bytes(_state(model))
        t0 = time.perf_counter()
        with _cpu_device_for_empty_shards():
            result = write_rank_files(
                ckpt_dir, model, _optimizers(model), save_id=save_id, rank=rank, world_size=n
            )
        if not result.ok:
            raise RuntimeError(f"rank {rank}'s part: {result.error}")
        written[rank] = result
        out[str(rank)] = {"save_s": time.perf_counter() - t0, "own_bytes": own}
        del model
        gc.collect()
    first = written[0]
    commits.commit(
        ckpt_dir,
        save_id,
        index_digest=first.index,
        manifests=[written[r].manifest if r in written else None for r in range(n)],
        replicated=first.replicated,
        torch_version=str(torch.__version__),
        job="benchmarks.resume_scale",
    )
    return out


def save_all(
    config_json: dict[str, Any],
    n: int,
    plans: dict[str, str],
    dirs: dict[str, str],
    rank: int | None = None,
) -> dict[str, Any]:
    """The two checkpoints of one point, saved for real in this one process: ranks ``rank``
    (default ``n - 1``) and 0 of ``n`` (same plan), and the ranks of ``n / 2`` that rank
    ``rank`` of ``n`` reads (resharded)."""
    rank = n - 1 if rank is None else rank
    out = {"same": save_ranks(config_json, n, sorted({rank, 0}), plans["new"], dirs["same"])}
    if "old" in plans:
        ranks = needed_ranks(plans["new"], n, plans["old"], rank)
        out["resharded"] = save_ranks(config_json, n // 2, ranks, plans["old"], dirs["resharded"])
        out["resharded_ranks"] = ranks
    return out


def _load(model: Any, ckpt_dir: str, own: tuple[int, int]) -> dict[str, Any]:
    from fastinit import checkpoint

    with _cpu_device_for_empty_shards(), _watch() as watched:
        report = checkpoint.load(ckpt_dir, model, _optimizers(model))
    return {
        **watched,
        "mode": report.mode,
        "bytes_read": report.bytes_read,
        "files_read": report.files_read,
        "metadata_bytes": report.metadata_bytes,
        "metadata_files": report.metadata_files,
        "source_ranks": list(report.source_ranks),
        "own_bytes": sum(own),
        "own_sharded_bytes": own[0],
        "own_replicated_bytes": own[1],
        "other_bytes": watched["rchar"] - report.bytes_read - report.metadata_bytes
        if watched["rchar"] >= 0
        else None,
    }


def measure_all(
    config_json: dict[str, Any],
    n: int,
    plan_path: str,
    dirs: dict[str, str],
    rank: int | None = None,
) -> dict[str, Any]:
    """Rank ``rank`` (default ``n - 1``) of ``n``, one process: ``fastinit.checkpoint.load`` of
    the same-plan and of the resharded checkpoint, then stock DCP's metadata read and planning
    (last: it holds the most memory), each watched on its own."""
    import gc

    _quiet()
    config = _config(config_json)
    model = _setup(config, n, n - 1 if rank is None else rank, plan_path)
    own = _own_split(_state(model))
    out: dict[str, Any] = {}
    for key in ("same", "resharded"):
        if key in dirs:
            try:
                out[key] = _load(model, dirs[key], own)
            except Exception as e:  # noqa: BLE001 - reported in the results
                out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            gc.collect()
    if "stock" in dirs:
        out["stock"] = _stock(model, dirs["stock"])
    return out


# -- stock DCP: the coordinator's global .metadata, then one rank's read and planning ----------


def write_stock_metadata(
    config_json: dict[str, Any], n: int, plan_path: str, out_dir: str, rank: int | None = None
) -> dict[str, Any]:
    """The global ``.metadata`` DCP's coordinator writes for this state at ``n`` ranks (built
    from DCP's own planner classes, see the module docstring); its size and entry counts."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import (
        _create_write_item_for_shard,
        _create_write_items,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    _quiet()
    config = _config(config_json)
    model = _setup(config, n, n - 1 if rank is None else rank, plan_path)
    t0 = time.perf_counter()
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(model), storage_meta=None, is_coordinator=True)
    items: list[list[Any]] = [[] for _ in range(n)]
    for fqn, value in planner.state_dict.items():
        if isinstance(value, ShardedTensor):
            for md in value.metadata().shards_metadata:
                items[md.placement.rank()].append(_create_write_item_for_shard(fqn, value, md))
        else:  # replicated: DCP's dedup keeps one copy; rank 0's
            items[0].extend(_create_write_items(fqn, value))
    # every rank flattens the same state: the same FQN mappings travel in each plan, as in DCP
    plans = [SavePlan(ws, planner_data=planner.mappings) for ws in items]
    del items
    _, metadata = planner.create_global_plan(plans)
    results: list[list[Any]] = []
    for rank, plan in enumerate(plans):
        offset = 0
        rank_results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                length = 1024
            else:
                size = item.tensor_data.chunk.sizes
                length = (
                    int(torch.Size(size).numel())
                    * torch.tensor([], dtype=item.tensor_data.properties.dtype).element_size()
                )
            info = _StorageInfo(relative_path=f"__{rank}_0.distcp", offset=offset, length=length)
            rank_results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
            )
            offset += length
        results.append(rank_results)
    os.makedirs(out_dir, exist_ok=True)
    writer = FileSystemWriter(out_dir)
    writer.set_up_storage_writer(True)
    writer.finish(metadata, results)
    build_s = time.perf_counter() - t0
    path = os.path.join(out_dir, ".metadata")
    return {
        "metadata_bytes": os.path.getsize(path),
        "chunks": sum(
            len(getattr(md, "chunks", [])) for md in metadata.state_dict_metadata.values()
        ),
        "storage_entries": len(metadata.storage_data),
        "build_s": build_s,
    }


def _stock(model: Any, ckpt_dir: str) -> dict[str, Any]:
    """DCP's metadata read and load planning on the global file, as every rank of ``dcp.load``
    does before reading data."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    state = _state(model)
    with _cpu_device_for_empty_shards(), _watch() as watched:
        reader = FileSystemReader(ckpt_dir)
        t0 = time.perf_counter()
        metadata = reader.read_metadata()
        read_s = time.perf_counter() - t0
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata, is_coordinator=False)
        reader.set_up_storage_reader(metadata, False)
        plan = reader.prepare_local_plan(planner.create_local_plan())
    return {
        **watched,
        "read_metadata_s": read_s,
        "plan_s": watched["seconds"] - read_s,
        "read_items": len(plan.items),
        "metadata_bytes": os.path.getsize(os.path.join(ckpt_dir, ".metadata")),
    }


# -- the driver ----------------------------------------------------------------------------------


def _fresh(fn: str, args: Sequence[Any], timeout: float) -> dict[str, Any]:
    from fastinit.testing.dist import FreshProcessError, call_fresh

    try:
        return call_fresh("benchmarks.resume_scale.main", fn, args, timeout, cwd=ROOT)
    except FreshProcessError as e:
        return {"error": str(e).splitlines()[-1:]}


def _say(*parts: Any) -> None:
    print(*parts, flush=True)


def _point(config: ResumeScaleConfig, n: int, tmp: str) -> dict[str, Any]:
    """One world size: 4 fresh processes (plans, real saves, the stock .metadata, the loads)."""
    cj = config.to_json()
    t = config.timeout_s
    row: dict[str, Any] = {"world_size": n}
    worlds = [n] + ([n // 2] if n >= 2 else [])
    paths = [os.path.join(tmp, f"plan-{w}.bin") for w in worlds]
    got = _fresh("prepare", (cj, worlds, paths), t)
    if "error" in got:
        row["error"] = f"plans: {got['error']}"
        return row
    row.update(got["plans"][0])
    rank = got["measured"]["rank"]
    row["rank"] = rank
    row["rank_holds"] = got["measured"]["holds"]
    plans = {"new": paths[0]} | ({"old": paths[1]} if len(paths) > 1 else {})
    dirs = {"same": os.path.join(tmp, f"same-{n}")}
    if "old" in plans:
        dirs["resharded"] = os.path.join(tmp, f"resharded-{n}")
    saved = _fresh("save_all", (cj, n, plans, dirs, rank), t)
    if "error" in saved:
        row["save_error"] = saved["error"]
        dirs = {}
    else:
        row["save"] = saved["same"][str(rank)]
        row["resharded_saved_ranks"] = saved.get("resharded_ranks")
    if n <= config.stock_max:
        stock = os.path.join(tmp, f"stock-{n}")
        built = _fresh("write_stock_metadata", (cj, n, plans["new"], stock, rank), t)
        if "error" in built:
            row["stock"] = built
        else:
            row["stock_built"] = built
            dirs["stock"] = stock
    if dirs:
        measured = _fresh("measure_all", (cj, n, plans["new"], dirs, rank), t)
        if "error" in measured:
            row["measure_error"] = measured["error"]
        else:
            row["same_plan"] = measured.get("same")
            row["resharded"] = measured.get("resharded")
            if "stock" in measured:
                row["stock"] = {**measured["stock"], "built": row.pop("stock_built")}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    return row


def _describe(row: dict[str, Any]) -> str:
    def s(key: str) -> str:
        r = row.get(key) or {}
        return "—" if "seconds" not in r else f"{r['seconds']:.3f} s"

    return (
        f"{row['world_size']:>6}  rank {row.get('rank', '?')}  same-plan {s('same_plan')}  resharded {s('resharded')}  "
        f"stock {s('stock')}"
    )


def run(config: ResumeScaleConfig) -> dict[str, Any]:
    """Measure every N (each step in a fresh process); write and return the results."""
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fastinit-resume-scale-") as tmp:
        for n in config.ranks:
            row = _point(config, n, tmp)
            rows.append(row)
            _say(_describe(row))
            result = _write(rows, config)  # after every point: a stopped run keeps what it did
    return result


def _write(rows: Sequence[dict[str, Any]], config: ResumeScaleConfig) -> dict[str, Any]:
    result = analyse(rows, config)
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "resume-scale.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(config.out, "resume-scale.md"), "w") as f:
        f.write(format_table(result))
    plot(result, os.path.join(config.out, "resume-scale.png"))
    return result


# -- analysis and report (pure) ------------------------------------------------------------------


def _series(rows: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (r["world_size"], r[key]["seconds"])
        for r in rows
        if isinstance(r.get(key), dict) and "seconds" in r[key]
    ]


def _at(points: Sequence[tuple[int, float]], n: int) -> float | None:
    return next((s for w, s in points if w == n), None)


def analyse(rows: Sequence[dict[str, Any]], config: ResumeScaleConfig) -> dict[str, Any]:
    """Exponents, the targets and the bytes-read check from the measured rows."""
    same = _series(rows, "same_plan")
    resharded = _series(rows, "resharded")
    stock = _series(rows, "stock")
    # Bytes read beyond the rank's own data: must not grow with N.
    extra = {
        key: [
            (
                r["world_size"],
                r[key]["bytes_read"] + r[key]["metadata_bytes"] - r[key]["own_bytes"],
            )
            for r in rows
            if isinstance(r.get(key), dict) and "bytes_read" in r[key]
        ]
        for key in ("same_plan", "resharded")
    }
    targets = {
        "same_plan_s_at_4096": _at(same, 4096),
        "resharded_s_at_4096": _at(resharded, 4096),
        "same_plan_exponent_512_8192": fit_exponent(same, 512, 8192),
        "resharded_exponent_512_8192": fit_exponent(resharded, 512, 8192),
        "stock_exponent_512_8192": fit_exponent(stock, 512, 8192),
    }
    targets["met"] = {
        "fastinit_le_1s_at_4096": all(
            v is not None and v <= 1.0
            for v in (targets["same_plan_s_at_4096"], targets["resharded_s_at_4096"])
        ),
        "exponent_le_0.3": all(
            v is not None and v <= 0.3
            for v in (
                targets["same_plan_exponent_512_8192"],
                targets["resharded_exponent_512_8192"],
            )
        ),
    }
    return {
        "config": config.to_json(),
        "rows": list(rows),
        "targets": targets,
        "extra_bytes": extra,
        "notes": (
            "one rank R of N (the rank column; what it holds beside it) on the fake "
            "process-group backend, each step a fresh process; "
            "fastinit: real save and load on real files (the ranks a load reads from saved for "
            "real, no other rank's files exist); stock: DCP's global .metadata for the same "
            "state from DCP's own save-planner classes, timed read_metadata + "
            "DefaultLoadPlanner local planning only (no plan gather on rank 0, no data read: a "
            f"lower bound). {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f} at the end."
        ),
    }


def _cell(r: Any, key: str, fmt: str, scale: float = 1.0) -> str:
    if not isinstance(r, dict) or key not in r or r[key] is None:
        return "—"
    value = r[key] / scale if scale != 1.0 else r[key]
    return format(value, fmt)


def format_table(result: dict[str, Any]) -> str:
    """The results as Markdown."""
    cfg = result["config"]
    model = cfg.get("model_factory") or cfg.get("model")
    plan = cfg.get("plan_factory") or "mixed (table-wise, row-wise, column-wise, data-parallel)"
    lines = [
        f"## Resume at scale ({model} model, {plan} plan)\n",
        result["notes"] + "\n",
        "| ranks | rank | holds (shards by type) | same-plan s | files | peak RSS growth MB "
        "| resharded s | source ranks | files | peak RSS growth MB "
        "| stock s (read + plan) | .metadata MB | chunks | peak RSS growth MB |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        s, r, k = row.get("same_plan"), row.get("resharded"), row.get("stock")
        built = (k or {}).get("built", {}) if isinstance(k, dict) else {}
        holds = ", ".join(f"{t} {c}" for t, c in (row.get("rank_holds") or {}).items()) or "—"
        sources = r.get("source_ranks") if isinstance(r, dict) else None
        lines.append(
            f"| {row['world_size']} | {row.get('rank', '—')} | {holds} "
            f"| {_cell(s, 'seconds', '.3f')} "
            f"| {_cell(s, 'files_read', 'd')} | {_cell(s, 'rss_growth_mb', '.0f')} "
            f"| {_cell(r, 'seconds', '.3f')} "
            f"| {'—' if sources is None else ', '.join(map(str, sources))} "
            f"| {_cell(r, 'files_read', 'd')} | {_cell(r, 'rss_growth_mb', '.0f')} "
            f"| {_cell(k, 'seconds', '.2f')} | {_cell(k, 'metadata_bytes', '.1f', 2**20)} "
            f"| {_cell(built, 'chunks', 'd')} | {_cell(k, 'rss_growth_mb', '.0f')} |"
        )
    lines += [
        "",
        "Bytes (own data: the rank's local shards + the replicated values it loads; read: "
        "tensor data from .distcp files; index/metadata: fastinit-index.json, .metadata and "
        "layouts.json files; other: the process's rchar less both; stock: the .metadata read):",
        "",
        "| ranks | own shards | own replicated | same-plan data read | index/metadata | other "
        "| resharded data read | index/metadata | other | stock rchar |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        s, r, k = row.get("same_plan"), row.get("resharded"), row.get("stock")
        own = s if isinstance(s, dict) and "own_bytes" in s else r
        lines.append(
            f"| {row['world_size']} | {_cell(own, 'own_sharded_bytes', ',')} "
            f"| {_cell(own, 'own_replicated_bytes', ',')} "
            f"| {_cell(s, 'bytes_read', ',')} | {_cell(s, 'metadata_bytes', ',')} "
            f"| {_cell(s, 'other_bytes', ',')} "
            f"| {_cell(r, 'bytes_read', ',')} | {_cell(r, 'metadata_bytes', ',')} "
            f"| {_cell(r, 'other_bytes', ',')} | {_cell(k, 'rchar', ',')} |"
        )
    t = result["targets"]

    def num(v: Any, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    lines += [
        "",
        f"fastinit at 4,096 ranks: same plan {num(t['same_plan_s_at_4096'], '.3f')} s, resharded "
        f"{num(t['resharded_s_at_4096'], '.3f')} s (target ≤ 1 s: "
        f"{'met' if t['met']['fastinit_le_1s_at_4096'] else 'not met'}).",
        f"Growth exponent 512 → 8,192 (s ∝ ranks^k): same plan "
        f"{num(t['same_plan_exponent_512_8192'], '.3f')}, resharded "
        f"{num(t['resharded_exponent_512_8192'], '.3f')} (target ≤ 0.3: "
        f"{'met' if t['met']['exponent_le_0.3'] else 'not met'}); stock "
        f"{num(t['stock_exponent_512_8192'], '.3f')}.",
        "Bytes read beyond the rank's own data (data + metadata − own), by ranks: "
        + "; ".join(
            f"{key}: " + ", ".join(f"{w}: {b:,}" for w, b in pts)
            for key, pts in result["extra_bytes"].items()
        ),
    ]
    for row in result["rows"]:
        for key in ("same_plan", "resharded", "stock"):
            v = row.get(key)
            if isinstance(v, dict) and "error" in v:
                lines.append(f"\n{key} at {row['world_size']} ranks: {v['error']}")
        for key in ("error", "save_error", "measure_error"):
            if key in row:
                lines.append(f"\n{key} at {row['world_size']} ranks: {row[key]}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """Log-log plot of per-rank load seconds against ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (
        ("same_plan", "fastinit load, same plan", "-o"),
        ("resharded", "fastinit load, resharded from N/2", "--o"),
        ("stock", "stock DCP: .metadata read + load planning", "-s"),
    ):
        pts = _series(result["rows"], key)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (world size)")
    ax.set_ylabel("seconds, one rank (fake backend)")
    ax.set_title("Resume at scale: one rank's checkpoint load")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--model-factory", default=None, metavar="MODULE:FUNCTION")
    parser.add_argument("--plan-factory", default=None, metavar="MODULE:FUNCTION")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--stock-max", type=int, default=4096)
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the measured rank (negative: from the end); default: of the ranks holding the "
        "most sharded tables' shards, the highest-numbered",
    )
    parser.add_argument("--out", default="benchmarks/results/resume-scale")
    parser.add_argument("--quick", action="store_true", help="small model, 16 and 64 ranks")
    args = parser.parse_args(argv)
    config = ResumeScaleConfig(
        model="small" if args.quick else args.model,
        model_factory=args.model_factory,
        plan_factory=args.plan_factory,
        ranks=(16, 64) if args.quick else tuple(int(x) for x in args.ranks.split(",")),
        stock_max=args.stock_max,
        rank=args.rank,
        out=args.out,
    )
    result = run(config)
    _say(format_table(result))
    return result


if __name__ == "__main__":
    main()
