"""The reference trainer of the time-to-first-batch benchmark: stock TorchRec or fastinit.

    torchrun --nproc-per-node 2 -m benchmarks.ttfb.trainer --mode fastinit --model small --out DIR

Every rank starts a :class:`fastinit.trace.Tracer` (comm counting on) as soon as torch is
imported, runs the seven start-up stages Meta names as spans — ``device_init``,
``process_group_init``, ``preproc_creation``, ``train_module_creation``, ``init_plugins``,
``pre_train``, ``get_first_batch_data`` — then one training step (``first_step``: the first
``TrainPipelineSparseDist.progress``), and writes ``trace-rank<N>.jsonl`` to ``--out``.
Time to first batch is measured per rank from the *process start* (``/proc/self/stat``) to the
moment that first ``progress`` returns; a ``launch`` span covers interpreter start and
``import torch`` before the tracer could start.

* ``--mode stock``: the stages in sequence; ``collective_plan`` with TorchRec's
  ``EmbeddingShardingPlanner`` and ``DistributedModelParallel``
  (:func:`fastinit.testing.stock.stock_setup`); the dense arch is compiled lazily by the first
  step; no cache of ours (Inductor's own local cache is whatever ``TORCHINDUCTOR_CACHE_DIR`` holds).
* ``--mode stock-best``: stock TorchRec as a careful user sets it up: the same stages, with
  ``TORCHINDUCTOR_CACHE_DIR`` on shared storage (the driver points it at ``--cache-dir``),
  :func:`torch.compiler.load_cache_artifacts` of the previous run's
  :func:`torch.compiler.save_cache_artifacts` before the first compile, and the previous run's
  plan (``torch.save``-d to ``--cache-dir``) passed as ``plan=`` instead of planning again.
* ``--mode fastinit``: a :class:`fastinit.warmup.StageGraph`: the data pipeline starts
  (``preproc_creation``, once the imports are done) and produces the real first batch while the
  model is sharded by :func:`fastinit.setup` (plan cache); ``pre_train`` restores the compile
  cache and, where the host has a spare core per rank (``--warmup auto``), compiles the model on
  a synthetic fast batch without changing any state; otherwise the first step compiles, as in
  stock, and no extra step is paid.
* ``--mode fastinit --fastinit-parts setup``: only the one-line change: stock's trainer (the
  stages in sequence, the dense arch compiled lazily by the first step, no cache of ours) with
  ``DistributedModelParallel`` replaced by :func:`fastinit.setup` without a plan cache (rank 0
  plans at every start); ``--fastinit-parts plan-cache``: the same with the plan cache in
  ``--cache-dir`` (what :mod:`benchmarks.parts` measures part by part).

After a failure (``--checkpoint-dir`` holding a committed checkpoint: the ``recover`` scenario,
under torchrun ``--max-restarts``), every mode resumes before its first step: a ``resume`` span
loads the checkpoint the mode's way (:mod:`benchmarks.ttfb.recovery`; in fastinit mode a stage beside
the data pipeline) and the data skips to the checkpoint's step. ``--steps`` trains that many
steps in all (the first batch is still the first ``progress``), ``--checkpoint-step K`` saves
after step K; :func:`benchmarks.ttfb.faults.after_step` runs after every step (it kills a rank only
where the environment arms it). The trace's ``bench`` record carries every step's loss.

Real parts (the same in every mode): DataLoader worker processes, forked once the trainer has
imported torch and TorchRec (``--worker-start fork``, Linux's default; ``spawn`` re-imports torch
in every worker) reading a synthetic Criteo-style dataset from files
(:mod:`benchmarks.ttfb.data`), a compiled dense + over arch, a fused embedding optimizer
(EXACT_ROWWISE_ADAGRAD in the TBE kernels), a dense Adagrad, ``TrainPipelineSparseDist``.

The process group: stock and stock-best make it as ``init_process_group`` does on
``env://`` (torch's rendezvous, the ``default_pg`` prefix: after a restart under torchrun on the
agent's shared store they read what the dead attempt left, as a stock trainer does;
``patches/torch``; the driver's ``--stock-restart store-per-round``, its default, launches their
restarts with torch's workaround, a new store every round); fastinit mode calls :func:`fastinit.init_process_group` (this restart round's keys only). Either
way the tracer wraps the store, so every store operation counts.
"""

from __future__ import annotations

import time

_T_IMPORT = time.time()  # before anything heavy: the fallback process start

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

__all__ = [
    "MODES",
    "FASTINIT_PARTS",
    "STAGES",
    "FASTINIT_AFTER",
    "FASTINIT_DEPS",
    "MODELS",
    "TrainerConfig",
    "process_start_time",
    "model_spec",
    "unsharded_model",
    "main",
]

#: Trainer modes: stock TorchRec, stock as a careful user sets it up, fastinit.
MODES: tuple[str, ...] = ("stock", "stock-best", "fastinit")

#: ``--fastinit-parts``: the whole of fastinit, or its set-up with and without the plan cache.
FASTINIT_PARTS: tuple[str, ...] = ("all", "plan-cache", "setup")

#: Files stock-best keeps on shared storage (in ``--cache-dir``).
STOCK_BEST_PLAN = "plan.pt"
STOCK_BEST_ARTIFACTS = "compile-artifacts.bin"

