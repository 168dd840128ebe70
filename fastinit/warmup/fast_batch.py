"""A synthetic "fast batch": a valid input built from the model's schema, not from the pipeline.

Compilation and warm-up only need a batch of the right *form*: the right dense width, the right
sparse feature names (in the order the real pipeline presents them), ids within each table's rows,
weights where a collection is weighted. :func:`schema_from_model` reads that form off a TorchRec
model (plain or inside a ``DistributedModelParallel``), and a batch factory
``make(schema, batch_size, device) -> batch`` builds the batch; :func:`reference_batch` builds the
:class:`fastinit.testing.models.Batch` layout, and a trainer with its own batch type passes its
own factory.

Example::

    schema = schema_from_model(dmp)
    batch = fast_batch(schema, batch_size=8, device=torch.device("cpu"))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "SparseFeature",
    "BatchSchema",
    "BatchFactory",
    "schema_from_model",
    "reference_batch",
    "fast_batch",
]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SparseFeature:
    """One sparse (id-list) feature."""

    name: str
    """The KeyedJaggedTensor key."""
    num_embeddings: int
    """Rows of the smallest table the feature looks up: every id must be below this."""
    weighted: bool = False
    """The feature feeds a weighted collection (its KJT carries per-id weights)."""
    sequence: bool = False
    """The feature feeds an EmbeddingCollection (sequence embeddings, not pooled)."""

    def __post_init__(self) -> None:
        if self.num_embeddings < 1:
            raise ValueError(f"feature {self.name!r}: num_embeddings must be >= 1")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BatchSchema:
    """The input form of a model: what a fast batch must look like."""

    dense_features: int
    """Dense features per sample."""
    sparse: tuple[SparseFeature, ...]
    """Sparse features, in the order the embedding modules are declared (and their tables)."""

    def __post_init__(self) -> None:
        if self.dense_features < 0:
            raise ValueError(f"dense_features must be >= 0, got {self.dense_features}")
        names = [f.name for f in self.sparse]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate sparse feature names in {names}")

    @property
    def unweighted(self) -> tuple[SparseFeature, ...]:
        """Features of the unweighted KJT, in order."""
        return tuple(f for f in self.sparse if not f.weighted)

    @property
    def weighted(self) -> tuple[SparseFeature, ...]:
        """Features of the weighted KJT, in order."""
        return tuple(f for f in self.sparse if f.weighted)


#: ``make(schema, batch_size, device) -> batch``: builds a fast batch of the trainer's own type.
BatchFactory = Callable[["BatchSchema", int, "torch.device"], Any]


def schema_from_model(model: nn.Module, *, dense_features: int | None = None) -> BatchSchema:
    """Read the input schema off a TorchRec model.

    Walks every ``EmbeddingBagCollection`` / ``EmbeddingCollection`` and their sharded
    counterparts (inside a ``DistributedModelParallel`` too), in module order, collecting feature
    names, the rows of the tables they look up and whether they are weighted.

    Args:
        model: the model, plain or sharded.
        dense_features: dense features per sample; by default the ``in_features`` of the first
            ``nn.Linear`` outside the embedding modules (right for DLRM-style models whose dense
            arch comes first; pass it explicitly otherwise).

    Returns:
        The schema.

    Raises:
        ValueError: no embedding module, or no way to tell the dense width.
    """
    from torch import nn

    from fastinit.warmup._torchrec import embedding_tables

    features: dict[str, SparseFeature] = {}
    found = False
    first_linear: int | None = None
    seen: set[int] = set()
    embedding_prefixes: list[str] = []
    for path, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if any(path.startswith(p + ".") for p in embedding_prefixes):
            continue
        tables = embedding_tables(module)
        if tables is not None:
            found = True
            embedding_prefixes.append(path)
            configs, weighted, sequence = tables
            for config in configs:
                for name in config.feature_names:
                    old = features.get(name)
                    rows = int(config.num_embeddings)
                    if old is not None:
                        rows = min(rows, old.num_embeddings)
                    features[name] = SparseFeature(
                        name=name, num_embeddings=rows, weighted=weighted, sequence=sequence
                    )
            continue
        if first_linear is None and isinstance(module, nn.Linear):
            first_linear = module.in_features
    if not found:
        raise ValueError("the model holds no EmbeddingBagCollection or EmbeddingCollection")
    if dense_features is None:
        if first_linear is None:
            raise ValueError("no nn.Linear found: pass dense_features explicitly")
        dense_features = first_linear
    return BatchSchema(dense_features=dense_features, sparse=tuple(features.values()))


def reference_batch(
    schema: BatchSchema, batch_size: int, device: torch.device, *, seed: int = 0
) -> Any:
    """A :class:`fastinit.testing.models.Batch` for ``schema``: the reference layout.

    ``sparse`` holds the unweighted features, ``weighted`` the weighted ones (None if there are
    none), each in schema order; lengths cycle through 0..3 so every shape path (empty bags
    included) is exercised; ids are spread over each table's rows. Uses its own generator: the
    global RNG is not touched.
    """
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from fastinit.testing.models import Batch

    if batch_size < 2:
        raise ValueError(
            f"a fast batch needs batch_size >= 2 (size 1 specializes), got {batch_size}"
        )
    g = torch.Generator().manual_seed(seed)

    def kjt(feats: tuple[SparseFeature, ...], weighted: bool) -> Any:
        lengths = (torch.arange(batch_size * len(feats)) % 4).to(torch.int64)
        values = [
            torch.randint(
                0,
                f.num_embeddings,
                (int(lengths[i * batch_size : (i + 1) * batch_size].sum()),),
                generator=g,
            )
            for i, f in enumerate(feats)
        ]
        v = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return KeyedJaggedTensor(
            keys=[f.name for f in feats],
            values=v,
            lengths=lengths,
            weights=torch.rand(v.numel(), generator=g) if weighted else None,
        )

    batch = Batch(
        dense=torch.randn(batch_size, schema.dense_features, generator=g),
        sparse=kjt(schema.unweighted, weighted=False),
        weighted=kjt(schema.weighted, weighted=True) if schema.weighted else None,
        labels=(torch.arange(batch_size) % 2).float(),
    )
    return batch.to(device)


def fast_batch(
    schema: BatchSchema,
    batch_size: int,
    device: torch.device,
    make: BatchFactory | None = None,
) -> Any:
    """Build a fast batch with ``make`` (default :func:`reference_batch`).

    Args:
        schema: the model's input schema (:func:`schema_from_model`).
        batch_size: samples; any size >= 2 (compiled code is marked dynamic in the batch size).
        device: where the batch lives.
        make: the trainer's batch factory, ``make(schema, batch_size, device) -> batch``.

    Returns:
        Whatever ``make`` returns.
    """
    factory: BatchFactory = make if make is not None else reference_batch
    return factory(schema, batch_size, device)
