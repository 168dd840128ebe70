"""``make gpu-check``, the step that needs no TorchRec: fastinit.checkpoint on a dense CUDA model.

    python -m benchmarks.gpu_check.dense [--mb 256] [--saves 3]

For a GPU host without fbgemm-gpu's CUDA build (its wheel is about 470 MB; a host that cannot
install it still checks this much). One rank, its parameters and Adam state on CUDA:

1. ``prepare`` page-locks the reused staging buffers (``cudaHostRegister``);
2. every save's blocking (the ``save`` call: the device-to-host copy into those buffers) is at
   most ``--max-vs-warm`` times a copy of the same bytes into warm page-locked buffers
   (``WarmCopy`` of ``benchmarks/checkpoint_blocking/limits.py``, the blocking benchmark's
   limit), a training step between saves;
3. the writer process commits every save, and a load in the same process (the staging buffer,
   no tensor data read from files) gives the state of the last ``save`` call bit for bit;
4. a fresh process with the host-memory tier off loads the same checkpoint from its files, bit
   for bit.

Prints one JSON object; exits non-zero (an ``AssertionError``) when a check fails.
``--device cpu`` runs the same on CPU and gloo (the warm copy then into pageable memory, no
page-locking checked): a dry run of this script on a host without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

_WIDTH = 4096


def _model(mb: int, seed: int, device: str) -> tuple[Any, Any]:
    """Linear layers of about ``mb`` MB of parameters on ``device``, and their Adam after one
    step."""
    import torch

    layers = max(1, mb * 2**20 // (4 * _WIDTH * (_WIDTH + 1)))
    gen = torch.Generator(device=device).manual_seed(seed)
    # made on the meta device and filled from ``gen``: never the global RNG
    linears = [torch.nn.Linear(_WIDTH, _WIDTH, device="meta") for _ in range(layers)]
    model = torch.nn.Sequential(*linears).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, device=device, generator=gen) * 0.01)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, optim, gen)
    return model, optim


def _step(model: Any, optim: Any, gen: Any) -> None:
    """One training step, its input drawn from ``gen`` (on the model's device)."""
    import torch

    optim.zero_grad()
    model(torch.randn(8, _WIDTH, device=gen.device, generator=gen)).square().mean().backward()
    optim.step()
    if gen.device.type == "cuda":
        torch.cuda.synchronize()


def _tensors(model: Any, optim: Any) -> dict[str, Any]:
    """Every tensor a save holds, by name."""
    from benchmarks.checkpoint_blocking.anchors import local_tensors
    from fastinit.checkpoint.state import build_state

    return local_tensors(build_state(model, {"optim": optim}))


def _digests(model: Any, optim: Any) -> dict[str, str]:
    """The checkpoint's digest (xxh3-128) of every tensor of the model and optimizer, by name."""
    from fastinit.checkpoint.digest import digest

    return {
        name: digest(t.detach().cpu().contiguous().numpy().data)
        for name, t in _tensors(model, optim).items()
    }


def _saving_rank(root: str, mb: int, saves: int, device: str) -> dict[str, Any]:
    import torch

    import fastinit.checkpoint as fc
    from benchmarks.checkpoint_blocking.anchors import nbytes
    from benchmarks.checkpoint_blocking.limits import WarmCopy
    from fastinit.checkpoint import saving

    model, optim = _model(mb, 0, device)
    gen = torch.Generator(device=device).manual_seed(1)
    fc.prepare(model, {"optim": optim}, background=False)
    pool = saving._SAVER.pool
    assert pool is not None, "prepare made no staging pool"
    out: dict[str, Any] = {"pinned_bytes": pool.pinned_bytes(), "shared": pool.shared}
    out["pool_warning"] = pool.warning
    blocking = []
    for i in range(saves):
        _step(model, optim, gen)
        start = time.perf_counter()
        handle = fc.save(f"{root}/s{i}", model, {"optim": optim}, metadata={"step": i})
        blocking.append(time.perf_counter() - start)
        want = _digests(model, optim)  # the state at this save
        handle.wait()
    out["blocking_s"] = blocking
    tensors = list(_tensors(model, optim).values())
    warm = WarmCopy(tensors)  # (copied once when made: every page is there)
    out["warm_copy_s"], out["bytes"] = warm.run(), nbytes(tensors)
    warm.close()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    report = fc.load(f"{root}/s{saves - 1}", model, {"optim": optim})
    out["memory_load"] = {"bytes_read": report.bytes_read, "memory_bytes": report.memory_bytes}
    out["memory_load_equal"] = _digests(model, optim) == want
    out["want"] = want
    fc.close()
    return out


def _loading_rank(root: str, mb: int, saves: int, device: str) -> dict[str, Any]:
    import fastinit.checkpoint as fc

    model, optim = _model(mb, 2, device)
    report = fc.load(f"{root}/s{saves - 1}", model, {"optim": optim})
    return {
        "bytes_read": report.bytes_read,
        "memory_bytes": report.memory_bytes,
        "digests": _digests(model, optim),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="parameters, MB (Adam adds 2x)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--max-vs-warm", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)

    import torch

    from fastinit.testing.dist import run_ranks

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_check.dense needs a CUDA device (or --device cpu)")
    with tempfile.TemporaryDirectory(prefix="fastinit-gpu-dense-") as root:
        job = (root, args.mb, args.saves, args.device)
        backend = "nccl" if cuda else "gloo"
        saved = run_ranks(_saving_rank, 1, args=job, backend=backend, timeout=args.timeout)[0]
        env = {"FASTINIT_CHECKPOINT_TIER": "off"}
        loaded = run_ranks(_loading_rank, 1, args=job, env=env, timeout=args.timeout)[0]
    want = saved.pop("want")
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        **saved,
        "vs_warm": [b / saved["warm_copy_s"] for b in saved["blocking_s"]],
        "storage_load": {k: loaded[k] for k in ("bytes_read", "memory_bytes")},
        "storage_load_equal": loaded["digests"] == want,
    }
    print(json.dumps(result, indent=1), flush=True)
    assert saved["pinned_bytes"] > 0 or not cuda, "prepare page-locked no staging buffer"
    assert saved["memory_load_equal"], "the load from the staging buffer differs from the save"
    assert saved["memory_load"]["bytes_read"] == 0, "the same-process load read tensor data"
    assert result["storage_load_equal"], "the load from the files differs from the save"
    assert loaded["bytes_read"] > 0 and loaded["memory_bytes"] == 0, "tier off, yet not from files"
    worst = max(result["vs_warm"])
    assert worst <= args.max_vs_warm, f"a save blocked {worst:.2f}x the warm page-locked copy"
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