#: The seven start-up stages, in the order a sequential trainer runs them.
STAGES: tuple[str, ...] = (
    "device_init",
    "process_group_init",
    "preproc_creation",
    "train_module_creation",
    "init_plugins",
    "pre_train",
    "get_first_batch_data",
)

#: What each stage waits for in fastinit mode (the stage graph); ``first_step`` waits for all.
FASTINIT_DEPS: dict[str, tuple[str, ...]] = {
    "device_init": (),
    "process_group_init": ("device_init",),
    "preproc_creation": ("device_init",),  # workers are forked once torch is imported
    "train_module_creation": ("process_group_init",),
    "init_plugins": ("train_module_creation",),
    "pre_train": ("train_module_creation",),
    "get_first_batch_data": ("preproc_creation",),
}

#: Ordering without passing results. The DataLoader workers are forked (``preproc_creation``)
#: before any other stage starts: a fork while another thread holds a lock (the import lock during
#: ``fastinit.setup``'s lazy imports, say) leaves the child blocked on it forever, and the first
#: batch never comes. Once forked, the workers produce the first batch beside the sharding.
FASTINIT_AFTER: dict[str, tuple[str, ...]] = {"process_group_init": ("preproc_creation",)}

#: Reference models: (EmbeddingBagCollection tables, EmbeddingCollection tables, rows).
MODELS: dict[str, tuple[int, int, int]] = {
    "tiny": (3, 1, 100),
    "small": (20, 6, 2000),
    "medium": (192, 64, 2000),
    "large": (768, 256, 2000),
    # the checkpoint-heavy scenario's model: 8 tables of ~1M rows x 64 fp32 (+ the row-wise
    # Adagrad state), 2.1 GB in all: 1 GB per rank on 2 ranks (benchmarks/ttfb/heavy.py)
    "ckpt": (8, 0, 1_000_000),
}

#: Embedding dims of a model where they are not :class:`fastinit.testing.models.ModelSpec`'s.
MODEL_DIMS: dict[str, tuple[int, ...]] = {"ckpt": (64,)}

#: The scenario labels (the driver arranges the caches; "recover" also the fault and checkpoints).
CACHES: tuple[str, ...] = ("cold", "new-hosts", "same-hosts", "recover")

