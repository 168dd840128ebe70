"""How long a checkpoint save holds the training loop, against the memory's limit and stock's best.

    python -m benchmarks.checkpoint_blocking [--device cpu|cuda] [--rows 200000] [--tables 8]
        [--dim 64] [--saves 5] [--steps 4] [--out SCRATCH] [--results DIR] [--check]
        [--no-stock] [--no-tc]

One rank (a one-rank gloo group on CPU, NCCL on CUDA), the reference model with ``--tables``
tables of ``--rows`` x ``--dim`` (fp32; 416 MB of shards with the fused row-wise Adagrad state at
the defaults) sharded table-wise. Before every save of every saver the model trains ``--steps``
steps (batches of 256, ids uniform over each table's rows): what fastinit copies depends on the
rows those steps touched (``copied_bytes``: only the touched rows of a buffer that already holds
the rest, :mod:`fastinit.checkpoint.touched`); the other savers copy everything whatever the
steps. In one process, on the same bytes:

1. **the limits** (:mod:`benchmarks.checkpoint_blocking.limits`): a copy into buffers already
   touched (the warm copy: the least a save can hold the loop; on CUDA a device-to-host copy into
   page-locked buffers), a copy into fresh memory, the file write bandwidth (write + fsync into
   the scratch directory) and read bandwidth (from the device after ``posix_fadvise(DONTNEED)``,
   and from the page cache);
2. **fastinit**: ``checkpoint.prepare`` (its seconds: off the loop; it also fills the buffers,
   so the first save copies only the rows trained since), then every one of
   ``--saves`` saves: ``blocking_s`` (what ``save`` held the caller), ``stage_s`` (the copy),
   seconds per GB, the ratio to a warm copy timed just before it, the writer's seconds and
   ``digest_s`` (the checksums' cost on the save), and ``wait`` (the verdict);
3. **stock-best** (:mod:`benchmarks.checkpoint_blocking.anchors`): ``dcp.async_save`` with DCP's
   best stager for TorchRec's state on this host (what DCP's ``DefaultStager`` and
   ``BlockingAsyncStager(cache_staged_state_dict=True)`` say to the state is recorded), every save
   reported the same way; ``done`` = its future's result (written);
4. **torch_checkpointing** 0.1.1, configured for this host, on the same bytes as plain tensors
   (it cannot take ``ShardedTensor``): blocking = ``save`` plus the wait its staging lock imposes
   on the next in-place update (``with manager.lock()``), every save;
5. **loads** of the last fastinit checkpoint into fresh models: same plan from storage (tier off,
   page cache dropped), same plan from the host-memory tier, and resharded (each table split in
   two column shards) from storage; ``LoadReport.verify_s / seconds`` is the checksums' share.

``--check``: every load is bit-equal to the saved state (the resharded one: the weights, by
column). ``--device cuda`` (``make gpu-check``): the shards are on the GPU, the staging buffers
must be page-locked (``prepare`` registers them), and the warm copy is a device-to-host copy of
the same bytes into page-locked memory; ``--max-vs-warm 2`` fails the run if a save blocks
longer than two of those.

Prints one JSON line (the summary); ``--results DIR`` also writes ``summary.json`` and
``report.md`` there (:mod:`benchmarks.checkpoint_blocking.report`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["main", "run"]


def _sharder() -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    return EmbeddingBagCollectionSharder(fused_params=fused)


def _model(device: Any, rows: int, tables: int, dim: int, seed: int, split: bool = False) -> Any:
    """The model, table-wise (``split``: every table in two column shards, both on this rank)."""
    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    spec = ModelSpec(num_tables=tables, rows=rows, dims=(dim,))
    module = build_model(spec, device="meta", seed=seed)
    if split:
        from torchrec.distributed import sharding_plan as sp
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan
        from torchrec.distributed.types import ShardingPlan

        ebc = module.sparse.ebc
        per = {
            c.name: sp.column_wise(ranks=[0, 0], compute_kernel="fused")
            for c in ebc.embedding_bag_configs()
        }
        plan = ShardingPlan(
            {
                "sparse.ebc": construct_module_sharding_plan(
                    ebc, per, local_size=1, world_size=1, device_type=device.type
                )
            }
        )
    else:
        plan = build_plan(module, "table_wise", 1, 1, device_type=device.type)
    return fastinit.setup(module, device=device, plan=plan, sharders=[_sharder()], seed=seed)


def _optims(model: Any) -> dict[str, Any]:
    return {"optim": model.fused_optimizer}


def _tensors(model: Any) -> list[Any]:
    """Every tensor of this rank's state a save copies (shards and, on rank 0, the rest)."""
    from benchmarks.checkpoint_blocking.anchors import local_tensors
    from fastinit.checkpoint import flat_target

    return list(local_tensors(flat_target(model, _optims(model))).values())


