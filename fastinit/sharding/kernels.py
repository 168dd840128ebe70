"""TorchRec's lookups, embedding kernels and fused optimizer, building their ShardedTensors in
O(this rank's shards) — as subclasses, without patching anything.

Stock TorchRec builds a ShardedTensor for every table a kernel holds: in the kernel's fused
optimizer (the weight and each optimizer state, after a deep copy of the table's global shard
metadata), per table again for each parameter slice (``_param_per_table``), and in the kernel's
``state_dict``. Each goes through ``ShardedTensor._init_from_local_shards_and_global_metadata``,
which validates every shard against a fresh list of the group's ranks: O(shards × ranks) per
tensor, O(ranks²) for a row-wise table.

Here the fast sharded modules (:mod:`fastinit.sharding.sharders`) build their lookups through
:func:`create_lookup`, whose lookups build the subclasses below. Each subclass runs TorchRec's
own code (the same function objects' code) with the names it constructs through bound to the
fast equivalents — ``EmbeddingFusedOptimizer`` to :class:`FastEmbeddingFusedOptimizer`,
``ShardedTensor`` to a stand-in whose local constructor is
:func:`fastinit.sharding.local.fast_sharded_tensor` — by :func:`rebound`, which copies the
function with its own globals: no module, class or global is changed, so every other caller (and
every other thread) keeps TorchRec's classes as they are. A name that is not where this module
expects it (a TorchRec upgrade) is a :class:`fastinit.errors.CompatibilityError` at first use.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["rebound", "create_lookup", "fast_classes", "tables_seeded_after"]

#: True while a fast sharded module is built whose tables are initialised afterwards from their
#: ``(seed, FQN)`` blocks (:func:`tables_seeded_after`); per thread and task.
_SEEDED_AFTER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fastinit_tables_seeded_after", default=False
)


@contextlib.contextmanager
def tables_seeded_after() -> Iterator[None]:
    """Within: the fast kernels built skip their own initialisation of tables that the sharded
    module initialises right after construction (``reset_parameters``: every table with an
    ``init_fn``), so each value is written once instead of twice. Stock TorchRec writes every
    table twice: the kernel's ``uniform_`` in its ``__init__``, then ``reset_parameters``."""
    token = _SEEDED_AFTER.set(True)
    try:
        yield
    finally:
        _SEEDED_AFTER.reset(token)


def rebound(func: Callable[..., Any], **names: Any) -> Any:
    """A copy of ``func`` (same code, defaults, closure) whose global ``names`` are bound to
    the given objects; ``func`` and its module are unchanged. Each name must be a global
    ``func`` reads."""
    from fastinit.errors import CompatibilityError

    f: Any = func
    code = f.__code__
    missing = [n for n in names if n not in code.co_names or n not in f.__globals__]
    if missing:
        raise CompatibilityError(
            f"fastinit: {func.__module__}.{func.__qualname__} no longer reads "
            f"{', '.join(missing)} (TorchRec changed); fastinit's sharders need updating"
        )
    scope = dict(f.__globals__)
    scope.update(names)
    out = types.FunctionType(code, scope, f.__name__, f.__defaults__, f.__closure__)
    out.__kwdefaults__ = f.__kwdefaults__
    out.__qualname__ = func.__qualname__
    out.__doc__ = func.__doc__
    out.__module__ = __name__
    return out


class _StandIn(type):
    """Metaclass of a stand-in for a class: attributes it does not define, ``isinstance`` and
    ``issubclass`` are the real class's."""

    _real: type

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._real, name)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._real)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._real)


def _local_sharded_tensor() -> type:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from fastinit.sharding import local

    return _StandIn(
        "ShardedTensor",
        (),
        {
            "_real": ShardedTensor,
            "_init_from_local_shards_and_global_metadata": staticmethod(local.sharded_tensor),
        },
    )