#: The compiled part of the model: its dense arch and over arch.
COMPILE_TARGETS: tuple[str, ...] = ("dense_arch", "over_arch")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """One trainer run."""

    mode: str = "fastinit"
    """One of :data:`MODES`."""
    model: str = "small"
    """A key of :data:`MODELS`."""
    cache: str = "cold"
    """The scenario label ("cold", "new-hosts", "same-hosts"); the driver arranges the caches."""
    out: str = "bench-out/run"
    """Where ``trace-rank<N>.jsonl`` goes."""
    cache_dir: str | None = None
    """The mode's directory on shared storage: fastinit's cache root (``plan/``, ``compile/``);
    stock-best's saved plan and compile artifacts; None: none (stock)."""
    data_dir: str = "bench-out/data"
    """Root of the generated datasets."""
    batch_size: int = 256
    """Samples per batch and rank."""
    num_workers: int = 1
    """DataLoader worker processes per rank."""
    worker_start: str = "fork"
    """How DataLoader workers start: "fork" (after the imports; Linux's default) or "spawn"."""
    compile: bool = True
    """torch.compile the dense + over arch (off only to keep tests fast)."""
    warmup: str = "auto"
    """fastinit's pre_train: "fast-batch" (compile and run forward/backward on a synthetic batch,
    state restored, beside the data pipeline), "none" (the first step compiles, as stock), or
    "auto": the fast-batch warm-up only where the host has a spare core per rank to overlap it
    with (on a host with a core per rank it is an extra step on the critical path)."""
    precompile: bool = True
    """fastinit: compile the targets ahead of time and keep that form in the compile cache, so a
    warm restart's first step runs without a Dynamo trace (:mod:`fastinit.warmup.precompile`)."""
    compile_in_background: bool = False
    """fastinit: compile nothing before the first step; the targets compile ahead of time on a
    thread from their first call while the steps run eager, and are swapped in at the first step
    boundary after they are done (:attr:`fastinit.warmup.WarmupConfig.compile_in_background`)."""
    compile_prefetch: str = "auto"
    """fastinit: import the compile stack and probe the CPU ISA on a stage thread beside the
    sharding (:func:`fastinit.warmup.prefetch_compiler`): "on", "off", or "auto": on only where
    the host has a spare core per rank (with a core per rank the imports, Python-bound, only
    contend with the sharding for the same core)."""
    pipeline_fill: str = "first-step"
    """fastinit: where TorchRec's ``TrainPipelineSparseDist.fill_pipeline`` runs (the first two
    batches, the model rewrite — a ``torch.fx`` trace — and the first batch's input distribution):
    "first-step" (inside the first ``progress``, as in every TorchRec trainer) or "startup" (the
    last start-up stage, after ``pre_train`` on the collective lane: the first ``progress`` is
    then a steady-state step; an experiment, see docs/warmup.md)."""
    fastinit_parts: str = "all"
    """fastinit: which parts of fastinit the trainer uses: "all" (the stage graph, the plan
    cache, the warm-up and the compile cache), "plan-cache" (stock's sequential trainer with
    ``fastinit.setup`` and its plan cache) or "setup" (the one-line change alone: stock's
    trainer with ``fastinit.setup``, no plan cache)."""
    fast_batch_size: int = 8
    """Samples in fastinit's synthetic warm-up batch (the compiled graphs have a dynamic batch
    dimension: the first step compiles nothing more, ``first_step_graphs`` in the trace)."""
    pg_timeout_s: float = 1800.0
    """Process-group and store timeout."""
    steps: int = 1
    """Training steps of the job in all, counted from step 1 (a resumed job goes on from its
    checkpoint's step)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (``step-<K>/`` and ``latest``); a committed one found at start is
    resumed from."""
    checkpoint_step: int = 0
    """Save a checkpoint after this step (0: never)."""
    checkpoint_every: int = 0
    """Also save after every this many steps (0: never; the checkpoint-heavy scenario)."""
    checkpointer: str = "mode"
    """How checkpoints are saved and loaded: "mode" (the mode's own way) or
    "torch-checkpointing" (torch_checkpointing 0.1.1; :mod:`benchmarks.ttfb.recovery`)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "stock-best" and not self.cache_dir:
            raise ValueError("stock-best needs --cache-dir (its shared storage)")
        if self.warmup not in ("auto", "fast-batch", "none"):
            raise ValueError(f"warmup must be auto, fast-batch or none, got {self.warmup!r}")
        if self.compile_prefetch not in ("auto", "on", "off"):
            raise ValueError(
                f"compile_prefetch must be auto, on or off, got {self.compile_prefetch!r}"
            )
        if self.pipeline_fill not in ("first-step", "startup"):
            raise ValueError(
                f"pipeline_fill must be first-step or startup, got {self.pipeline_fill!r}"
            )
        if self.fastinit_parts not in FASTINIT_PARTS:
            raise ValueError(
                f"fastinit_parts must be one of {FASTINIT_PARTS}, got {self.fastinit_parts!r}"
            )
        if self.fastinit_parts != "all" and self.mode != "fastinit":
            raise ValueError("fastinit_parts other than 'all' needs mode fastinit")
        if self.worker_start not in ("fork", "spawn"):
            raise ValueError(f"worker_start must be fork or spawn, got {self.worker_start!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        if self.cache not in CACHES:
            raise ValueError(f"unknown cache scenario {self.cache!r}")
        if self.steps < 1 or self.checkpoint_step < 0:
            raise ValueError("steps must be >= 1 and checkpoint_step >= 0")
        if (self.checkpoint_step or self.checkpoint_every) and not self.checkpoint_dir:
            raise ValueError("checkpoint_step and checkpoint_every need checkpoint_dir")
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        from benchmarks.ttfb.recovery import CHECKPOINTERS

        if self.checkpointer not in CHECKPOINTERS:
            raise ValueError(
                f"checkpointer must be one of {CHECKPOINTERS}, got {self.checkpointer!r}"
            )
        if self.checkpointer != "mode" and self.mode == "fastinit":
            raise ValueError("fastinit mode saves with fastinit.checkpoint (checkpointer 'mode')")


def process_start_time() -> float:
    """This process's start as a Unix time (``/proc/self/stat`` start time against
    ``/proc/uptime``, 10 ms resolution); the import time of this module where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        ticks = os.sysconf("SC_CLK_TCK")
        # Field 22 (starttime), counted after the parenthesised command name.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return now - uptime + start_ticks / ticks
    except (OSError, ValueError, IndexError):
        return _T_IMPORT


def model_spec(name: str) -> Any:
    """The :class:`fastinit.testing.models.ModelSpec` of a reference model."""
    from fastinit.testing.models import ModelSpec

    ebc, ec, rows = MODELS[name]
    dims = {"dims": MODEL_DIMS[name]} if name in MODEL_DIMS else {}
    return ModelSpec(num_tables=ebc, num_ec_tables=ec, rows=rows, pooling=2.0, **dims)


def unsharded_model(model: str = "small") -> Any:
    """A reference model unsharded on the CPU, the factory ``fastinit publish`` takes for the
    trainer's checkpoints: ``fastinit publish CKPT --out DIR --model
    benchmarks.ttfb.trainer:unsharded_model -a model=medium``."""
    from fastinit.testing.models import build_model

    return build_model(model_spec(model), device="cpu")


