"""A synthetic "fast batch": a valid input of the real batches' form, built without the pipeline.

Compilation and warm-up need a batch of the right *form*, not real data. The form is a
:class:`BatchSchema`:

* the **layout** of the batch type: its fields in order, each a dense tensor (per-sample shape and
  dtype), a ``KeyedJaggedTensor`` (its keys *in order*, weighted or not, the dtypes of its lengths
  and values) or ``None``;
* the **tables** behind each sparse feature (:class:`SparseFeature`), so every synthetic id is a
  valid row.

Where the schema comes from, best first:

1. :func:`schema_from_batch` — from one real batch of the pipeline (its first batch, or any batch
   of the same type and features): the feature order, weights, dense shape and batch type are
   exactly the pipeline's;
2. :func:`schema_from_model` — from the model alone, laid out as TorchRec's own
   ``torchrec.datasets.utils.Batch`` (``dense_features``, ``sparse_features``, ``labels``) with
   the features in the order the model declares its tables. A pipeline may present the features
   in another order; :func:`fastinit.warmup.warm_up` therefore leaves nothing behind that depends
   on the warm-up batch's order, and :func:`check_batch` says whether the real first batch has
   the schema the warm-up compiled for (naming the first difference).

Example::

    schema = schema_from_model(dmp)                     # TorchRec's Batch, model order
    batch = fast_batch(schema, 8, torch.device("cpu"))  # works with torchrec's DLRMTrain
    ...
    check_batch(schema, first_real_batch)               # BatchSchemaError on a difference
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastinit.errors import BatchSchemaError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "SparseFeature",
    "BatchField",
    "BatchSchema",
    "BatchSchemaError",
    "BatchFactory",
    "schema_from_model",
    "schema_from_batch",
    "check_batch",
    "fast_batch",
]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SparseFeature:
    """One sparse (id-list) feature and the tables it looks up."""

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
class BatchField:
    """One field of a batch type."""

    name: str
    """Attribute name on the batch."""
    kind: str
    """"tensor", "kjt" (a KeyedJaggedTensor) or "none" (the field is None)."""
    shape: tuple[int, ...] = ()
    """Tensor: shape of one sample (the batch dimension removed)."""
    dtype: str = "torch.float32"
    """Tensor: dtype; KJT: dtype of the values (ids)."""
    keys: tuple[str, ...] = ()
    """KJT: feature keys, in order."""
    weighted: bool = False
    """KJT: carries per-id weights."""
    lengths_dtype: str = "torch.int64"
    """KJT: dtype of the lengths."""

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "kjt", "none"):
            raise ValueError(f"field {self.name!r}: kind must be tensor, kjt or none")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BatchSchema:
    """The input form of a model: what a fast batch must look like."""

    dense_features: int
    """Dense features per sample."""
    sparse: tuple[SparseFeature, ...]
    """Sparse features with their table rows (in the model's table order)."""
    batch_type: type | None = None
    """The batch class; None: ``torchrec.datasets.utils.Batch``."""
    fields: tuple[BatchField, ...] = ()
    """The batch type's layout; empty: TorchRec's ``Batch`` layout derived from the above."""

    def __post_init__(self) -> None:
        if self.dense_features < 0:
            raise ValueError(f"dense_features must be >= 0, got {self.dense_features}")
        names = [f.name for f in self.sparse]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate sparse feature names in {names}")

    @property
    def unweighted(self) -> tuple[SparseFeature, ...]:
        """Unweighted features, in model order."""
        return tuple(f for f in self.sparse if not f.weighted)

    @property
    def weighted(self) -> tuple[SparseFeature, ...]:
        """Weighted features, in model order."""
        return tuple(f for f in self.sparse if f.weighted)

    def resolved_type(self) -> type:
        """The batch class (TorchRec's ``Batch`` when none was given)."""
        if self.batch_type is not None:
            return self.batch_type
        from torchrec.datasets.utils import Batch

        return Batch

    def layout(self) -> tuple[BatchField, ...]:
        """The fields of the batch type (TorchRec's ``Batch`` layout by default).

        Raises:
            ValueError: no layout was given and TorchRec's ``Batch`` cannot hold the features
                (weighted features: it has one unweighted KJT).
        """
        if self.fields:
            return self.fields
        from torchrec.datasets.utils import Batch

        if self.batch_type is not None and self.batch_type is not Batch:
            raise ValueError(
                f"no layout for batch type {self.batch_type.__qualname__}: build the schema with "
                "schema_from_batch(a real batch, model) or pass make= to fast_batch"
            )
        if self.weighted:
            raise ValueError(
                "torchrec.datasets.utils.Batch holds one unweighted KeyedJaggedTensor, but the "
                f"model has weighted features {[f.name for f in self.weighted]}: build the schema "
                "with schema_from_batch(a real batch, model) or pass make= to fast_batch"
            )
        return (
            BatchField(name="dense_features", kind="tensor", shape=(self.dense_features,)),
            BatchField(
                name="sparse_features",
                kind="kjt",
                keys=tuple(f.name for f in self.sparse),
                dtype="torch.int64",
            ),
            BatchField(name="labels", kind="tensor", dtype="torch.int64"),
        )


#: ``make(schema, batch_size, device) -> batch``: builds a fast batch of the trainer's own type.
BatchFactory = Callable[["BatchSchema", int, "torch.device"], Any]


def schema_from_model(
    model: nn.Module, *, dense_features: int | None = None, batch_type: type | None = None
) -> BatchSchema:
    """Read the input schema off a TorchRec model, laid out as TorchRec's ``Batch``.

    Walks every ``EmbeddingBagCollection`` / ``EmbeddingCollection`` and their sharded
    counterparts (inside a ``DistributedModelParallel`` too), in module order, collecting feature
    names, the rows of the tables they look up and whether they are weighted.

    The features come in the model's table order. A pipeline that presents them in another
    order is safe (warm-up restores what TorchRec derives from the first batch), but the compiled
    code is then exercised on another order: prefer :func:`schema_from_batch` when a real batch
    is at hand, and :func:`check_batch` the real first batch.

    Args:
        model: the model, plain or sharded.
        dense_features: dense features per sample; by default the ``in_features`` of the first
            ``nn.Linear`` outside the embedding modules (right for DLRM-style models whose dense
            arch comes first; pass it explicitly otherwise).
        batch_type: the batch class (default ``torchrec.datasets.utils.Batch``); another class
            needs a layout (:func:`schema_from_batch`) or a factory (``fast_batch(make=...)``).

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
    return BatchSchema(
        dense_features=dense_features, sparse=tuple(features.values()), batch_type=batch_type
    )


def _batch_items(batch: Any) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)]
    if hasattr(batch, "__dict__"):
        return [(k, v) for k, v in vars(batch).items() if not k.startswith("_")]
    raise TypeError(
        f"cannot read the fields of a {type(batch).__qualname__}: use a dataclass batch or pass "
        "make= to fast_batch"
    )


def _fields_of(batch: Any) -> tuple[tuple[BatchField, ...], dict[str, int]]:
    """The layout of ``batch`` and, per sparse key, 1 + its largest id (at least 1)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    fields: list[BatchField] = []
    rows: dict[str, int] = {}
    for name, value in _batch_items(batch):
        if value is None:
            fields.append(BatchField(name=name, kind="none"))
        elif isinstance(value, KeyedJaggedTensor):
            keys = tuple(value.keys())
            fields.append(
                BatchField(
                    name=name,
                    kind="kjt",
                    keys=keys,
                    weighted=value.weights_or_none() is not None,
                    dtype=str(value.values().dtype),
                    lengths_dtype=str(value.lengths().dtype),
                )
            )
            for key, jt in value.to_dict().items():
                ids = jt.values()
                rows[key] = max(rows.get(key, 1), int(ids.max()) + 1 if ids.numel() else 1)
        elif isinstance(value, torch.Tensor):
            shape = tuple(value.shape[1:]) if value.dim() else ()
            fields.append(BatchField(name=name, kind="tensor", shape=shape, dtype=str(value.dtype)))
        else:
            raise TypeError(
                f"batch field {name!r} is a {type(value).__qualname__}: a fast batch can be "
                "built for tensor, KeyedJaggedTensor and None fields only (pass make= otherwise)"
            )
    return tuple(fields), rows


def schema_from_batch(batch: Any, model: nn.Module | None = None) -> BatchSchema:
    """The schema of a real batch: its type, fields, feature order, weights and dense shape.

    Args:
        batch: a batch of the pipeline (its first batch, or any batch of the same form); a
            dataclass (or plain object) whose fields are tensors, ``KeyedJaggedTensor`` or None.
        model: the model whose tables bound the ids (recommended: ids are then drawn over the
            tables' rows); without it ids stay below the largest id seen in ``batch``.

    Returns:
        The schema; :func:`fast_batch` builds batches of ``type(batch)`` from it.
    """
    fields, seen_rows = _fields_of(batch)
    by_model: dict[str, SparseFeature] = {}
    dense = 0
    if model is not None:
        from_model = schema_from_model(model, dense_features=0)
        by_model = {f.name: f for f in from_model.sparse}
    sparse: list[SparseFeature] = []
    for field in fields:
        if field.kind == "tensor" and dense == 0 and field.shape and "float" in field.dtype:
            dense = int(field.shape[0])
        if field.kind != "kjt":
            continue
        for key in field.keys:
            known = by_model.get(key)
            sparse.append(
                SparseFeature(
                    name=key,
                    num_embeddings=known.num_embeddings if known else seen_rows.get(key, 1),
                    weighted=field.weighted,
                    sequence=known.sequence if known else False,
                )
            )
    return BatchSchema(
        dense_features=dense, sparse=tuple(sparse), batch_type=type(batch), fields=fields
    )


def check_batch(schema: BatchSchema, batch: Any) -> None:
    """Check that ``batch`` has the form ``schema`` describes (type, fields, keys in order,
    weights, per-sample shapes and dtypes).

    Raises:
        BatchSchemaError: the first difference, by name (for sparse features: the first key
            whose position differs).
    """
    expected_type = schema.resolved_type()
    if type(batch) is not expected_type:
        raise BatchSchemaError(
            f"batch type differs: expected {expected_type.__qualname__}, "
            f"got {type(batch).__qualname__}"
        )
    expected = schema.layout()
    actual, _ = _fields_of(batch)
    names = [f.name for f in expected], [f.name for f in actual]
    if names[0] != names[1]:
        raise BatchSchemaError(f"batch fields differ: expected {names[0]}, got {names[1]}")
    for want, got in zip(expected, actual):
        where = f"field {want.name!r}"
        if want.kind != got.kind:
            raise BatchSchemaError(f"{where}: expected a {want.kind}, got a {got.kind}")
        if want.kind == "tensor" and (want.shape, want.dtype) != (got.shape, got.dtype):
            raise BatchSchemaError(
                f"{where}: expected per-sample shape {list(want.shape)} {want.dtype}, "
                f"got {list(got.shape)} {got.dtype}"
            )
        if want.kind != "kjt":
            continue
        for i in range(max(len(want.keys), len(got.keys))):
            w = want.keys[i] if i < len(want.keys) else None
            g = got.keys[i] if i < len(got.keys) else None
            if w != g:
                raise BatchSchemaError(
                    f"{where}: sparse feature {i} differs: expected {w!r}, got {g!r} "
                    f"(expected keys {list(want.keys)}, got {list(got.keys)})"
                )
        if want.weighted != got.weighted:
            raise BatchSchemaError(
                f"{where}: expected {'weighted' if want.weighted else 'unweighted'} features "
                f"{list(want.keys)}, got {'weighted' if got.weighted else 'unweighted'} ones"
            )


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _build(schema: BatchSchema, batch_size: int, device: torch.device, seed: int) -> Any:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    rows = {f.name: f.num_embeddings for f in schema.sparse}
    values: dict[str, Any] = {}
    for field in schema.layout():
        if field.kind == "none":
            values[field.name] = None
        elif field.kind == "tensor":
            dtype = _dtype(field.dtype)
            shape = (batch_size, *field.shape)
            if dtype.is_floating_point:
                t = torch.rand(shape, generator=g).to(dtype)  # in [0, 1): valid labels too
            else:
                t = (torch.arange(batch_size) % 2).reshape(-1, *([1] * len(field.shape)))
                t = t.expand(shape).to(dtype).contiguous()
            values[field.name] = t.to(device)
        else:
            keys = field.keys
            # Lengths cycle through 0..3: empty bags and several ids per bag are both exercised.
            lengths = (torch.arange(batch_size * len(keys)) % 4).to(_dtype(field.lengths_dtype))
            ids = [
                torch.randint(
                    0,
                    rows.get(key, 1),
                    (int(lengths[i * batch_size : (i + 1) * batch_size].sum()),),
                    generator=g,
                )
                for i, key in enumerate(keys)
            ]
            v = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)
            v = v.to(_dtype(field.dtype))
            kjt = KeyedJaggedTensor(
                keys=list(keys),
                values=v,
                lengths=lengths,
                weights=torch.rand(v.numel(), generator=g) if field.weighted else None,
            )
            values[field.name] = kjt.to(device)
    return schema.resolved_type()(**values)


