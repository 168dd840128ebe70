# fastinit: two commands do all the set-up.
#   make test   lint, types and the test suite
#   make bench  the time-to-first-batch benchmark
# STACK picks the torch/fbgemm/TorchRec stack (versions in requirements/<STACK>/*.txt):
#   STACK=1.8 (default)  .venv      torch 2.13.0, fbgemm-gpu(-cpu) 1.8.0, torchrec 1.8.0
#   STACK=1.9            .venv-1.9  torch 2.14.1, fbgemm-gpu(-cpu) 1.9.0, torchrec 1.9.2
# `make test STACK=1.9` runs no lint (that runs once, on the default stack) and only the tests in
# STACK_TESTS_1.9 (the 1.9 lane of .ci/run). Any other target takes STACK too (make peer STACK=1.9).
# CUDA=1 installs the stack's CUDA builds (torch from PyPI, fbgemm-gpu) for GPU hosts.

SHELL := /bin/bash
PYTHON ?= python3
CUDA ?= 0
STACK ?= 1.8
ifeq ($(filter $(STACK),1.8 1.9),)
$(error STACK=$(STACK): use STACK=1.8 (the default) or STACK=1.9)
endif
VENV := $(if $(filter 1.8,$(STACK)),.venv,.venv-$(STACK))
REQ := requirements/$(STACK)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
FLAVOR := $(if $(filter 1,$(CUDA)),cuda,cpu)
STAMP := $(VENV)/.installed-$(FLAVOR)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
SLOW ?= 0
MODE ?= fastinit
MODEL ?= small
CACHE ?= cold
NPROC ?= 2
BENCH_ARGS ?=

.PHONY: test bench ttfb projection scale baseline micro lint env clean gpu-check peer

# The 1.9 lane: the start-up path end to end (setup/equivalence, seeding, protocol, planner
# identity, warm-up, plan cache and its TorchRec protocol, compat, the port registry and the
# ports compared with the installed release, nccl2-readiness) and the 1.9.2 patch series (its op
# counts and equivalence on 1.9.2), the CPU vector-ISA record, and a checkpoint crossing the two
# stacks both ways (it needs both environments: this lane runs after the default one), torchrun
# restarts (fastinit.init_process_group on torch 2.14's rendezvous), saves by touched rows (hooks
# on FBGEMM 1.9's table modules), tables left for a load (TorchRec 1.9's sharded modules); the rest
# of the suite runs on the default stack.
STACK_TESTS_1.9 := tests/startup/test_setup.py tests/startup/test_seeding.py \
  tests/startup/test_protocol.py tests/planner/test_planner.py tests/warmup/test_warmup.py \
  tests/warmup/test_warmup_api.py tests/plan/test_plan_cache.py \
  tests/plan/test_plan_cache_protocol.py tests/compat/test_compat.py \
  tests/plan/test_fingerprint.py tests/package/test_import.py tests/compat/test_ports.py \
  tests/compat/test_installed_release.py tests/startup/test_nccl_ready.py \
  tests/sharding/test_table_errors.py tests/tools/test_patches.py tests/warmup/test_vec_isa.py \
  tests/checkpoint/test_checkpoint_stacks.py tests/checkpoint/test_touched.py \
  tests/checkpoint/test_init_tables.py tests/pg/test_restart.py \
  tests/restart/test_restart_launcher.py
TESTS := $(if $(filter 1.8,$(STACK)),,$(STACK_TESTS_$(STACK)))

$(STAMP): $(REQ)/$(FLAVOR).txt $(REQ)/torchrec.txt requirements/common.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.installed-*
	@# torch first, on its own, so that nothing later can swap in another build of it.
	$(PIP) install -q -r $(REQ)/$(FLAVOR).txt \
	  || $(PIP) install -q -r $(REQ)/$(FLAVOR).txt --extra-index-url $(TORCH_CPU_INDEX)
	$(PIP) install -q --no-deps -r $(REQ)/torchrec.txt
	$(PIP) freeze | grep -iE '^(torch|fbgemm)' > $(VENV)/.pinned
	$(PIP) install -q -r requirements/common.txt -c $(VENV)/.pinned
	@# fastinit itself, editable and without dependencies (they are all above): `import fastinit`,
	@# the `fastinit` command and the torchx components then work from any directory.
	$(PIP) install -q --no-deps -e .
	@touch $@

env: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check fastinit tests benchmarks examples tools scripts
	$(VENV)/bin/ruff format --check fastinit tests benchmarks examples tools scripts
	$(VENV)/bin/mypy

test: $(if $(filter 1.8,$(STACK)),lint,$(STAMP))
	$(PY) -m pytest $(if $(filter 1,$(SLOW)),,-m "not slow") $(TESTS) $(PYTEST_ARGS)

