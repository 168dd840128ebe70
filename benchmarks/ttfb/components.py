"""torchx components of the time-to-first-batch benchmark.

    torchx run -s local_cwd benchmarks/ttfb/components.py:ttfb --mode fastinit --model small --nproc 2

The same component runs on a CPU box (gloo, everything on 127.0.0.1) and on a multi-GPU host
(NCCL: ``--nproc`` = GPUs per host, ``--gpu`` = the same), or several hosts (``--nnodes``).
"""

# torchx's component linter reads the signature's AST and knows only ``Optional[...]``/``Dict``.
# ruff: noqa: UP006, UP007, UP035, UP045

from typing import Dict, Optional

import torchx.specs as specs
from torchx.components import dist

__all__ = ["ttfb", "trainer_args", "trainer_entry"]


def trainer_entry(mode: str, fastinit_parts: str = "all") -> list[str]:
    """The module torchrun runs for ``mode`` and its first arguments: full fastinit mode goes
    through ``python -m fastinit.restart`` (a restart forked by a zygote, with torch and TorchRec
    imported: fastinit/restart); every other mode, and fastinit's one-line-change parts, run the
    trainer as a stock user's script would."""
    if mode == "fastinit" and fastinit_parts == "all":
        return ["fastinit.restart", "-m", "benchmarks.ttfb.trainer"]
    return ["benchmarks.ttfb.trainer"]


def trainer_args(
    mode: str,
    model: str,
    cache: str,
    out: str,
    cache_dir: str | None = None,
    data_dir: str = "bench-out/data",
    batch_size: int = 256,
    num_workers: int = 1,
    no_compile: bool = False,
    steps: int = 1,
    checkpoint_dir: str | None = None,
    checkpoint_step: int = 0,
    checkpoint_every: int = 0,
    checkpointer: str = "mode",
) -> list[str]:
    """The command-line arguments of ``benchmarks.ttfb.trainer`` for one run."""
    args = ["--mode", mode, "--model", model, "--cache", cache, "--out", out]
    args += ["--data-dir", data_dir, "--batch-size", str(batch_size)]
    args += ["--num-workers", str(num_workers)]
    if cache_dir:
        args += ["--cache-dir", cache_dir]
    if no_compile:
        args.append("--no-compile")
    if steps != 1:
        args += ["--steps", str(steps)]
    if checkpoint_dir:
        args += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-step", str(checkpoint_step)]
    if checkpoint_every:
        args += ["--checkpoint-every", str(checkpoint_every)]
    if checkpointer != "mode":
        args += ["--checkpointer", checkpointer]
    return args


def ttfb(
    mode: str = "fastinit",
    model: str = "small",
    cache: str = "cold",
    out: str = "bench-out/run",
    cache_dir: Optional[str] = None,
    data_dir: str = "bench-out/data",
    nproc: int = 2,
    nnodes: int = 1,
    batch_size: int = 256,
    num_workers: int = 1,
    no_compile: bool = False,
    steps: int = 1,
    checkpoint_dir: Optional[str] = None,
    checkpoint_step: int = 0,
    checkpoint_every: int = 0,
    checkpointer: str = "mode",
    max_restarts: int = 0,
    gpu: int = 0,
    cpu: int = 2,
    memMB: int = 8192,  # noqa: N803 - torchx's spelling
    image: str = "",
    rdzv_port: int = 29500,
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """Time to first batch of the reference TorchRec trainer: one run, launched with torchrun.

    Every rank writes ``trace-rank<N>.jsonl`` (the seven start-up stages, c10d ops, process
    groups, store operations, time to first batch from process start) to ``out``;
    ``python -m benchmarks.ttfb`` runs this component for stock and fastinit, repeatedly, and
    reports. On one host the rendezvous and the process group stay on 127.0.0.1 (a free port is
    chosen by torchrun).

    Args:
        mode: "stock" (collective_plan + DistributedModelParallel, stages in sequence),
            "stock-best" (stock with a shared Inductor directory, compile artifacts and the
            previous run's plan, all in cache_dir) or "fastinit" (fastinit.setup, concurrent
            stages, plan and compile caches in cache_dir)
        model: reference model: tiny, small (26 tables), medium (256), large (1,024), ckpt (8
            tables of 1M rows: 1 GB of state per rank on 2 ranks)
        cache: scenario label: cold, new-hosts, same-hosts or recover (the caller arranges the
            caches, and for recover the fault: benchmarks/ttfb/faults.py)
        out: directory for the per-rank trace files
        cache_dir: the mode's shared storage (fastinit, stock-best); none: nothing kept
        data_dir: root of the generated synthetic Criteo-style datasets
        nproc: trainer processes per host (GPUs per host on a GPU machine)
        nnodes: hosts
        batch_size: samples per batch and rank
        num_workers: DataLoader worker processes per rank
        no_compile: run the dense arch eagerly (only to keep tests fast)
        steps: training steps in all (the first batch is the first)
        checkpoint_dir: checkpoints (``step-<K>/``, ``latest``); a committed one is resumed from
        checkpoint_step: save a checkpoint after this step (0: never)
        checkpoint_every: also save after every this many steps (0: never)
        checkpointer: "mode" (the mode's own checkpoints) or "torch-checkpointing"
        max_restarts: torchrun's ``--max-restarts``: worker-group restarts after a failure
        gpu: GPUs per host requested from the scheduler
        cpu: CPUs per host requested from the scheduler
        memMB: memory per host requested from the scheduler, in MB
        image: container image (the working directory for local_cwd)
        rdzv_port: rendezvous port on the first host when nnodes > 1
        env: extra environment variables (e.g. TORCHINDUCTOR_CACHE_DIR=/tmp/x)

    Returns:
        The AppDef: one role of ``nnodes`` replicas running torchrun.
    """
    args = trainer_args(
        mode,
        model,
        cache,
        out,
        cache_dir,
        data_dir,
        batch_size,
        num_workers,
        no_compile,
        steps,
        checkpoint_dir,
        checkpoint_step,
        checkpoint_every,
        checkpointer,
    )
    job_env = {"LOGLEVEL": "WARNING", **(env or {})}
    if nnodes == 1:
        job_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    entry = trainer_entry(mode)
    app = dist.ddp(
        *entry[1:],
        *args,
        m=entry[0],
        image=image,
        name=f"ttfb-{mode}-{model}",
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=f"{nnodes}x{nproc}",
        env=job_env,
        rdzv_port=rdzv_port,
    )
    if max_restarts:
        role = app.roles[0]
        role.args = [
            a.replace("torchrun ", f"torchrun --max_restarts {max_restarts} ", 1) for a in role.args
        ]
    if nnodes == 1:
        # One host: rendezvous and store on the loopback address only, free port.
        role = app.roles[0]
        role.args = [
            a.replace(
                "--rdzv_endpoint localhost:0",
                "--rdzv_endpoint 127.0.0.1:0 --local_addr 127.0.0.1",
            )
            for a in role.args
        ]
    return app