@functools.cache
def fast_classes() -> types.SimpleNamespace:
    """The fast classes, built on first use (TorchRec is imported then, not at fastinit's
    import)."""
    from torchrec.distributed import batched_embedding_kernel as bek
    from torchrec.distributed import embedding_kernel as ek
    from torchrec.distributed import embedding_lookup as el

    from fastinit.sharding.mirror import batched_embedding_kernel as mirror_bek

    st = _local_sharded_tensor()

    class FastEmbeddingFusedOptimizer(bek.EmbeddingFusedOptimizer):
        """TorchRec's ``EmbeddingFusedOptimizer`` (1.8.0) for ShardedTensor state, with each
        table's optimizer-state metadata built once per layout (from the layout's rule where it
        has one) and its ShardedTensors built locally (stock: per table and optimizer state,
        after a deep copy of the table's global metadata, O(shards × ranks) each)."""

        def __init__(
            self,
            config: Any,
            emb_module: Any,
            pg: Any = None,
            create_for_table: str | None = None,
            param_weight_for_table: Any = None,
            embedding_weights_by_table: list[Any] | None = None,
            all_optimizer_states: list[dict[str, Any]] | None = None,
        ) -> None:
            args = (
                config,
                emb_module,
                pg,
                create_for_table,
                param_weight_for_table,
                embedding_weights_by_table,
                all_optimizer_states,
            )
            if any(t.dtensor_metadata for t in config.embedding_tables):
                super().__init__(*args)  # DTensor state: TorchRec's own
                return
            mirror_bek.fused_optimizer_init(self, *args)

    optimizer = FastEmbeddingFusedOptimizer
    by_table = rebound(bek._gen_named_parameters_by_table_fused, EmbeddingFusedOptimizer=optimizer)
    get_state_dict = rebound(ek.get_state_dict, ShardedTensor=st)

    def kernel(stock: Any, base: Any, fused: bool) -> type:
        def init_parameters(self: Any) -> None:
            # TorchRec's, except while every table here is seeded right after construction
            tables = self._config.embedding_tables
            if not (_SEEDED_AFTER.get() and all(t.init_fn is not None for t in tables)):
                stock.init_parameters(self)

        body: dict[str, Any] = {
            "__doc__": f"TorchRec's ``{stock.__name__}``, its ShardedTensors built locally.",
            "state_dict": rebound(base.state_dict, get_state_dict=get_state_dict),
            "init_parameters": init_parameters,
        }
        if fused:
            body["__init__"] = rebound(stock.__init__, EmbeddingFusedOptimizer=optimizer)
            prop = stock.__dict__["_param_per_table"]
            body["_param_per_table"] = property(
                rebound(prop.fget, _gen_named_parameters_by_table_fused=by_table), prop.fset
            )
        return type(f"Fast{stock.__name__}", (stock,), body)

    bag = bek.BaseBatchedEmbeddingBag
    seq = bek.BaseBatchedEmbedding
    kernels = {
        "BatchedFusedEmbeddingBag": kernel(bek.BatchedFusedEmbeddingBag, bag, True),
        "BatchedDenseEmbeddingBag": kernel(bek.BatchedDenseEmbeddingBag, bag, False),
        "BatchedFusedEmbedding": kernel(bek.BatchedFusedEmbedding, seq, True),
        "BatchedDenseEmbedding": kernel(bek.BatchedDenseEmbedding, seq, False),
    }

    def lookup(stock: Any, names: tuple[str, ...]) -> type:
        return type(
            f"Fast{stock.__name__}",
            (stock,),
            {
                "__doc__": f"TorchRec's ``{stock.__name__}``, building fastinit's kernels.",
                "_create_embedding_kernel": rebound(
                    stock._create_embedding_kernel, **{n: kernels[n] for n in names}
                ),
            },
        )

    pooled = lookup(
        el.GroupedPooledEmbeddingsLookup, ("BatchedFusedEmbeddingBag", "BatchedDenseEmbeddingBag")
    )
    sequence = lookup(
        el.GroupedEmbeddingsLookup, ("BatchedFusedEmbedding", "BatchedDenseEmbedding")
    )
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return types.SimpleNamespace(
        create_embedding_bag_sharding=_sharding_factory(
            ShardedEmbeddingBagCollection.create_embedding_bag_sharding.__func__
        ),
        create_embedding_sharding=_sharding_factory(
            ShardedEmbeddingCollection.create_embedding_sharding.__func__
        ),
        optimizer=optimizer,
        kernels=kernels,
        lookups={"GroupedPooledEmbeddingsLookup": pooled, "GroupedEmbeddingsLookup": sequence},
        sharded_tensor=st,
    )


def replaced_at_run_time(cls: type, name: str) -> Any | None:
    """``cls``'s own attribute ``name`` where it is not the function ``cls``'s module defines
    under that name (a mock or monkeypatch in force, as TorchRec's own tests do:
    ``unittest.mock.patch.object(ShardedEmbeddingBagCollection, "_initialize_torch_state", ...)``),
    else None. A caller then runs it as stock would, instead of fastinit's copy of the original."""
    value = cls.__dict__.get(name)
    fn = inspect.unwrap(value) if callable(value) else value
    if (
        getattr(fn, "__qualname__", None) == f"{cls.__qualname__}.{name}"
        and getattr(fn, "__module__", None) == cls.__module__
    ):
        return None
    return value


@functools.cache
def _rebound_ebc_initialize_torch_state(stock: Callable[..., Any]) -> Any:
    return rebound(stock, ShardedTensor=fast_classes().sharded_tensor)