class _Trainer:
    """The stages, as methods; state lives on the instance."""

    def __init__(self, config: TrainerConfig, tracer: Any) -> None:
        self.config = config
        self.tracer = tracer
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.spec: Any = None
        self.info: dict[str, Any] = {}
        self.compile_cache: Any = None
        self.plan: Any = None
        self.model: Any = None
        self.optimizer: Any = None
        from benchmarks.ttfb.recovery import latest

        #: (path, step) of the checkpoint to resume from, or None.
        self.resume_from = latest(config.checkpoint_dir, config.mode, config.checkpointer)

    @property
    def _full_fastinit(self) -> bool:
        """fastinit mode with every part (the stage graph, warm-up and compile cache)."""
        return self.config.mode == "fastinit" and self.config.fastinit_parts == "all"

    # -- the seven stages ----------------------------------------------------------------------

    def device_init(self) -> Any:
        import torch
        import torchrec  # noqa: F401 - loading the library is part of the trainer's init

        self.spec = model_spec(self.config.model)
        if torch.cuda.is_available():
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            torch.cuda.init()
        else:
            device = torch.device("cpu")
        if self.config.mode == "stock-best":
            self._load_compile_artifacts()
        return device

    def _load_compile_artifacts(self) -> None:
        """stock-best: unpack the previous run's compile artifacts before anything compiles."""
        import torch

        path = os.path.join(str(self.config.cache_dir), STOCK_BEST_ARTIFACTS)
        if not os.path.exists(path):
            self.info["compile_artifacts"] = "none"
            return
        with open(path, "rb") as f:
            data = f.read()
        loaded = torch.compiler.load_cache_artifacts(data)
        self.info["compile_artifacts"] = "loaded" if loaded is not None else "rejected"

    def process_group_init(self, device: Any) -> Any:
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=self.config.pg_timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if device.type == "cuda" else None
        if self.config.mode == "fastinit":
            import fastinit

            # Under torchrun, this restart round's keys only (the tracer counts its store ops).
            fastinit.init_process_group(backend, timeout=timeout, device_id=device_id)
            return device
        # stock, stock-best: what init_process_group does on env://, key for key (torch's own
        # rendezvous and its "default_pg" prefix), with the store counted by the tracer.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore("default_pg", self.tracer.wrap_store(store))
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
        return device

    def preproc_creation(self) -> Any:
        from benchmarks.ttfb.data import DataConfig, DatasetConfig, ensure_dataset, make_loader

        spec = model_spec(self.config.model)
        path = ensure_dataset(DatasetConfig(spec=spec), self.config.data_dir)
        loader = make_loader(
            path,
            spec,
            DataConfig(
                batch_size=self.config.batch_size,
                num_workers=self.config.num_workers,
                context=self.config.worker_start,
            ),
            rank=self.rank,
            world_size=self.world_size,
            # the batches up to the checkpoint's step were trained: the data resumes after them
            start=self.resume_from[1] if self.resume_from is not None else 0,
        )
        return iter(loader)  # starts the worker processes

    def train_module_creation(self, device: Any) -> tuple[Any, Any]:
        import torch
        import torch.distributed as dist
        from torchrec.distributed.comm import get_local_size
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from fastinit.testing.models import build_model

        module = build_model(self.spec, device="meta")
        sharders = _sharders()
        if self.config.mode in ("stock", "stock-best"):
            from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

            from fastinit.testing.stock import stock_setup

            ws = dist.get_world_size()
            planner = EmbeddingShardingPlanner(
                topology=Topology(
                    local_world_size=get_local_size(ws), world_size=ws, compute_device=device.type
                )
            )
            plan = self._saved_plan() if self.config.mode == "stock-best" else None
            model = stock_setup(
                module, plan=plan, device=device, planner=planner, sharders=sharders
            )
            self.plan = model.plan
        else:
            import fastinit

            plan_cache = (
                os.path.join(self.config.cache_dir, "plan")
                if self.config.cache_dir and self.config.fastinit_parts != "setup"
                else None
            )
            # A resume fills every sharded table from the checkpoint: their random values would
            # be thrown away (fastinit.tables); fastinit's load takes them off the list.
            resuming = self.resume_from is not None and self.config.checkpointer == "mode"
            model = fastinit.setup(
                module,
                device=device,
                sharders=sharders,
                plan_cache=plan_cache,
                seed=0,
                init_tables=not resuming,
            )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=0.02),
        )
        optimizer = CombinedOptimizer([model.fused_optimizer, dense])
        if self.config.compile and not self._full_fastinit:
            from fastinit.warmup import CompileConfig, compile_modules

            compile_modules(model, CompileConfig(targets=COMPILE_TARGETS))  # compiles lazily
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def _saved_plan(self) -> Any:
        """stock-best: the plan the previous run saved (``torch.save``), or None."""
        import torch

        path = os.path.join(str(self.config.cache_dir), STOCK_BEST_PLAN)
        if not os.path.exists(path):
            self.info["saved_plan"] = "none"
            return None
        plan = torch.load(path, weights_only=False)
        self.info["saved_plan"] = "loaded"
        return plan

    def save_for_next_run(self) -> None:
        """stock-best, after the first batch: keep the plan and the compile artifacts on shared
        storage for the next job (one writer per host; atomic)."""
        import torch

        root = str(self.config.cache_dir)
        os.makedirs(root, exist_ok=True)
        if self.rank == 0 and self.info.get("saved_plan") != "loaded":
            _atomic(os.path.join(root, STOCK_BEST_PLAN), lambda f: torch.save(self.plan, f))
        if self.local_rank == 0 and self.config.compile:
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None and self.info.get("compile_artifacts") != "loaded":
                data, _ = saved
                _atomic(os.path.join(root, STOCK_BEST_ARTIFACTS), lambda f: f.write(data))

    def resume(self, built: tuple[Any, Any]) -> tuple[Any, Any]:
        """Load the checkpoint found at start into the model and optimizer, the mode's way."""
        from benchmarks.ttfb.recovery import load

        model, optimizer = built
        if self.resume_from is not None:
            path, step = self.resume_from
            loaded = load(self.config.mode, path, model, optimizer, self.config.checkpointer)
            self.info["resume_how"] = loaded.pop("how")
            self.info["resume_read"] = loaded
            self.info["resumed_from_step"] = step
        return built

    def saves_checkpoints(self) -> bool:
        """Whether this run saves checkpoints."""
        c = self.config
        return bool(c.checkpoint_dir and (c.checkpoint_step or c.checkpoint_every))

    def checkpoint_prepare(self, built: tuple[Any, Any]) -> None:
        """fastinit: :func:`fastinit.checkpoint.prepare` (the staging buffers, allocated on a
        thread of their own, and the writer process)."""
        from fastinit import checkpoint

        model, optimizer = built
        checkpoint.prepare(model, {"optim": optimizer}, background=True)

    def init_plugins(self, built: tuple[Any, Any]) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        model, optimizer = built
        device = next(iter(model.parameters())).device
        if device.type == "meta":
            device = _device_of_env()
        os.makedirs(os.path.join(self.config.out, "checkpoints"), exist_ok=True)
        return TrainPipelineSparseDist(model, optimizer, device)

    def pre_train(self, built: tuple[Any, Any]) -> Any:
        model, optimizer = built
        model.train()
        if not self._full_fastinit:
            return None
        import torch

        from fastinit.testing.models import make_batch
        from fastinit.warmup import (
            CompileCache,
            CompileCacheConfig,
            CompileConfig,
            WarmupConfig,
            compile_modules,
            fast_batch,
            schema_from_batch,
            warm_up,
        )

        compile_config = (
            CompileConfig(targets=COMPILE_TARGETS, precompile=self.config.precompile)
            if self.config.compile
            else None
        )
        if compile_config is not None and self.config.cache_dir:
            self.compile_cache = CompileCache.for_targets(
                model,
                compile_config,
                CompileCacheConfig(
                    directory=os.path.join(self.config.cache_dir, "compile"),
                    device=_device_of_env().type,
                ),
            )
            restored = self.compile_cache.restore()
            self.info["compile_cache"] = restored.status
            self.info["compile_cache_restore_s"] = restored.seconds
            self.info["precompiled_found"] = restored.precompiled
            self.info["vec_isa"] = restored.vec_isa
        if compile_config is not None and self.config.compile_in_background:
            self.info["warmup"] = "background"
            background = dataclasses.replace(compile_config, precompile=True, background=True)
            compile_modules(model, background, self.compile_cache)
            return None
        warmup = self.config.warmup
        if warmup == "auto":
            warmup = "fast-batch" if _cores_per_rank() >= 2 else "none"
        self.info["warmup"] = warmup
        if warmup == "none" or compile_config is None:
            # Nothing to overlap the compilation with: let the first step compile (from the
            # compile cache's Inductor directory when it hit) instead of paying an extra step.
            if compile_config is not None:
                compile_modules(model, compile_config, self.compile_cache)
            return None
        device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else None
        # The warm-up batch has the form of the pipeline's batches (this trainer's Batch type,
        # its feature order): TorchRec fixes its input layout from the first batch it sees.
        batch = fast_batch(
            schema_from_batch(make_batch(self.spec, 2), model),
            self.config.fast_batch_size,
            device or torch.device("cpu"),
        )
        report = warm_up(
            model,
            batch,
            optimizers=[optimizer],
            config=WarmupConfig(compile=compile_config),
            compile_cache=self.compile_cache,
        )
        self.info["warmup_graphs"] = report.graphs_compiled
        self.info["warmup_s"] = report.seconds
        return report

    def compile_prefetch(self, device: Any) -> None:
        """fastinit: the compile stack's one-off process costs, on a stage thread."""
        from fastinit.warmup import prefetch_compiler

        root = os.path.join(self.config.cache_dir, "compile") if self.config.cache_dir else None
        done = prefetch_compiler(cpu_inductor=device.type == "cpu", compile_cache=root)
        done.wait()
        self.info["compile_prefetch_s"] = done.seconds
        self.info["vec_isa_prefetch"] = done.vec_isa_record
        if done.error is not None:
            self.info["compile_prefetch_error"] = done.error

    def get_first_batch_data(self, it: Any) -> Any:
        return next(it)

    # -- the two modes -------------------------------------------------------------------------

    def run_stock(self) -> tuple[Any, _Recent]:
        from fastinit import trace

        def stage(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            with trace.span(name):
                return fn(*args)

        device = stage("device_init", self.device_init)
        stage("process_group_init", self.process_group_init, device)
        it = stage("preproc_creation", self.preproc_creation)
        built = stage("train_module_creation", self.train_module_creation, device)
        if self.resume_from is not None:
            stage("resume", self.resume, built)
        pipeline = stage("init_plugins", self.init_plugins, built)
        stage("pre_train", self.pre_train, built)
        first = stage("get_first_batch_data", self.get_first_batch_data, it)
        return pipeline, _Recent(itertools.chain([first], it))

    def run_fastinit(self) -> tuple[Any, _Recent]:
        from fastinit.warmup import GraphConfig, StageGraph

        collective = {"process_group_init", "train_module_creation", "pre_train"}
        graph = StageGraph(GraphConfig(max_workers=3, rank=self.rank))
        stages: dict[str, Callable[..., Any]] = {
            "device_init": self.device_init,
            "preproc_creation": lambda _device: self.preproc_creation(),
            "process_group_init": self.process_group_init,
            "get_first_batch_data": self.get_first_batch_data,
            "train_module_creation": self.train_module_creation,
            "init_plugins": self.init_plugins,
            "pre_train": self.pre_train,
        }
        deps = dict(FASTINIT_DEPS)
        after = dict(FASTINIT_AFTER)
        prefetch = self.config.compile_prefetch
        if prefetch == "auto":
            prefetch = "on" if _cores_per_rank() >= 2 else "off"
        self.info["compile_prefetch"] = prefetch
        if self.config.compile and prefetch == "on":
            # The compile stack's imports and CPU ISA probe (seconds, the same whatever is
            # compiled) beside the sharding, once the DataLoader workers are forked.
            order = list(stages)
            order.insert(order.index("get_first_batch_data") + 1, "compile_prefetch")
            stages = {n: self.compile_prefetch if n == "compile_prefetch" else stages[n]
                      for n in order}  # fmt: skip
            deps["compile_prefetch"] = ("device_init",)
            after["compile_prefetch"] = ("preproc_creation",)
            after["pre_train"] = ("compile_prefetch",)
        if self.resume_from is not None:
            # Beside the data pipeline, before the warm-up (which snapshots and restores the
            # state it runs on); on the collective lane: the load ends with its verdict (one
            # all_reduce).
            # (Stages are declared after what they depend on.)
            order = list(stages)
            order.insert(order.index("train_module_creation") + 1, "resume")
            stages = {n: self.resume if n == "resume" else stages[n] for n in order}
            deps["resume"] = ("train_module_creation",)
            deps["pre_train"] = ("resume",)
            collective.add("resume")
        if self.saves_checkpoints():
            # The staging buffers and the writer process ahead of the first save, beside
            # pre_train; the allocation (and the fill) runs on a thread of its own, so nothing
            # waits for it
            # (after the load: a restarted worker first reads its predecessor's buffers, then
            # adopts them).
            stages["checkpoint_prepare"] = self.checkpoint_prepare
            deps["checkpoint_prepare"] = (
                "resume" if self.resume_from is not None else "train_module_creation",
            )
        if self.config.pipeline_fill == "startup":
            # After pre_train on the collective lane (its input distribution is collective), so
            # no other stage runs while its torch.fx trace patches nn.Module process-wide.
            stages["pipeline_fill"] = self.pipeline_fill
            collective.add("pipeline_fill")
            deps["pipeline_fill"] = ("init_plugins", "preproc_creation", "get_first_batch_data")
            after["pipeline_fill"] = ("pre_train",)
        for name, fn in stages.items():
            graph.add(
                name,
                _on_device(fn),
                deps=deps[name],
                after=after.get(name, ()),
                collective=name in collective,
            )
        results = graph.run()
        if "pipeline_fill" in results:  # the iterator the fill started
            return results["init_plugins"], results["pipeline_fill"]
        first, it = results["get_first_batch_data"], results["preproc_creation"]
        return results["init_plugins"], _Recent(itertools.chain([first], it))

    def pipeline_fill(self, pipeline: Any, it: Any, first: Any) -> _Recent:
        """``--pipeline-fill startup``: TorchRec's pipeline fill before the first step; returns
        the data iterator the steps go on with (the fill took its first two batches)."""
        data = _Recent(itertools.chain([first], it))
        pipeline.fill_pipeline(data)
        return data


class _Recent:
    """The data iterator, remembering its last few batches by position (0: the first)."""

    def __init__(self, it: Any, keep: int = 4) -> None:
        self._it = it
        self._keep = keep
        self._recent: dict[int, Any] = {}
        self._n = 0

    def __iter__(self) -> _Recent:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._recent[self._n] = batch
        self._recent.pop(self._n - self._keep, None)
        self._n += 1
        return batch

    def batch(self, index: int) -> Any:
        return self._recent[index]


def _loss(out: Any) -> float:
    return float(out[0].detach().float()) if isinstance(out, tuple) else float("nan")


def _train_on(
    trainer: _Trainer,
    pipeline: Any,
    data: _Recent,
    first: int,
    losses: dict[int, float],
    last: Any,
) -> None:
    """After the first step (``first``): the checkpoint and fault hooks for it, then the other
    steps up to ``--steps``, each followed by the hooks; their losses go into ``losses`` and,
    after every step, to ``losses-a<attempt>-rank<N>.json`` in the trace directory (a killed
    attempt's losses survive it: the recover scenario compares them with the resumed ones).
    A run that saves checkpoints also appends every step's seconds, and whether a save was being
    written when it began, to ``steps-a<attempt>-rank<N>.jsonl``."""
    from benchmarks.ttfb import faults
    from benchmarks.ttfb.recovery import Saver
    from fastinit import trace

    config = trainer.config
    saver = (
        Saver(
            config.mode, str(config.checkpoint_dir), trainer.rank, config.out, config.checkpointer
        )
        if trainer.saves_checkpoints()
        else None
    )
    if saver is not None:
        saver.prepare(trainer.model, trainer.optimizer)
    every = config.checkpoint_every
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    record = os.path.join(config.out, f"losses-a{attempt}-rank{trainer.rank}.json")
    steps_log = (
        open(os.path.join(config.out, f"steps-a{attempt}-rank{trainer.rank}.jsonl"), "a")  # noqa: SIM115
        if saver is not None
        else None
    )
    step = first
    while True:
        if config.steps > 1:
            _atomic(record, lambda f: f.write(json.dumps(losses).encode()))
        if saver is not None and (step == config.checkpoint_step or (every and step % every == 0)):
            with trace.span("checkpoint_save", step=step):
                blocking = saver.save(step, trainer.model, trainer.optimizer)
            trainer.info["save"] = {"step": step, "blocking_s": blocking}
        if saver is not None and config.checkpoint_step and step == config.checkpoint_step + 1:
            # For `fastinit publish`: step K + 1's forward ran on the checkpoint's state.
            from fastinit.checkpoint import record_verification

            record_verification(
                os.path.join(str(config.checkpoint_dir), f"step-{config.checkpoint_step}"),
                data.batch(step - first),
                # The model's forward output: (loss, output); the pipeline returned output,
                # whose first element is the reference model's detached loss.
                (last[0], last),
                rank=trainer.rank,
            )
            with trace.span("checkpoint_wait", step=step):  # the save overlapped one step
                saver.wait()
        faults.after_step(step, trainer.rank)
        if step >= config.steps:
            break
        step += 1
        _swap(trainer, step)
        # "saving": this rank's part of a save was still being written when the step began.
        saving = saver is not None and saver.in_flight()
        t = time.perf_counter()
        with trace.span("step", step=step, saving=saving):
            last = pipeline.progress(data)
            losses[step] = _loss(last)
        if steps_log is not None:
            end = time.time()
            took = time.perf_counter() - t
            steps_log.write(json.dumps({"step": step, "s": took, "end": end, "saving": saving}))
            steps_log.write("\n")
            steps_log.flush()
    if saver is not None:
        saver.close()
    if steps_log is not None:
        steps_log.close()


def _warm_copy(model: Any, optimizer: Any, repeats: int = 3) -> dict[str, Any]:
    """After training: a copy of this rank's state (the bytes a save stages) into buffers
    allocated and touched once, timed ``repeats`` times: the limit a save's blocking is set
    against (:mod:`benchmarks.checkpoint_blocking.limits`)."""
    from benchmarks.checkpoint_blocking.anchors import local_tensors, nbytes
    from benchmarks.checkpoint_blocking.limits import WarmCopy

    tensors = local_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()})
    warm = WarmCopy(list(tensors.values()))
    seconds = [warm.run() for _ in range(repeats)]
    warm.close()
    return {"bytes": nbytes(tensors), "seconds": seconds}


