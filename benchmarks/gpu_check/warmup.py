"""``make gpu-check``, step 2: fastinit.warmup on CUDA: per-thread device, warm-up, compile cache.

    python -m benchmarks.gpu_check.warmup   # or: from benchmarks.gpu_check.warmup import gpu_check_warmup

Needs CUDA (1 GPU is enough; with 2 or more the device checks use a non-zero device). Not run by
the CPU test suite. Checks, each a clear ``AssertionError`` when it fails:

1. every stage of a :class:`fastinit.warmup.StageGraph` runs with the configured CUDA device
   current in its own thread (local stages and the collective lane), and allocations land there;
2. the example DLRM trainer on CUDA (NCCL, Inductor/Triton): the losses after warm-up equal those
   of a run without warm-up, with the pipeline's features in another order than the model's;
3. the compile cache across jobs: a first job misses and saves, a second job (fresh process,
   same cache directory) reports "hit", confirmed by Inductor's own cache-hit counter.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any


def _device_rank() -> dict[str, Any]:
    import torch

    from fastinit.warmup import GraphConfig, StageGraph

    index = torch.cuda.device_count() - 1  # the last GPU: not the per-thread default cuda:0
    seen: dict[str, tuple[str, int, str]] = {}
    lock = threading.Lock()

    def probe(name: str) -> Any:
        def fn() -> None:
            t = torch.ones(1, device="cuda")  # "cuda" means the thread's current device
            with lock:
                seen[name] = (
                    threading.current_thread().name,
                    torch.cuda.current_device(),
                    str(t.device),
                )

        return fn

    graph = StageGraph(GraphConfig(device=f"cuda:{index}", max_workers=2))
    graph.add("a", probe("a"))
    graph.add("b", probe("b"))
    graph.add("lane", probe("lane"), collective=True)
    graph.run()
    for name, (thread, current, device) in seen.items():
        assert current == index and device == f"cuda:{index}", (name, thread, current, device)
    return {"index": index, "seen": seen}


def _trainer_rank(cache_dir: str) -> dict[str, Any]:
    from examples.dlrm_trainer import TrainerConfig, train

    common: dict[str, Any] = {"steps": 4, "backend": "inductor", "compile_cache": cache_dir}
    plain = train(TrainerConfig(warmup=False, **common))
    warmed = train(TrainerConfig(warmup=True, **common))
    return {"plain": plain["losses"], "warmed": warmed["losses"], "cache": warmed["compile_cache"]}


def gpu_check_warmup(world_size: int | None = None, timeout: float = 900.0) -> dict[str, Any]:
    """Run the GPU checks of the module docstring; returns what was measured.

    Args:
        world_size: ranks for the trainer check (default: 1; one GPU per rank).
        timeout: seconds per multi-process step.

    Raises:
        AssertionError: a check failed.
        RuntimeError: no CUDA device.
    """
    import torch

    from fastinit.testing.dist import run_ranks

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_check_warmup needs a CUDA device")
    world = world_size or 1
    out: dict[str, Any] = {}
    out["device"] = run_ranks(_device_rank, 1, init_pg=False, timeout=timeout)[0]
    with tempfile.TemporaryDirectory(prefix="fastinit-gpu-cache-") as cache_dir:
        os.chmod(cache_dir, 0o700)
        jobs = []
        for _ in range(2):  # two jobs, each in fresh processes, sharing the cache directory
            jobs.append(
                run_ranks(_trainer_rank, world, args=(cache_dir,), backend="nccl", timeout=timeout)
            )
    for job in jobs:
        for rank in job:
            assert rank["plain"] == rank["warmed"], ("warm-up changed training", rank)
    assert {r["cache"] for r in jobs[0]} == {"miss"}, jobs[0]
    assert {r["cache"] for r in jobs[1]} == {"hit"}, jobs[1]
    out["losses"] = jobs[1][0]["plain"]
    out["cache"] = [[r["cache"] for r in job] for job in jobs]
    return out


if __name__ == "__main__":
    print(gpu_check_warmup())
