"""A fastinit job for tests/restart: save, lose a rank, resume in a worker the zygote forked.

    torchrun --max-restarts 1 --nproc-per-node 2 ... -m fastinit.restart checkpoint_job.py OUT

Attempt 0: a sharded model (``fastinit.testing.models``, fused row-wise Adagrad) saves step 1
through ``CheckpointManager``, trains a step (its local values to ``OUT/ref-rank<r>.pt``) and
saves step 2 with its writers slowed by 8 s; once that save returned on every rank, the last
rank SIGKILLs itself. Attempt 1 (forked by the zygote, so its parent is not torchrun's agent)
must find the dead trainers' writers by ``launcher_pid()``, wait for step 2's commit and resume
from it: a model built with another seed loads the latest checkpoint and writes
``OUT/resumed-rank<r>.json`` (the load report's bytes from storage and from memory, whether a
zygote forked it, and which values differ from the reference).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

import fastinit
import fastinit.restart
from fastinit import checkpoint
from fastinit.checkpoint.loading import flat_target
from fastinit.testing.faults import inject
from fastinit.testing.models import ModelSpec, build_model, build_plan, make_batch

SPEC = ModelSpec(num_tables=4, num_weighted_tables=1, num_ec_tables=1, rows=64, dims=(8, 16))
TYPES = {"t0": "table_wise", "t1": "row_wise", "t2": "column_wise", "t3": "table_wise"}
TYPES |= {"w0": "table_wise", "e0": "row_wise"}


def build(seed: int):
    module = build_model(SPEC, device="meta", seed=seed)
    plan = build_plan(module, TYPES, dist.get_world_size())
    params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharders = [
        EmbeddingBagCollectionSharder(fused_params=dict(params)),
        EmbeddingCollectionSharder(fused_params=dict(params)),
    ]
    model = fastinit.setup(module, plan=plan, sharders=sharders, seed=seed)
    return model, {"optim": model.fused_optimizer}


def local(model, optimizers) -> dict:
    out = {}
    for key, value in flat_target(model, optimizers).items():
        if hasattr(value, "local_shards"):
            out[key] = [s.tensor.detach().clone() for s in value.local_shards()]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
    return out


def main() -> None:
    out = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    fastinit.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    manager = checkpoint.CheckpointManager(os.path.join(out, "ckpt"))
    if attempt == 0:
        model, opts = build(seed=1)
        manager.save(1, model, opts, blocking=True)
        loss, _ = model(make_batch(SPEC, 8, seed=10 + rank))
        loss.backward()
        torch.save(local(model, opts), os.path.join(out, f"ref-rank{rank}.pt"))
        with inject("checkpoint.write", "sleep", seconds=8):  # the writers take 8 s more
            manager.save(2, model, opts)
        dist.barrier()  # save 2 returned on every rank; its writers are still writing
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # torchrun stops this worker and restarts both
        return
    model, opts = build(seed=2)
    report = manager.load_latest(model, opts)
    ref = torch.load(os.path.join(out, f"ref-rank{rank}.pt"), weights_only=False)
    now = local(model, opts)
    differ = sorted(
        k
        for k in ref
        if not all(
            torch.equal(a, b)
            for a, b in zip(
                ref[k] if isinstance(ref[k], list) else [ref[k]],
                now[k] if isinstance(now[k], list) else [now[k]],
                strict=True,
            )
        )
    )
    result = {
        "served": fastinit.restart.served(),
        "step": manager.loaded_step,
        "storage_bytes": report.bytes_read if report else None,
        "memory_bytes": report.memory_bytes if report else None,
        "compared": len(ref),
        "differ": differ,
    }
    with open(os.path.join(out, f"resumed-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    checkpoint.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
