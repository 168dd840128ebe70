"""How long ``fastinit.checkpoint.save(blocking=False)`` holds the training loop, per GB of shards.

    python -m benchmarks.checkpoint_blocking [--device cpu|cuda] [--rows 200000] [--tables 8]
                                             [--dim 64] [--out DIR] [--check]

One rank (a one-rank gloo group on CPU, NCCL on CUDA), the reference model with ``--tables``
tables of ``--rows`` x ``--dim`` (fp32) sharded table-wise with a fused EXACT_ROWWISE_ADAGRAD,
saved three times with ``blocking=False`` (the time ``save`` returns after = the staging copy;
then ``wait`` = the background write and commit) and once with ``blocking=True``. Prints one
JSON line: bytes staged, blocking seconds (min of the repeats), seconds per GB, write seconds.
``--check`` also loads the checkpoint into a fresh model (same plan) and requires every value to
be bit-equal, and on CUDA that the staged copies are in pinned memory (for ``make gpu-check``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

__all__ = ["main"]


def _model(device: Any, rows: int, tables: int, dim: int, seed: int) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    spec = ModelSpec(num_tables=tables, rows=rows, dims=(dim,))
    module = build_model(spec, device="meta", seed=seed)
    plan = build_plan(module, "table_wise", 1, 1, device_type=device.type)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    return fastinit.setup(module, device=device, plan=plan, sharders=[sharder], seed=seed)


def _values(model: Any) -> dict[str, Any]:
    from fastinit.checkpoint.loading import flat_target

    out: dict[str, Any] = {}
    for key, value in flat_target(model, {"optim": model.fused_optimizer}).items():
        if hasattr(value, "local_shards"):
            out[key] = [s.tensor.detach().cpu().clone() for s in value.local_shards()]
        elif hasattr(value, "detach"):
            out[key] = [value.detach().cpu().clone()]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="checkpoint scratch dir (default: a tmp dir)")
    parser.add_argument("--check", action="store_true", help="also load back and compare")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from fastinit import checkpoint
    from fastinit.checkpoint import saving

    if args.device == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    scratch = args.out or tempfile.mkdtemp(prefix="fastinit-ckpt-bench-")
    os.makedirs(scratch, exist_ok=True)
    store = dist.FileStore(os.path.join(scratch, "store"), 1)
    dist.init_process_group(
        backend,
        store=store,
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,  # torch 2.15's nccl needs it
    )
    try:
        model = _model(device, args.rows, args.tables, args.dim, seed=1)
        opts = {"optim": model.fused_optimizer}
        blocking, writing = [], []
        nbytes = 0
        for i in range(args.repeats):
            path = os.path.join(scratch, f"async-{i}")
            handle = checkpoint.save(path, model, opts, metadata={"step": i})
            blocking.append(handle.blocking_s)
            t0 = time.perf_counter()
            handle.wait()
            writing.append(time.perf_counter() - t0)
            nbytes = handle.staged_bytes
            if i:
                shutil.rmtree(path)
        t0 = time.perf_counter()
        checkpoint.save(os.path.join(scratch, "sync"), model, opts, blocking=True)
        sync_s = time.perf_counter() - t0
        gb = nbytes / 1e9
        out: dict[str, Any] = {
            "device": str(device),
            "bytes": nbytes,
            "blocking_s": min(blocking),
            "blocking_s_per_gb": min(blocking) / gb if gb else None,
            "blocking_all_s": blocking,
            "background_write_s": min(writing),
            "blocking_true_s": sync_s,
            "torch": torch.__version__,
        }
        if args.check:
            if device.type == "cuda":
                from fastinit.checkpoint.state import build_state, flat_state, is_sharded

                flat = flat_state(build_state(model, opts))
                staged = saving._stage({k: v for k, v in flat.items() if is_sharded(v)})
                tensors = [t for t in staged.values() if isinstance(t, torch.Tensor)]
                out["staged_pinned"] = bool(tensors) and all(t.is_pinned() for t in tensors)
                if not out["staged_pinned"]:
                    raise SystemExit("checkpoint_blocking: staged copies are not pinned")
            fresh = _model(device, args.rows, args.tables, args.dim, seed=2)
            report = checkpoint.load(
                os.path.join(scratch, "async-0"), fresh, {"optim": fresh.fused_optimizer}
            )
            a, b = _values(model), _values(fresh)
            bad = [k for k in a if not all(torch.equal(x, y) for x, y in zip(a[k], b[k]))]
            out["load_mode"] = report.mode
            out["load_bytes"] = report.bytes_read
            out["mismatched"] = bad
            if bad or report.mode != "same-plan":
                raise SystemExit(f"checkpoint_blocking: load mismatch {bad[:5]} ({report.mode})")
        print(json.dumps(out), flush=True)
        return out
    finally:
        dist.destroy_process_group()
        if args.out is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
