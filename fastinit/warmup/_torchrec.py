"""Every private TorchRec name ``fastinit.warmup`` touches, in one place (torchrec 1.8.0).

Sharded embedding modules do not expose their table configs publicly: ``ShardedEmbeddingBagCollection``
keeps them in ``_embedding_bag_configs`` / ``_is_weighted`` and ``ShardedEmbeddingCollection`` in
``_embedding_configs``. Both are set in the constructors of torchrec 1.8.0. ``CombinedOptimizer``
keeps its children in ``_optims`` (its public ``state`` is a fresh merged dict, useless for restoring
in place) and ``TrainPipelineSparseDist`` its optimizer in ``_optimizer`` and the sharded modules
it rewrote in ``_pipelined_modules``. FBGEMM's training TBE (public FBGEMM API) gives per-table
views of its weights and optimizer states.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "embedding_tables",
    "combined_children",
    "pipeline_optimizer",
    "is_sharded_module",
    "fused_tables",
    "pipeline_rewrote_model",
]


def embedding_tables(module: nn.Module) -> tuple[list[Any], bool, bool] | None:
    """``(table configs, is_weighted, is_sequence)`` of an embedding module, sharded or not.

    Returns None for any other module.
    """
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs()), bool(module.is_weighted()), False
    if isinstance(module, EmbeddingCollection):
        return list(module.embedding_configs()), False, True
    if isinstance(module, ShardedEmbeddingBagCollection):
        return list(module._embedding_bag_configs), bool(module._is_weighted), False
    if isinstance(module, ShardedEmbeddingCollection):
        return list(module._embedding_configs), False, True
    return None


def combined_children(optimizer: Any) -> list[Any] | None:
    """The child optimizers of a torchrec ``CombinedOptimizer``; None for any other optimizer."""
    children = getattr(optimizer, "_optims", None)
    if children is None:
        return None
    return [child for _, child in children]


def pipeline_optimizer(pipeline: Any) -> Any:
    """The optimizer a torchrec train pipeline steps (None if it has none)."""
    return getattr(pipeline, "_optimizer", None)


def is_sharded_module(module: Any) -> bool:
    """A TorchRec ``ShardedModule`` (sharded EBC/EC/...): holds state derived from its first batch."""
    from torchrec.distributed.types import ShardedModule

    return isinstance(module, ShardedModule)


def fused_tables(module: Any) -> tuple[list[Any], list[list[Any]], list[int]] | None:
    """An FBGEMM training TBE's per-table views: ``(weights, optimizer states, feature->table)``.

    ``weights[t]`` is table ``t`` as a ``(rows, dim)`` view; ``states[t]`` its optimizer states
    (row-wise states as ``(rows,)`` views). None for any other module, and for TBEs whose rows
    cannot be restored one by one (a software cache on the device holds rows of its own).
    """
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:  # pragma: no cover - fbgemm without the training TBE
        return None
    if not isinstance(module, SplitTableBatchedEmbeddingBagsCodegen):
        return None
    cache = getattr(module, "lxu_cache_weights", None)
    if cache is not None and cache.numel() > 0:
        return None
    weights = list(module.split_embedding_weights())
    try:
        states = [list(s) for s in module.split_optimizer_states()]
    except NotImplementedError:  # OptimType.NONE: no fused update, no state
        states = [[] for _ in weights]
    if not states:
        states = [[] for _ in weights]
    return weights, states, [int(t) for t in module.feature_table_map]


def pipeline_rewrote_model(pipeline: Any) -> bool:
    """A ``TrainPipelineSparseDist`` has rewritten its model's sharded modules (first batch seen)."""
    return bool(getattr(pipeline, "_pipelined_modules", None))
