# fastinit: two commands do all the set-up.
#   make test   lint, types and the test suite
#   make bench  the time-to-first-batch benchmark
# CUDA=1 installs the CUDA builds (torch 2.13.0, fbgemm-gpu 1.8.0) for GPU hosts.

SHELL := /bin/bash
PYTHON ?= python3
CUDA ?= 0
VENV := .venv
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

$(STAMP): requirements/$(FLAVOR).txt requirements/common.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.installed-*
	@# torch first, on its own, so that nothing later can swap in another build of it.
	$(PIP) install -q -r requirements/$(FLAVOR).txt \
	  || $(PIP) install -q -r requirements/$(FLAVOR).txt --extra-index-url $(TORCH_CPU_INDEX)
	$(PIP) install -q --no-deps torchrec==1.8.0
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

test: lint
	$(PY) -m pytest $(if $(filter 1,$(SLOW)),,-m "not slow") $(PYTEST_ARGS)

# Time to first batch: stock, stock-best, fastinit and the floor, 3 scenarios, repeated:
# bench-out/{summary.json,report.md,timeline.png,trace.json}. BENCH_ARGS="--models large --nproc 4".
bench: $(STAMP)
	$(PY) -m benchmarks.bench $(BENCH_ARGS)

# Leave scenario CACHE's caches in place for MODE (stock|stock-best|fastinit), MODEL and NPROC.
.PHONY: prime
prime: $(STAMP)
	$(PY) -m benchmarks.bench --prime $(MODE) $(MODEL) $(CACHE) $(NPROC)

# Exactly one run, starting in scenario CACHE's state (a restart scenario: after `make prime` with
# the same variables; CACHE=cold needs no prime); CACHE=recover: one job with a rank killed mid-job
# and resumed (time to recover).
ttfb: $(STAMP)
	$(PY) -m benchmarks.bench --one $(MODE) $(MODEL) $(CACHE) $(NPROC)

# Time to first batch projected to 1,024 and 4,096 ranks (SCALE_JSON=scale.json from `make scale`;
# RESUME_JSON=resume-scale.json from `make resume-scale` adds the time to recover).
projection: $(STAMP)
	$(PY) -m benchmarks.projection $(if $(SCALE_JSON),--scale-json $(SCALE_JSON)) $(if $(RESUME_JSON),--resume-json $(RESUME_JSON))

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
	$(PY) -m pytest benchmarks/micro --benchmark-only $(PYTEST_ARGS)

# TorchRec's own model-parallel tests, stock and with DistributedModelParallel swapped for
# fastinit.setup (docs/robustness.md). TORCHREC_SRC: a TorchRec source tree at the installed
# version (git archive v1.8.0-rc1 of TorchRec's repository); nothing is fetched. Output in peer-out/.
TORCHREC_SRC ?= $(FASTINIT_TORCHREC_SRC)
PEER_ARGS ?=
.PHONY: peer
peer: $(STAMP)
	$(PY) -m tools.peer --torchrec-src "$(TORCHREC_SRC)" $(PEER_ARGS)

# fastinit's CUDA path on one GPU (NCCL, fbgemm CUDA kernels, one training step): installs the
# CUDA builds first (CUDA=1), then scripts/gpu_check.sh; under 8 minutes once installed.
gpu-check:
	$(MAKE) env CUDA=1
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) bench-out .pytest_cache .mypy_cache .ruff_cache
