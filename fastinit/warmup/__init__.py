"""Init stages run concurrently, the fast batch, warm-up without side effects, compile cache.

``import fastinit.warmup`` loads neither torch nor torchrec: names are imported on first use.

* :class:`StageGraph` — start-up stages on threads, as soon as their inputs are ready; collective
  stages on one ordered lane (same order on every rank); first failure raises :class:`StageError`.
* :func:`schema_from_model`, :func:`fast_batch` — a synthetic batch of the model's input form.
* :func:`warm_up` — compile and run forward/backward on it, every state restored bit for bit.
* :class:`CompileCache` — compiled artifacts kept across jobs (MegaCache file + Inductor dir).
* :func:`resume_stage` — a DCP checkpoint load as a stage, overlapped with the data pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.warmup.compile_cache import (
        CacheRestore,
        CompileCache,
        CompileCacheConfig,
        module_fingerprint,
    )
    from fastinit.warmup.fast_batch import (
        BatchFactory,
        BatchSchema,
        SparseFeature,
        fast_batch,
        reference_batch,
        schema_from_model,
    )
    from fastinit.warmup.graph import GraphConfig, Stage, StageError, StageGraph
    from fastinit.warmup.resume import load_checkpoint, resume_stage, save_checkpoint
    from fastinit.warmup.warmup import (
        CompileConfig,
        WarmupConfig,
        WarmupReport,
        compile_count,
        compile_modules,
        preserved_state,
        warm_up,
    )

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Stage", "StageError", "GraphConfig", "StageGraph"), "graph"),
    **dict.fromkeys(
        (
            "SparseFeature",
            "BatchSchema",
            "BatchFactory",
            "schema_from_model",
            "reference_batch",
            "fast_batch",
        ),
        "fast_batch",
    ),
    **dict.fromkeys(
        (
            "CompileConfig",
            "WarmupConfig",
            "WarmupReport",
            "compile_modules",
            "compile_count",
            "preserved_state",
            "warm_up",
        ),
        "warmup",
    ),
    **dict.fromkeys(
        ("CompileCacheConfig", "CacheRestore", "CompileCache", "module_fingerprint"),
        "compile_cache",
    ),
    **dict.fromkeys(("save_checkpoint", "load_checkpoint", "resume_stage"), "resume"),
}

__all__ = [
    "BatchFactory",
    "BatchSchema",
    "CacheRestore",
    "CompileCache",
    "CompileCacheConfig",
    "CompileConfig",
    "GraphConfig",
    "SparseFeature",
    "Stage",
    "StageError",
    "StageGraph",
    "WarmupConfig",
    "WarmupReport",
    "compile_count",
    "compile_modules",
    "fast_batch",
    "load_checkpoint",
    "module_fingerprint",
    "preserved_state",
    "reference_batch",
    "resume_stage",
    "save_checkpoint",
    "schema_from_model",
    "warm_up",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.warmup' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fastinit.warmup.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