def _swap(trainer: _Trainer, step: int) -> None:
    """--compile-in-background: at the step boundary before ``step``, swap in the targets whose
    compile is done (no wait); the first step each one serves is recorded (``swapped_at``)."""
    if not (trainer.config.compile_in_background and trainer.config.mode == "fastinit"):
        return
    done = trainer.info.setdefault("swapped_at", {})
    if len(done) == len(COMPILE_TARGETS):
        return
    from fastinit.warmup import swap_in_compiled

    for path in swap_in_compiled(trainer.model, wait=0.0):
        done.setdefault(path, step)


def _on_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with this rank's CUDA device current in the calling thread (the current device
    is per thread; stage threads start on device 0)."""

    def run(*args: Any) -> Any:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return fn(*args)

    return run


def _cores_per_rank() -> float:
    """CPU cores this process may use, per rank on this host."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _atomic(path: str, write: Callable[[Any], Any]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def _device_of_env() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sharders() -> list[Any]:
    """TorchRec's EBC and EC sharders with a fused EXACT_ROWWISE_ADAGRAD embedding optimizer."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02}
    return [
        EmbeddingBagCollectionSharder(fused_params=dict(fused)),
        EmbeddingCollectionSharder(fused_params=dict(fused)),
    ]


def _versions() -> dict[str, str]:
    import platform

    import torch

    import fastinit

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastinit": fastinit.__version__,
    }
    for name in ("torchrec", "fbgemm_gpu", "torchx"):
        try:
            module = __import__(name)
            out[name] = str(getattr(module, "__version__", "?"))
        except Exception:  # noqa: BLE001 - a version we cannot read is reported as such
            out[name] = "unavailable"
    return out


def run(config: TrainerConfig) -> dict[str, Any]:
    """Run one rank to its first batch; returns (and records) the rank's summary."""
    t_start = process_start_time()
    import resource

    import torch  # the import is part of "launch"

    from fastinit import trace

    tracer = trace.Tracer(out_dir=config.out, comm=True).start()
    t_tracer = time.time()
    tracer.record(
        {
            "kind": "span",
            "name": "launch",
            "ts": t_start * 1e6,
            "dur": (t_tracer - t_start) * 1e6,
            "tid": 0,
            "thread": "MainThread",
        }
    )
    tracer.mark("process_start", at=t_start)
    trainer = _Trainer(config, tracer)
    if config.mode == "fastinit":
        trainer.info["fastinit_parts"] = config.fastinit_parts
    if trainer._full_fastinit:
        pipeline, data = trainer.run_fastinit()
    else:
        pipeline, data = trainer.run_stock()
    if torch.cuda.is_available():  # the first step runs on this thread
        torch.cuda.set_device(trainer.local_rank)
    from fastinit.warmup import compile_count

    graphs_before = compile_count()
    step = trainer.resume_from[1] + 1 if trainer.resume_from is not None else 1
    _swap(trainer, step)
    with trace.span("first_step"):
        out = pipeline.progress(data)
    t_first = time.time()
    tracer.mark("first_batch")
    loss = _loss(out)
    losses = {step: loss}
    summary: dict[str, Any] = {
        "kind": "bench",
        "rank": trainer.rank,
        "world_size": trainer.world_size,
        "local_rank": trainer.local_rank,
        "mode": config.mode,
        "model": config.model,
        "cache": config.cache,
        "process_start": t_start,
        "tracer_start": t_tracer,
        "first_batch": t_first,
        "ttfb_s": t_first - t_start,
        "first_step_graphs": compile_count() - graphs_before,
        "graphs_total": compile_count(),
        "loss": loss,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "versions": _versions(),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "device": str(_device_of_env()),
        "backend": str(torch.distributed.get_backend()),
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        **trainer.info,
    }
    # After the measurement: keep the compiled artifacts for the next job (one writer per host).
    if trainer.compile_cache is not None:
        # "hit" only once Inductor served graphs from the restored entry (after the first step).
        confirmed = trainer.compile_cache.confirm()
        if confirmed is not None:
            trainer.info["compile_cache"] = confirmed.status
            summary["compile_cache"] = confirmed.status
            summary["precompiled_served"] = confirmed.precompiled_served
        if trainer.local_rank == 0 and trainer.info.get("compile_cache") != "hit":
            with trace.span("compile_cache_save"):
                summary["compile_cache_saved"] = trainer.compile_cache.save()
        trainer.compile_cache.close()
    if config.mode == "stock-best":
        with trace.span("save_for_next_run"):
            trainer.save_for_next_run()
    _train_on(trainer, pipeline, data, step, losses, out)
    summary["losses"] = {str(k): v for k, v in sorted(losses.items())}
    if config.mode == "fastinit" and trainer.saves_checkpoints():
        from fastinit.checkpoint.saving import staging_info

        info = staging_info()
        summary["staging"] = {k: info[k] for k in ("writer", "allocated_s", "allocated_bytes")}
    if trainer.saves_checkpoints():
        summary["warm_copy"] = _warm_copy(trainer.model, trainer.optimizer)
    summary.update({k: trainer.info[k] for k in ("resume_how", "resume_read", "resumed_from_step", "save", "swapped_at")
                    if k in trainer.info})  # fmt: skip
    tracer.record(summary)
    tracer.stop()
    return summary


