"""Init stages run concurrently, the fast batch, warm-up without side effects, compile cache.

``import fastinit.warmup`` loads neither torch nor torchrec: names are imported on first use.

* :class:`StageGraph` — start-up stages on threads, as soon as their inputs are ready; collective
  stages on one ordered lane (same order on every rank); first failure raises :class:`StageError`.
* :func:`schema_from_batch`, :func:`schema_from_model`, :func:`fast_batch`,
  :func:`check_batch` — a synthetic batch of the pipeline's form (TorchRec's ``Batch`` by default).
* :func:`warm_up` — compile and run training steps on it; nothing the job trains changes.

No submodule is named like a public function (the batch code lives in ``batch``), so
``from fastinit.warmup import fast_batch`` is the function whatever was imported before.
* :class:`CompileCache` — compiled artifacts kept across jobs (MegaCache file + Inductor dir).
* :func:`resume_stage` — a checkpoint load (:mod:`fastinit.checkpoint`) as a stage, beside the data pipeline.
* :func:`prefetch_compiler` — the compile stack's one-off imports and probes, on a thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

if TYPE_CHECKING:
    from fastinit.errors import BatchSchemaError, StageError
    from fastinit.warmup.batch import (
        BatchFactory,
        BatchField,
        BatchSchema,
        SparseFeature,
        check_batch,
        fast_batch,
        schema_from_batch,
        schema_from_model,
    )
    from fastinit.warmup.compile_cache import (
        CacheRestore,
        CompileCache,
        CompileCacheConfig,
        module_fingerprint,
    )
    from fastinit.warmup.graph import GraphConfig, Stage, StageGraph
    from fastinit.warmup.prefetch import CompilerPrefetch, prefetch_compiler
    from fastinit.warmup.resume import resume_stage
    from fastinit.warmup.targets import CompileConfig, resolve_targets
    from fastinit.warmup.warmup import (
        StateSnapshot,
        WarmupConfig,
        WarmupReport,
        compile_count,
        compile_modules,
        preserved_state,
        set_thread_device,
        swap_in_compiled,
        warm_up,
    )

__all__ = [
    "BatchFactory",
    "BatchField",
    "BatchSchema",
    "BatchSchemaError",
    "CacheRestore",
    "CompileCache",
    "CompileCacheConfig",
    "CompileConfig",
    "CompilerPrefetch",
    "GraphConfig",
    "SparseFeature",
    "Stage",
    "StageError",
    "StageGraph",
    "StateSnapshot",
    "WarmupConfig",
    "WarmupReport",
    "compile_count",
    "compile_modules",
    "fast_batch",
    "module_fingerprint",
    "prefetch_compiler",
    "preserved_state",
    "check_batch",
    "resolve_targets",
    "resume_stage",
    "schema_from_batch",
    "schema_from_model",
    "set_thread_device",
    "swap_in_compiled",
    "warm_up",
]

_EXPORTS = {
    "BatchFactory": ".batch",
    "BatchField": ".batch",
    "BatchSchema": ".batch",
    "BatchSchemaError": "fastinit.errors",
    "SparseFeature": ".batch",
    "check_batch": ".batch",
    "fast_batch": ".batch",
    "schema_from_batch": ".batch",
    "schema_from_model": ".batch",
    "CacheRestore": ".compile_cache",
    "CompileCache": ".compile_cache",
    "CompileCacheConfig": ".compile_cache",
    "module_fingerprint": ".compile_cache",
    "GraphConfig": ".graph",
    "Stage": ".graph",
    "StageError": "fastinit.errors",
    "StageGraph": ".graph",
    "CompilerPrefetch": ".prefetch",
    "prefetch_compiler": ".prefetch",
    "resume_stage": ".resume",
    "CompileConfig": ".targets",
    "resolve_targets": ".targets",
    "StateSnapshot": ".warmup",
    "WarmupConfig": ".warmup",
    "WarmupReport": ".warmup",
    "compile_count": ".warmup",
    "compile_modules": ".warmup",
    "preserved_state": ".warmup",
    "set_thread_device": ".warmup",
    "swap_in_compiled": ".warmup",
    "warm_up": ".warmup",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