def fast_batch(
    schema: BatchSchema,
    batch_size: int,
    device: torch.device,
    make: BatchFactory | None = None,
    *,
    seed: int = 0,
) -> Any:
    """Build a fast batch: an instance of the schema's batch type with synthetic, valid values.

    Without ``make`` the batch is built from the schema's layout: TorchRec's
    ``torchrec.datasets.utils.Batch`` for :func:`schema_from_model`, the pipeline's own batch
    type for :func:`schema_from_batch`. Ids are drawn below each table's rows, lengths cycle
    through 0..3, float tensors in [0, 1), integer tensors (labels) alternate 0 and 1. A private
    generator is used: the global RNG is not touched.

    Args:
        schema: the input schema (:func:`schema_from_batch` or :func:`schema_from_model`).
        batch_size: samples, >= 2 (size 1 specializes compiled code; other sizes reuse it).
        device: where the batch lives.
        make: a factory ``make(schema, batch_size, device) -> batch`` for batch types whose
            fields are not plain tensors / KJTs.
        seed: seed of the private generator.

    Returns:
        The batch.
    """
    if batch_size < 2:
        raise ValueError(
            f"a fast batch needs batch_size >= 2 (size 1 specializes), got {batch_size}"
        )
    if make is not None:
        return make(schema, batch_size, device)
    return _build(schema, batch_size, device, seed)
