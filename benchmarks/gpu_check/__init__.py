"""``make gpu-check``: fastinit's CUDA path on one GPU, every GPU check in one place.

    python -m benchmarks.gpu_check [--out bench-out/gpu-check]

Runs, in order, each in its own process with a time limit (:data:`benchmarks.gpu_check.__main__.STEPS`):

1. :mod:`benchmarks.gpu_check.startup`: the start-up protocol on NCCL, ``fastinit.setup`` with
   fbgemm's CUDA kernels and one training step against stock, the replica check's cost on the GPU,
   a ``cpu:gloo,cuda:nccl`` group (``<out>/gpu_check.json``);
2. :mod:`benchmarks.gpu_check.warmup`: ``fastinit.warmup`` on CUDA: per-thread device, warm-up,
   the compile cache with Triton;
3. :mod:`benchmarks.gpu_check.ttfb`: the time-to-first-batch benchmark on NCCL, every mode, and
   the same-hosts restart running its compiled targets from their precompiled form;
4. :mod:`benchmarks.checkpoint_blocking` with ``--device cuda --check --max-vs-warm 2``:
   ``fastinit.checkpoint`` on CUDA shards, staged into the reused page-locked buffers, every save
   blocking at most twice a device-to-host copy of the same bytes into a warm page-locked
   buffer, loaded back bit-equal (``<out>/checkpoint_blocking.json``).

Each step also runs alone (``python -m benchmarks.gpu_check.startup`` ...).
"""
