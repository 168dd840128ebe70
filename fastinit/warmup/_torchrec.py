"""Every private TorchRec name ``fastinit.warmup`` touches, in one place (torchrec 1.8.0).

Sharded embedding modules do not expose their table configs publicly: ``ShardedEmbeddingBagCollection``
keeps them in ``_embedding_bag_configs`` / ``_is_weighted`` and ``ShardedEmbeddingCollection`` in
``_embedding_configs``. Both are set in the constructors of torchrec 1.8.0. ``CombinedOptimizer``
keeps its children in ``_optims`` (its public ``state`` is a fresh merged dict, useless for restoring
in place) and ``TrainPipelineSparseDist`` its optimizer in ``_optimizer``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["TORCHREC_VERSION", "embedding_tables", "combined_children", "pipeline_optimizer"]

#: The torchrec version these accessors were written against.
TORCHREC_VERSION = "1.8.0"


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
