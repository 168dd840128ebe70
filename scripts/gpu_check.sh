#!/usr/bin/env bash
# `make gpu-check`: fastinit's CUDA path on one GPU, in under 8 minutes once installed
# (`make env CUDA=1` first: torch 2.13.0 and fbgemm-gpu 1.8.0, CUDA builds).
#
# Writes bench-out/gpu-check/gpu_check.json; exits non-zero when any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${GPU_CHECK_OUT:-bench-out/gpu-check}
mkdir -p "$OUT"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu-check: no CUDA device (or a CPU build of torch: make env CUDA=1)")'

# 1. start-up protocol on NCCL, fastinit.setup, fbgemm CUDA kernels, one training step (~3 min).
timeout 240 "$PY" -m scripts.gpu_check --out "$OUT"

# 2. fastinit.warmup on CUDA: per-thread device, warm-up, the compile cache with Triton (~2 min).
timeout 150 "$PY" -m examples.gpu_check

# 3. The time-to-first-batch benchmark on NCCL: tiny model, every mode; fastinit's same-hosts
#    restart must run its compiled targets from their precompiled form, no Dynamo trace (~2 min).
timeout 120 "$PY" -m benchmarks.gpu_check

# 4. fastinit.checkpoint on CUDA shards: save(blocking=False) stages into pinned CPU memory,
#    writes in the background, commits; load back (same plan) bit-equal (~1 min).
timeout 180 "$PY" -m benchmarks.checkpoint_blocking --device cuda --check --rows 100000 \
  | tee "$OUT/checkpoint_blocking.json"