def _global(model: Any, weights_only: bool = False) -> dict[str, Any]:
    """Every value of ``model``'s state as one CPU tensor (a world of one rank holds every
    shard): ShardedTensors assembled from their shards at their offsets."""
    import torch

    from fastinit.checkpoint import flat_target

    out: dict[str, Any] = {}
    for key, value in flat_target(model, _optims(model)).items():
        if weights_only and not key.endswith(".weight"):
            continue
        if hasattr(value, "local_shards"):
            full = torch.empty(tuple(value.size()), dtype=value.dtype)
            for shard in value.local_shards():
                box = tuple(
                    slice(o, o + s)
                    for o, s in zip(
                        shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True
                    )
                )
                full[box] = shard.tensor.detach().cpu()
            out[key] = full
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu().clone()
    return out


def _mismatched(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    import torch

    return [k for k in want if k not in got or not torch.equal(want[k], got[k])]


def _per_save(
    label: str,
    i: int,
    nbytes: int,
    warm_s: float,
    blocking_s: float,
    extra: dict[str, Any],
) -> dict[str, Any]:
    gb = nbytes / 1e9
    return {
        "save": i + 1,
        "blocking_s": blocking_s,
        "blocking_s_per_gb": blocking_s / gb if gb else None,
        "warm_copy_s": warm_s,
        "vs_warm_copy": blocking_s / warm_s if warm_s else None,
        **extra,
        "who": label,
    }


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Trainer:
    """Training steps between saves: forward and backward on fresh batches (the fused tables
    update in the backward)."""

    def __init__(
        self, model: Any, rows: int, tables: int, dim: int, steps: int, device: Any
    ) -> None:
        from fastinit.testing.models import ModelSpec

        self.model = model
        self.device = device
        self.spec = ModelSpec(num_tables=tables, rows=rows, dims=(dim,))
        self.steps = steps
        self.done = 0

    def run(self) -> None:
        from fastinit.testing.models import make_batch

        for _ in range(self.steps):
            loss, _ = self.model(make_batch(self.spec, 256, seed=self.done, device=self.device))
            loss.backward()
            self.done += 1
        if self.steps and self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()  # the steps' kernels are not the save's blocking


def _fastinit_saves(
    model: Any, scratch: str, n: int, warm: Any, nbytes: int, train: _Trainer
) -> tuple[list[dict[str, Any]], str]:
    from fastinit import checkpoint

    saves = []
    last = ""
    for i in range(n):
        train.run()
        warm_s = warm.run()
        path = os.path.join(scratch, f"fastinit-{i}")
        handle = checkpoint.save(path, model, _optims(model), metadata={"step": i})
        t0 = time.perf_counter()
        handle.wait()
        wait_s = time.perf_counter() - t0
        written = handle.written
        saves.append(
            _per_save(
                "fastinit",
                i,
                nbytes,
                warm_s,
                handle.blocking_s,
                {
                    "stage_s": handle.stage_s,
                    "staged_bytes": handle.staged_bytes,
                    "copied_bytes": handle.copied_bytes,
                    "ahead_bytes": handle.ahead_bytes,
                    "wait_s": wait_s,
                    "writer_s": written.seconds if written is not None else None,
                    "digest_s": written.digest_s if written is not None else None,
                    "written_bytes": written.bytes if written is not None else None,
                },
            )
        )
        _say(
            f"  fastinit save {i + 1}: blocking {handle.blocking_s:.3f} s (warm copy {warm_s:.3f}"
            f"; copied {handle.copied_bytes / 1e6:.0f} of {handle.staged_bytes / 1e6:.0f} MB)"
        )
        if last:
            shutil.rmtree(last, ignore_errors=True)
        last = path
    return saves, last


def _dcp_saves(
    model: Any, scratch: str, n: int, warm: Any, nbytes: int, device_type: str, train: _Trainer
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks.checkpoint_blocking.anchors import dcp_stager, local_tensors, probe_dcp
    from benchmarks.checkpoint_blocking.anchors import nbytes as nbytes_of

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}

    refused = probe_dcp(state())
    staged = nbytes_of(local_tensors(state()))
    stager, how = dcp_stager(device_type)
    group = dist.new_group(backend="gloo")
    saves = []
    for i in range(n):
        train.run()
        warm_s = warm.run()
        path = os.path.join(scratch, f"dcp-{i}")
        t0 = time.perf_counter()
        future = dcp.async_save(
            state(), checkpoint_id=path, process_group=group, async_stager=stager
        )
        blocking_s = time.perf_counter() - t0
        future.result()
        done_s = time.perf_counter() - t0
        saves.append(_per_save("stock-best", i, nbytes, warm_s, blocking_s, {"written_s": done_s}))
        _say(f"  stock-best save {i + 1}: blocking {blocking_s:.3f} s (warm copy {warm_s:.3f})")
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group(group)
    del stager
    gc.collect()
    return saves, {"how": f"dcp.async_save, {how}", "dcp_stagers": refused, "bytes": staged}


def _tc_saves(
    model: Any, scratch: str, n: int, warm: Any, nbytes: int, train: _Trainer
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks.checkpoint_blocking.anchors import (
        local_tensors,
        refusal,
        torch_checkpointing_available,
        torch_checkpointing_manager,
    )
    from benchmarks.checkpoint_blocking.anchors import nbytes as nbytes_of

    why = torch_checkpointing_available()
    if why is not None:
        return [], {"skipped": why}
    manager = torch_checkpointing_manager()
    info: dict[str, Any] = {}
    try:
        sharded = {"model": model.state_dict()}
        try:  # what it says to TorchRec's state (a ShardedTensor per table)
            future = manager.save(os.path.join(scratch, "tc-sharded"), sharded)
            if future is not None:
                future.result()
            info["sharded_tensor"] = ""
        except Exception as e:  # noqa: BLE001 - the refusal is the finding
            info["sharded_tensor"] = refusal(e)
            with contextlib.suppress(Exception):  # its close raises the failed save again
                manager.close()
            manager = torch_checkpointing_manager()

        def payload() -> dict[str, Any]:
            state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
            return {"model": local_tensors(state)}

        info["bytes"] = nbytes_of(payload()["model"])

        t0 = time.perf_counter()
        manager.prewarm_staging(payload())
        # Off the loop, as fastinit's prepare: its prewarm and its writer process's start.
        prewarm = getattr(manager, "_prewarm_staging_future", None)
        if prewarm is not None:
            prewarm.result()
        process = getattr(getattr(manager, "_saver", None), "_checkpoint_process", None)
        if process is not None:
            process.wait_for_init()
        info["prepare_s"] = time.perf_counter() - t0
        saves = []
        for i in range(n):
            train.run()
            warm_s = warm.run()
            path = os.path.join(scratch, f"tc-{i}")
            t0 = time.perf_counter()
            future = manager.save(path, payload())
            save_s = time.perf_counter() - t0
            with manager.lock():  # the loop's next in-place update waits for the staging copy
                pass
            blocking_s = time.perf_counter() - t0
            if future is not None:
                future.result()
            done_s = time.perf_counter() - t0
            saves.append(
                _per_save(
                    "torch_checkpointing",
                    i,
                    nbytes,
                    warm_s,
                    blocking_s,
                    {"save_call_s": save_s, "written_s": done_s},
                )
            )
            _say(
                f"  torch_checkpointing save {i + 1}: blocking {blocking_s:.3f} s "
                f"(warm copy {warm_s:.3f})"
            )
            shutil.rmtree(path, ignore_errors=True)
        info["how"] = (
            "torch_checkpointing.CheckpointManager: background-process writer, shared-memory "
            "staging on a thread (prewarmed), store barrier + rename; CPU: no pinned memory, no "
            "O_DIRECT; the state as plain tensors (each rank's local shards)"
        )
        return saves, info
    finally:
        manager.close()


def _drop_tree(path: str) -> None:
    from benchmarks.checkpoint_blocking.limits import drop_cache

    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                drop_cache(os.path.join(root, name))


def _load(
    path: str,
    make: Callable[[], Any],
    *,
    tier: bool,
    want: dict[str, Any] | None,
    weights_only: bool = False,
) -> dict[str, Any]:
    from fastinit import checkpoint, knobs

    model = make()
    if not tier:
        _drop_tree(path)
    with knobs.override(FASTINIT_CHECKPOINT_TIER="on" if tier else "off"):
        report = checkpoint.load(path, model, _optims(model))
    out = {
        "mode": report.mode,
        "tier": report.tier,
        "seconds": report.seconds,
        "verify_s": report.verify_s,
        "verify_share": report.verify_s / report.seconds if report.seconds else None,
        "storage_bytes": report.bytes_read,
        "memory_bytes": report.memory_bytes,
        "missing": sorted(report.missing),
    }
    if want is not None:
        bad = _mismatched(want, _global(model, weights_only))
        out["mismatched"] = bad
        if bad:
            raise SystemExit(f"checkpoint_blocking: load mismatch {bad[:5]} ({report.mode})")
    del model
    gc.collect()
    return out


def _versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": str(torch.__version__)}
    for name in ("torchrec", "fbgemm_gpu", "torch_checkpointing"):
        try:
            out[name] = str(getattr(__import__(name), "__version__", "?"))
        except ImportError:
            out[name] = "not installed"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark (the process group is up); the summary."""
    import torch

    from benchmarks.checkpoint_blocking.limits import WarmCopy, file_bandwidth, fresh_copy
    from fastinit import checkpoint
    from fastinit.checkpoint import saving

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    scratch = args.scratch
    model = _model(device, args.rows, args.tables, args.dim, seed=1)
    tensors = _tensors(model)
    nbytes = int(sum(t.numel() * t.element_size() for t in tensors))
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": str(device),
        "config": {"rows": args.rows, "tables": args.tables, "dim": args.dim, "saves": args.saves},
        "bytes": nbytes,
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_at_start": list(os.getloadavg()),
            "platform": platform.platform(),
        },
        "versions": _versions(),
    }
    _say(f"checkpoint_blocking: {nbytes / 1e6:.0f} MB of state on {device}")
    t0 = time.perf_counter()
    checkpoint.prepare(model, _optims(model), background=False)
    out["prepare_s"] = time.perf_counter() - t0
    info = saving.staging_info()
    out["staging"] = {k: info[k] for k in ("writer", "allocated_bytes", "pinned_bytes")}
    warm = WarmCopy(tensors)
    limits: dict[str, Any] = {"warm_copy_s": [warm.run() for _ in range(3)]}
    limits["fresh_copy_s"] = [fresh_copy(tensors) for _ in range(2)]
    limits["file"] = file_bandwidth(tensors, scratch)
    out["limits"] = limits
    _say(f"  limits: {json.dumps(limits)}")
    train = _Trainer(model, args.rows, args.tables, args.dim, args.steps, device)
    out["config"]["steps"] = args.steps
    out["fastinit"], last = _fastinit_saves(model, scratch, args.saves, warm, nbytes, train)
    # the state the last fastinit checkpoint holds (the other savers train on after it)
    want = _global(model) if args.check else None
    weights = _global(model, weights_only=True) if args.check else None
    worst = max(s["vs_warm_copy"] for s in out["fastinit"])
    if args.max_vs_warm is not None and worst > args.max_vs_warm:
        raise SystemExit(
            f"checkpoint_blocking: a save blocked {worst:.2f} warm copies "
            f"(limit {args.max_vs_warm:g}): {json.dumps(out['fastinit'])}"
        )
    if args.device == "cuda":
        pinned = saving.staging_info()["pinned_bytes"]
        out["staging"]["pinned_bytes"] = pinned
        if pinned < nbytes:
            raise SystemExit(f"checkpoint_blocking: {pinned} of {nbytes} staged bytes pinned")
    if not args.no_stock:
        out["stock_best"], out["stock_best_info"] = _dcp_saves(
            model, scratch, args.saves, warm, nbytes, device.type, train
        )
    if not args.no_tc:
        out["torch_checkpointing"], out["torch_checkpointing_info"] = _tc_saves(
            model, scratch, args.saves, warm, nbytes, train
        )
    warm.close()
    del model, tensors
    gc.collect()

    def make(seed: int, split: bool = False) -> Callable[[], Any]:
        return lambda: _model(device, args.rows, args.tables, args.dim, seed=seed, split=split)

    out["load"] = {
        "storage": _load(last, make(2), tier=False, want=want),
        "memory": _load(last, make(3), tier=True, want=want),
        "resharded": _load(last, make(4, split=True), tier=False, want=weights, weights_only=True),
    }
    for name, res in out["load"].items():
        _say(f"  load {name}: {json.dumps(res)}")
    out["machine"]["load_avg_at_end"] = list(os.getloadavg())
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--saves", type=int, default=5, help="saves of each saver")
    parser.add_argument(
        "--steps", type=int, default=4, help="training steps before every save (default 4)"
    )
    parser.add_argument("--out", default=None, help="scratch dir for checkpoints (default: tmp)")
    parser.add_argument("--results", default=None, help="write summary.json and report.md here")
    parser.add_argument("--check", action="store_true", help="every load bit-equal")
    parser.add_argument("--no-stock", action="store_true", help="skip stock-best (dcp)")
    parser.add_argument("--no-tc", action="store_true", help="skip torch_checkpointing")
    parser.add_argument(
        "--max-vs-warm",
        type=float,
        default=None,
        help="fail if a fastinit save blocks longer than this many warm copies (make gpu-check)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.saves < 1:
        raise SystemExit("--saves must be >= 1")
    import torch
    import torch.distributed as dist

    from fastinit import checkpoint

    if args.device == "cuda":
        torch.cuda.set_device(0)
    scratch = args.out or tempfile.mkdtemp(prefix="fastinit-ckpt-bench-")
    os.makedirs(scratch, exist_ok=True)
    args.scratch = scratch
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        store=store,
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0) if args.device == "cuda" else None,
    )
    try:
        out = run(args)
    finally:
        checkpoint.close()
        dist.destroy_process_group()
        if args.out is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.results:
        from benchmarks.checkpoint_blocking.report import write

        os.makedirs(args.results, exist_ok=True)
        write(out, args.results, " ".join(["python -m benchmarks.checkpoint_blocking", *argv]))
    print(json.dumps(out, default=str), flush=True)
    return out
