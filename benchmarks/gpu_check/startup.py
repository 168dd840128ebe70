"""``make gpu-check``, step 1: fastinit's start-up on CUDA and NCCL, one GPU (a few minutes).

Checks, in order (each prints PASS/FAIL with its time; the exit status is the number of FAILs):

1. ``init_process_group("nccl", device_id=...)`` with one rank; start-up messages choose CUDA
   for that group.
2. Every start-up message kind (record all_gather, plan broadcast, digest all_reduce, tensor
   broadcast) through NCCL with CUDA tensors, the CUDA current device set on the issuing thread,
   counted at the dispatcher.
3. The device-side checksum on CUDA equals the same checksum computed on the CPU (integer sums are
   exact: the digest of a value does not depend on where it is computed).
4. ``fastinit.setup`` on the NCCL group, planned by the default planner for a CUDA topology;
   fbgemm's CUDA kernels (the TBE modules live on the GPU); one training step through
   TorchRec's ``TrainPipelineSparseDist``; the same plan, state_dict keys and shard metadata as
   stock ``DistributedModelParallel``.
5. The verify phase's cost on the large reference model's replicated values, on the GPU.
6. A ``cpu:gloo,cuda:nccl`` group: messages on the CPU, ``setup`` on CUDA.

Two ranks cannot share one GPU under NCCL (it refuses duplicate devices in a communicator), so the
timeout path is not exercised here; see docs/startup.md.

Usage::

    .venv/bin/python -m benchmarks.gpu_check.startup --out bench-out/gpu-check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

RESULTS: list[dict[str, Any]] = []


def check(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        value = fn()
        ok = True
    except Exception:  # noqa: BLE001 - every failure is reported, the run goes on
        value = traceback.format_exc()
        ok = False
    seconds = time.perf_counter() - t0
    RESULTS.append({"check": name, "ok": ok, "seconds": seconds, "value": _plain(value)})
    print(f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.2f}s)", flush=True)
    if not ok:
        print(value, flush=True)
    return value if ok else None


def _plain(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _versions() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist_name in ("torchrec", "fbgemm_gpu", "fbgemm-gpu", "fbgemm-gpu-cpu"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist_name] = md.version(dist_name)
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def _init(backend: str) -> Any:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if dist.is_initialized():
        dist.destroy_process_group()
    # torch 2.15's nccl backend (nccl2) needs the rank's device at init, mixed backends included.
    device_id = torch.device("cuda", 0) if "nccl" in backend else None
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id
    )
    return dist.group.WORLD


def nccl_group() -> str:
    import torch

    from fastinit import protocol

    assert torch.cuda.is_available(), "no CUDA device"
    torch.cuda.set_device(0)
    pg = _init("nccl")
    device = protocol.comm_device(pg, torch.device("cuda", 0))
    assert device == torch.device("cuda", 0), device
    return str(device)


def nccl_messages() -> dict[str, Any]:
    import torch

    from fastinit import protocol, trace

    pg = _init("nccl")
    with trace.Tracer(rank=0) as tracer, tracer.window() as counts:
        channel = protocol.Channel(pg, torch.device("cuda", 0))
        assert channel.device.type == "cuda"
        assert channel.all_gather_bytes(b"abc", 4, "record") == [b"abc\0"]
        assert channel.broadcast_bytes(b"plan!", 5, 0, "plan") == b"plan!"
        values = torch.tensor([3, -3], dtype=torch.int64, device="cuda")
        assert channel.all_reduce_max(values, "digests").tolist() == [3, -3]
        tensors = [torch.randn(5, device="cuda"), torch.arange(3, device="cuda")]
        before = [t.clone() for t in tensors]
        channel.broadcast_tensors(tensors, 0, "replicas")
        assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
        named = [(f"t{i}", t) for i, t in enumerate(tensors)]
        assert protocol.verify_replicas(channel, named) == []
    assert counts["c10d_total"] == 5, counts["c10d_ops"]
    return {"ops": counts["c10d_ops"], "bytes": counts["c10d_bytes"]}


def checksum_same_on_both_devices() -> int:
    import torch

    from fastinit import protocol

    g = torch.Generator().manual_seed(0)
    samples = [
        torch.randn(5_000_001, generator=g),
        torch.randn(333, 7, generator=g).half(),
        torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        torch.randn(64, 48, generator=g).t(),
    ]
    for t in samples:
        cpu = int(protocol.device_checksum(t))
        gpu = int(protocol.device_checksum(t.cuda()))
        assert cpu == gpu, (t.dtype, tuple(t.shape), cpu, gpu)
    return len(samples)


def setup_and_train() -> dict[str, Any]:
    import torch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import fastinit
    from fastinit import trace
    from fastinit.testing.models import ModelSpec, batches, build_model, plan_to_plain
    from fastinit.testing.stock import stock_setup

    pg = _init("nccl")
    device = torch.device("cuda", 0)
    spec = ModelSpec(num_tables=6, num_weighted_tables=2, num_ec_tables=2, fp16_every=3)
    with trace.Tracer(rank=0) as tracer, tracer.window() as counts:
        model = fastinit.setup(build_model(spec, device="meta"), device=device, seed=3)
    stock = stock_setup(build_model(spec, device="meta"), model.plan, device=device)
    assert plan_to_plain(model.plan) == plan_to_plain(stock.plan)
    assert list(model.state_dict()) == list(stock.state_dict())
    tbe = [
        type(m).__name__
        for m in model.modules()
        if "SplitTableBatchedEmbeddingBags" in type(m).__name__
    ]
    assert tbe, "no fbgemm TBE module"
    on_gpu = {p.device.type for p in model.parameters()}
    assert on_gpu == {"cuda"}, on_gpu
    optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.05),
    )
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, batch_size=32, seed=1)
    data = iter([next(it) for _ in range(2)])
    losses = [float(pipeline.progress(data)[0]) for _ in range(2)]
    assert all(loss == loss for loss in losses), losses
    del pg
    return {"losses": losses, "tbe": sorted(set(tbe)), "setup_ops": counts["c10d_ops"]}


def verify_cost_large() -> dict[str, Any]:
    import torch

    import fastinit
    from benchmarks.ttfb.trainer import model_spec
    from fastinit import protocol
    from fastinit.testing.models import build_model, build_plan

    _init("nccl")
    device = torch.device("cuda", 0)
    module = build_model(model_spec("large"), device="meta")
    plan = build_plan(
        module,
        ["table_wise", "row_wise", "column_wise", "data_parallel"],
        1,
        device_type="cuda",
    )
    t0 = time.perf_counter()
    model = fastinit.setup(module, device=device, plan=plan, seed=0)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    named = protocol.replicated_tensors(model.module, model.plan)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        digests = protocol.tensor_digests([t for _, t in named])
        digests.cpu()
        times.append(time.perf_counter() - t1)
    times.sort()
    return {
        "setup_s": setup_s,
        "digests_s_median": times[len(times) // 2],
        "tensors": len(named),
        "bytes_checked": sum(t.numel() * t.element_size() for _, t in named),
    }


def gloo_and_nccl_group() -> dict[str, Any]:
    import torch

    import fastinit
    from fastinit import protocol
    from fastinit.testing.models import ModelSpec, build_model

    pg = _init("cpu:gloo,cuda:nccl")
    assert protocol.comm_device(pg, torch.device("cuda", 0)).type == "cpu"
    channel = protocol.Channel(pg, torch.device("cuda", 0))
    assert channel.all_gather_bytes(b"x", 1, "record") == [b"x"]
    model = fastinit.setup(
        build_model(ModelSpec(num_tables=4), device="meta"), device=torch.device("cuda", 0)
    )
    return {"params_on": sorted({p.device.type for p in model.parameters()})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-out/gpu-check")
    args = parser.parse_args()
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    print("versions:", json.dumps(_versions()), flush=True)
    if check("nccl group of one rank; messages on CUDA", nccl_group) is None:
        return _finish(args.out)
    check("every start-up message through NCCL on CUDA tensors", nccl_messages)
    check("device checksum: CUDA equals CPU", checksum_same_on_both_devices)
    check("fastinit.setup on NCCL + fbgemm CUDA kernels + one training step", setup_and_train)
    check("verify phase cost on the large model (GPU digests)", verify_cost_large)
    check("cpu:gloo,cuda:nccl group: messages on CPU, model on CUDA", gloo_and_nccl_group)
    return _finish(args.out)


def _finish(out: str) -> int:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump({"versions": _versions(), "checks": RESULTS}, f, indent=1)
    failed = sum(1 for r in RESULTS if not r["ok"])
    print(f"{len(RESULTS) - failed} passed, {failed} failed; details in {path}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
