"""``make gpu-check``, step 3: a short GPU run of the time-to-first-batch benchmark.

    python -m benchmarks.gpu_check.ttfb [--out bench-out/gpu-check]

Every mode (stock, stock-best, fastinit), cold and same-hosts, one repeat, the tiny model with its
dense arch compiled, as many ranks as this host has GPUs (NCCL), plus the floor; fails if any run
fails or a run's trace shows it did not run on CUDA, and unless fastinit's same-hosts restart ran
every compiled target from its precompiled form (Triton kernels saved by the cold run;
:mod:`fastinit.warmup.precompile`) with no Dynamo trace. Prepared without a GPU at hand: run it on
the first GPU host.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/gpu-check")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        raise SystemExit(2)
    from benchmarks.ttfb import main as bench

    nproc = torch.cuda.device_count()
    summary = bench.main(
        [
            "--models", args.model,
            "--scenarios", "cold,same-hosts",
            "--repeats", "1",
            "--nproc", str(nproc),
            "--launcher", "torchrun",
            "--out", args.out,
            "--timeout", "600",
        ]
    )  # fmt: skip
    for per in summary["results"].values():
        for modes in per.values():
            for mode, res in modes.items():
                if not res["ttfb_s"] > 0:
                    raise SystemExit(f"gpu_check: {mode} has no time to first batch")
                info = res["info"]
                if (
                    not str(info.get("device", "")).startswith("cuda")
                    or info.get("backend") != "nccl"
                ):
                    raise SystemExit(
                        f"gpu_check: {mode} ran on {info.get('device')} / {info.get('backend')}"
                    )
    from benchmarks.ttfb.trainer import COMPILE_TARGETS

    for model, per in summary["results"].items():
        info = per["same-hosts"]["fastinit"]["info"]
        served, graphs = info.get("precompiled_served"), info.get("first_step_graphs")
        if served != len(COMPILE_TARGETS) or graphs != 0 or info.get("warmup_graphs", 0) != 0:
            raise SystemExit(
                f"gpu_check: {model} same-hosts: precompiled targets served {served} of "
                f"{len(COMPILE_TARGETS)}, graphs traced: first step {graphs}, warm-up "
                f"{info.get('warmup_graphs')} (expected all served, none traced)"
            )
    print(
        f"gpu_check: {nproc} GPU rank(s), every mode reached its first batch; the restart ran "
        "the precompiled targets with no Dynamo trace"
    )
    return summary


if __name__ == "__main__":
    main()