def _parse(argv: list[str] | None) -> TrainerConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="fastinit")
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--cache", choices=CACHES, default="cold", help="label")
    parser.add_argument("--out", default="bench-out/run", help="per-rank trace directory")
    parser.add_argument(
        "--cache-dir", default=None, help="the mode's shared storage (fastinit, stock-best)"
    )
    parser.add_argument("--data-dir", default="bench-out/data", help="dataset root")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--worker-start", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--warmup", choices=("auto", "fast-batch", "none"), default="auto")
    parser.add_argument("--no-compile", action="store_true", help="eager dense arch (tests)")
    parser.add_argument(
        "--compile-in-background",
        action="store_true",
        help="fastinit: train eager while the targets compile on a thread, then swap them in",
    )
    parser.add_argument(
        "--compile-prefetch",
        choices=("auto", "on", "off"),
        default="auto",
        help="fastinit: compile-stack imports on a thread beside the sharding",
    )
    parser.add_argument(
        "--pipeline-fill",
        choices=("first-step", "startup"),
        default="first-step",
        help="fastinit: TorchRec's pipeline fill in the first step, or as the last start-up stage",
    )
    parser.add_argument(
        "--fastinit-parts",
        choices=FASTINIT_PARTS,
        default="all",
        help="fastinit: every part, or stock's trainer with fastinit.setup (+ its plan cache)",
    )
    parser.add_argument("--steps", type=int, default=1, help="training steps in all")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoints; resumed from")
    parser.add_argument("--checkpoint-step", type=int, default=0, help="save after this step")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also save after every N-th step"
    )
    parser.add_argument(
        "--checkpointer",
        choices=("mode", "torch-checkpointing"),
        default="mode",
        help="the mode's own checkpoints, or torch_checkpointing's (stock modes)",
    )
    parser.add_argument(
        "--no-precompile", action="store_true", help="fastinit: plain torch.compile, no AOT form"
    )
    args = parser.parse_args(argv)
    return TrainerConfig(
        mode=args.mode,
        model=args.model,
        cache=args.cache,
        out=args.out,
        cache_dir=args.cache_dir,
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        worker_start=args.worker_start,
        warmup=args.warmup,
        compile=not args.no_compile,
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_step=args.checkpoint_step,
        checkpoint_every=args.checkpoint_every,
        checkpointer=args.checkpointer,
        precompile=not args.no_precompile,
        compile_prefetch=args.compile_prefetch,
        compile_in_background=args.compile_in_background,
        pipeline_fill=args.pipeline_fill,
        fastinit_parts=args.fastinit_parts,
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point: run to the first batch, then leave at once (no teardown collectives)."""
    summary = run(_parse(argv))
    print(
        f"rank {summary['rank']}: {summary['mode']} {summary['model']} {summary['cache']} "
        f"first batch {summary['ttfb_s']:.2f} s after process start",
        flush=True,
    )
    exit_now()


def exit_now() -> None:
    """Flush, end the DataLoader workers (children), then skip interpreter teardown: torch's
    atexit hooks may wait on peers that already left."""
    import multiprocessing

    sys.stdout.flush()
    sys.stderr.flush()
    for child in multiprocessing.active_children():
        child.terminate()
    for child in multiprocessing.active_children():
        child.join(timeout=5)
    os._exit(0)


if __name__ == "__main__":
    main()