def ebc_initialize_torch_state(module: Any, skip_registering: bool) -> None:
    """``ShardedEmbeddingBagCollection._initialize_torch_state`` (TorchRec's code) with its
    ShardedTensors built locally; where that method is replaced at run time, the replacement,
    as stock calls it."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection as cls

    replaced = replaced_at_run_time(cls, "_initialize_torch_state")
    if replaced is not None:
        replaced(module, skip_registering=skip_registering)
        return
    stock = cls.__dict__["_initialize_torch_state"]
    _rebound_ebc_initialize_torch_state(stock)(module, skip_registering)


class _SharedEmpty(list):
    """The one empty list every rank without tables (or features) is given: at 8,192 ranks a
    sharding otherwise keeps 8,192 empty lists alive, which at that count push the garbage
    collector into full collections of the whole heap. Equal to ``[]``; changing it raises,
    so the sharing can never be observed."""

    __slots__ = ()

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "fastinit: this empty per-rank list is shared by every rank without tables; "
            "build a new list instead of changing it"
        )

    append = extend = insert = pop = remove = clear = sort = reverse = _frozen
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _frozen

    def __reduce__(self) -> Any:
        return (list, ())


EMPTY: list[Any] = _SharedEmpty()


def _share_empties(per_rank: list[Any]) -> list[Any]:
    """``per_rank`` with each empty list replaced, in place, by :data:`EMPTY`."""
    for r, items in enumerate(per_rank):
        if not items and type(items) is list:
            per_rank[r] = EMPTY
    return per_rank


def fast_group_tables(tables_per_rank: list[list[Any]]) -> list[list[Any]]:
    """TorchRec's ``group_tables``, grouping only the ranks that hold tables (the groups of a
    rank without tables are ``[]``, as TorchRec's are): the same result, in O(tables + ranks)
    instead of a grouping pass per rank. (TorchRec's TBE-composition log — a no-op in its open
    source build — numbers the ranks that hold tables in order.)"""
    from torchrec.distributed.embedding_sharding import group_tables

    held = [r for r, tables in enumerate(tables_per_rank) if tables]
    grouped = group_tables([tables_per_rank[r] for r in held])
    # A rank without tables gets the shared empty list, in the sharding's per-rank tables too
    # (the list the caller passed, changed in place): TorchRec changes neither after grouping.
    out = list(_share_empties(tables_per_rank))
    for r, groups in zip(held, grouped, strict=True):
        out[r] = groups
    return out


@functools.cache
def fast_sharding_class(cls: Any) -> Any:
    """``cls`` (a TorchRec embedding sharding) with the ``__init__`` that groups every rank's
    tables running with :func:`fast_group_tables`: a subclass whose MRO places, just before
    the class defining that ``__init__``, one whose ``__init__`` is it, rebound. ``cls`` itself
    where no ``__init__`` of its MRO groups tables."""
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None and "group_tables" in code.co_names:
            break
    else:
        return cls
    fast_init = type(
        f"_Fast{base.__name__}",
        (base,),
        {"__init__": rebound(init, group_tables=fast_group_tables)},
    )
    body: dict[str, Any] = {
        "__doc__": f"TorchRec's ``{cls.__name__}``, grouping tables only where ranks hold them."
    }
    stock_dims = getattr(cls, "_emb_dim_per_rank_per_feature", None)
    if callable(stock_dims):

        def _emb_dim_per_rank_per_feature(self: Any) -> Any:
            # TorchRec's per-rank feature dims, ranks without features sharing one empty list
            return _share_empties(stock_dims(self))

        body["_emb_dim_per_rank_per_feature"] = _emb_dim_per_rank_per_feature
    return type(f"Fast{cls.__name__}", (cls, fast_init), body)


def _sharding_factory(func: Any) -> Any:
    from torchrec.distributed.embedding_sharding import EmbeddingSharding

    names = {
        n: fast_sharding_class(func.__globals__[n])
        for n in func.__code__.co_names
        if isinstance(func.__globals__.get(n), type)
        and issubclass(func.__globals__[n], EmbeddingSharding)
    }
    return rebound(func, **names)


_LOOKUP_NAMES = ("GroupedPooledEmbeddingsLookup", "GroupedEmbeddingsLookup")


@functools.cache
def _create_lookup_of(cls: Any) -> Callable[..., Any] | None:
    fn = getattr(cls, "create_lookup", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    fast = fast_classes().lookups
    names = {
        n: fast[n]
        for n in _LOOKUP_NAMES
        if n in code.co_names and fn.__globals__.get(n) is getattr(fast[n], "__base__", None)  # type: ignore[union-attr]
    }
    if not names:
        return None
    return rebound(fn, **names)  # type: ignore[arg-type]


def create_lookup(sharding: Any) -> Any:
    """``sharding.create_lookup()``, with fastinit's lookups where the sharding builds TorchRec's
    ``GroupedPooledEmbeddingsLookup`` / ``GroupedEmbeddingsLookup`` (any other sharding — a
    user's own, an inference one — builds its own)."""
    fn = _create_lookup_of(type(sharding))  # type: ignore[arg-type]
    return sharding.create_lookup() if fn is None else fn(sharding)