# Time to first batch: stock, stock-best, fastinit and the floor, scenarios cold, new-hosts,
# same-hosts and recover (a rank killed and resumed: time to recover, stock-best vs fastinit), repeated,
# and the checkpoint-heavy scenario (benchmarks/ttfb/heavy.py; --heavy-repeats 0 in BENCH_ARGS: none):
# bench-out/{summary.json,report.md,timeline.png,trace.json}. BENCH_ARGS="--models large --nproc 4".
bench: $(STAMP)
	$(PY) -m benchmarks.ttfb --heavy-repeats 1 $(BENCH_ARGS)

# Leave scenario CACHE's caches in place for MODE (stock|stock-best|fastinit), MODEL and NPROC.
.PHONY: prime
prime: $(STAMP)
	$(PY) -m benchmarks.ttfb --prime $(MODE) $(MODEL) $(CACHE) $(NPROC)

# Exactly one run, starting in scenario CACHE's state (a restart scenario: after `make prime` with
# the same variables; CACHE=cold needs no prime); CACHE=recover: one job with a rank killed mid-job
# and resumed (time to recover).
ttfb: $(STAMP)
	$(PY) -m benchmarks.ttfb --one $(MODE) $(MODEL) $(CACHE) $(NPROC)

# Time to first batch projected to 1,024 and 4,096 ranks (SCALE_JSON=scale.json from `make scale`;
# RESUME_JSON=resume-scale.json from `make resume-scale` adds the time to recover).
projection: $(STAMP)
	$(PY) -m benchmarks.ttfb.projection $(if $(SCALE_JSON),--scale-json $(SCALE_JSON)) $(if $(RESUME_JSON),--resume-json $(RESUME_JSON))

# Per-rank setup seconds and peak RSS, stock vs fastinit, 64..8,192 ranks on the fake backend:
# benchmarks/results/scale/{scale.json,scale.md,scale.png}. SCALE_ARGS="--quick" for a smoke run.
SCALE_ARGS ?=
scale: $(STAMP)
	$(PY) -m benchmarks.scale $(SCALE_ARGS)

# One rank's checkpoint load at 64..8,192 ranks on the fake backend, fastinit (same plan, and
# resharded from N/2) against stock DCP's .metadata read + load planning:
# benchmarks/results/resume-scale/. RESUME_SCALE_ARGS="--quick" for a smoke run;
# "--model-factory mod:fn --plan-factory mod:fn" for a model and explicit plan of your own.
RESUME_SCALE_ARGS ?=
.PHONY: resume-scale
resume-scale: $(STAMP)
	$(PY) -m benchmarks.resume_scale $(RESUME_SCALE_ARGS)

# Stock TorchRec's start-up, per phase (counts and times).
baseline: $(STAMP)
	$(PY) -m benchmarks.baseline

# Micro-benchmarks (pytest-benchmark): codec, metadata, fingerprint, and the planner's hot paths at
# 4,096 tables x 4,096 ranks (FASTINIT_MICRO_TABLES/RANKS to change the size). A few minutes.
micro: $(STAMP)
	$(PY) -m benchmarks.micro $(PYTEST_ARGS)

# TorchRec's own model-parallel tests, stock and with DistributedModelParallel swapped for
# fastinit.setup (docs/robustness.md). TORCHREC_SRC: a TorchRec source tree (git archive
# v1.8.0-rc1 of TorchRec's repository for STACK=1.8, imported from the tree; for STACK=1.9 the
# newest commit there, 376cac6, whose tests run against the installed 1.9.2 and its test
# utilities: tools/peer/run.py); nothing is fetched. Output in peer-out/ (peer-out-1.9/).
# PEER_ARGS="--mode stock,patched": the suite on a copy of TorchRec with patches/torchrec's series.
TORCHREC_SRC ?= $(FASTINIT_TORCHREC_SRC)
PEER_ARGS ?=
PEER_FROM := $(if $(filter 1.8,$(STACK)),source,installed)
PEER_OUT := $(if $(filter 1.8,$(STACK)),peer-out,peer-out-$(STACK))
.PHONY: peer
peer: $(STAMP)
	$(PY) -m tools.peer --torchrec-src "$(TORCHREC_SRC)" --torchrec-from $(PEER_FROM) \
	  --out $(PEER_OUT) $(PEER_ARGS)

# fastinit's CUDA path on one GPU (NCCL, fbgemm CUDA kernels, one training step): installs the
# CUDA builds first (CUDA=1), then every check of benchmarks/gpu_check/; under 8 minutes once
# installed. Output in bench-out/gpu-check/.
gpu-check:
	$(MAKE) env CUDA=1
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf .venv .venv-1.9 bench-out .pytest_cache .mypy_cache .ruff_cache
