"""``make gpu-check``: the GPU checks of :mod:`benchmarks.gpu_check`, in under 8 minutes once
installed (``make env CUDA=1`` first: torch and fbgemm-gpu, CUDA builds).

    python -m benchmarks.gpu_check [--out bench-out/gpu-check] [--without-torchrec]

Each step runs in its own process (``python -m <module> <args>``) under its time limit; the first
step that fails or runs out of time ends the run with a non-zero exit status.
``--without-torchrec`` runs only the steps that need neither TorchRec nor fbgemm-gpu (a host
with torch's CUDA build alone, such as one that cannot install fbgemm-gpu's 470 MB wheel).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys

#: (what it checks, seconds allowed, ``python -m`` arguments; ``{out}`` is the output directory).
STEPS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    (
        "start-up protocol on NCCL, fastinit.setup, fbgemm CUDA kernels, one training step (~3 min)",
        240,
        ("benchmarks.gpu_check.startup", "--out", "{out}"),
    ),
    (
        "fastinit.warmup on CUDA: per-thread device, warm-up, the compile cache with Triton (~2 min)",
        150,
        ("benchmarks.gpu_check.warmup",),
    ),
    (
        "the time-to-first-batch benchmark on NCCL: tiny model, every mode; fastinit's same-hosts "
        "restart runs its compiled targets from their precompiled form, no Dynamo trace (~2 min)",
        120,
        ("benchmarks.gpu_check.ttfb",),
    ),
    (
        "fastinit.checkpoint on CUDA shards: prepare page-locks the reused staging buffers, every "
        "save blocks at most 2x a device-to-host copy of the same bytes into a warm page-locked "
        "buffer, the writer process commits; loads (same plan from storage and from the "
        "host-memory tier, resharded) bit-equal; stock-best beside it (~2 min)",
        240,
        (
            "benchmarks.checkpoint_blocking",
            "--device",
            "cuda",
            "--check",
            "--rows",
            "100000",
            "--saves",
            "3",
            "--no-tc",
            "--max-vs-warm",
            "2",
        ),
    ),
    (
        "fastinit.checkpoint on a dense CUDA model (no TorchRec): page-locked reused staging, "
        "every save blocks at most 2x a device-to-host copy into a warm page-locked buffer, the "
        "writer process commits, loads from the staging buffer and from the files bit-equal "
        "(~1 min)",
        180,
        ("benchmarks.gpu_check.dense",),
    ),
)

#: Steps that need neither TorchRec nor fbgemm-gpu (``--without-torchrec`` runs only these).
WITHOUT_TORCHREC = {"benchmarks.gpu_check.dense"}

#: Steps whose standard output is also kept, as ``<out>/<file>``.
KEEP_STDOUT = {
    "benchmarks.checkpoint_blocking": "checkpoint_blocking.json",
    "benchmarks.gpu_check.dense": "dense.json",
}

_CUDA = (
    "import sys, torch; sys.exit(0 if torch.cuda.is_available() else "
    '"gpu-check: no CUDA device (or a CPU build of torch: make env CUDA=1)")'
)


def _run(args: list[str], seconds: int, keep: pathlib.Path | None) -> int:
    """``python -m args`` in its own process group; its exit status (124 when out of time)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        stdout=subprocess.PIPE if keep is not None else None,
        text=True,
        start_new_session=True,
    )
    try:
        if keep is None:
            return proc.wait(timeout=seconds)
        out, _ = proc.communicate(timeout=seconds)
        sys.stdout.write(out)
        keep.write_text(out)
        return proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return 124


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="make gpu-check: fastinit's CUDA path on one GPU")
    parser.add_argument("--out", default="bench-out/gpu-check")
    parser.add_argument(
        "--without-torchrec",
        action="store_true",
        help="only the steps that need neither TorchRec nor fbgemm-gpu",
    )
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = subprocess.run([sys.executable, "-c", _CUDA], check=False)
    if cuda.returncode != 0:
        return cuda.returncode
    steps = [s for s in STEPS if s[2][0] in WITHOUT_TORCHREC or not args.without_torchrec]
    for number, (what, seconds, step) in enumerate(steps, 1):
        print(f"gpu-check {number}/{len(steps)}: {what}", flush=True)
        keep = KEEP_STDOUT.get(step[0])
        code = _run(
            [a.format(out=out) for a in step], seconds, out / keep if keep is not None else None
        )
        if code != 0:
            reason = f"ran out of its {seconds} s" if code == 124 else f"exit status {code}"
            print(f"gpu-check {number}/{len(steps)} failed: {reason}", file=sys.stderr)
            return code
    print(f"gpu-check: all {len(steps)} steps passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
