"""Every initial value fastinit makes without a message, in one place.

Nothing here reseeds or draws from the global RNG (CPU or CUDA): every random number comes from a
``torch.Generator`` built for one tensor (or one block of rows of a table) and seeded by a hash of
``(seed, name)``. Init code that does not take a generator (``nn.Linear.reset_parameters``,
TorchRec's kernels) runs under :func:`explicit_rng`, a *thread-local* ``TorchDispatchMode`` that
fills the ``generator`` argument of every random aten op issued without one; other threads — a
data pipeline started concurrently — never see it and keep the global RNG to themselves.

The rules (docs/seeding.md):

* **Tables** (:func:`init_table_shards`): the rows of table ``T`` are cut into fixed blocks of
  :func:`block_rows` rows (a function of ``T``'s full width alone); block ``b`` is generated at full
  width from a generator seeded by ``(seed, T's FQN, b)``. A shard generates the blocks it
  overlaps and keeps its rows and columns. With an element-wise initialiser (uniform, normal,
  constant, TorchRec's default) the gathered shards of any plan, at any world size, are the same
  table bit for bit, and no two shards are copies. An initialiser whose distribution depends on the
  tensor's shape (xavier, kaiming, orthogonal, ...) or that fastinit does not know runs on each
  shard's own tensor, as in stock TorchRec, from a generator seeded by ``(seed, FQN, shard offsets)``.
* **Dense parameters on meta** (:func:`materialize_dense`): materialised on the device, then the
  owning module's ``reset_parameters`` runs with one generator per tensor, seeded by
  ``(seed, parameter FQN)``. A parameter no initialiser touches is zero, as a meta buffer is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

__all__ = [
    "BLOCK_ELEMENTS",
    "block_rows",
    "explicit_rng",
    "init_table_shards",
    "is_elementwise",
    "materialize_dense",
    "scratch_rng",
    "seeded_generator_seed",
]

#: Target elements per seeded block of a table (256 Ki: 1 MiB of fp32). Part of the rule: changing
#: it changes every table's values.
BLOCK_ELEMENTS = 1 << 18

_MASK63 = (1 << 63) - 1


def seeded_generator_seed(seed: int, name: str) -> int:
    """A 63-bit seed for ``name`` (a tensor, a table block); the same on every rank and process."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seeded_generator_seed(seed, name))


# --------------------------------------------------------------------------------------------
# A thread-local mode that gives every random aten op an explicit generator.
# --------------------------------------------------------------------------------------------

#: Picks the generator of one random op: ``(target tensor or None, device) -> generator``.
Resolver = Callable[["torch.Tensor | None", torch.device], "torch.Generator | None"]

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _log_once(key: str, level: int, message: str, *args: Any) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.log(level, message, *args)


@functools.cache
def _generator_slot(op: Any) -> tuple[int, str] | None:
    """``(position, name)`` of the op's ``Generator?`` argument, or None."""
    schema = getattr(op, "_schema", None)  # higher-order operators have none
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if "Generator" in str(arg.type):
            return i, arg.name
    return None


@functools.cache
def _generator_overload(op: Any) -> Any:
    """The overload of ``op``'s packet that takes the same arguments plus a generator
    (``rand.default`` -> ``rand.generator``), or None."""
    names = {a.name for a in op._schema.arguments}
    packet = op.overloadpacket
    for overload in packet.overloads():
        other = getattr(packet, overload)
        slot = _generator_slot(other)
        if slot is None:
            continue
        if {a.name for a in other._schema.arguments} - {slot[1]} == names:
            return other
    return None


def _op_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None:
        device = torch.device(kwargs.get("device") or "cpu")
    if device.type == "cuda" and device.index is None:  # what the op will run on
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _ExplicitRng(TorchDispatchMode):
    """Fills the generator of random aten ops issued without one (this thread only)."""

    def __init__(self, resolve: Resolver) -> None:
        super().__init__()
        self._resolve = resolve

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        slot = _generator_slot(func)
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        if slot is None and not seeded:
            return func(*args, **kwargs)
        device = _op_device(args, kwargs)
        if device.type == "meta":
            return func(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("out")
        if slot is None:
            overload = _generator_overload(func)
            generator = self._resolve(target, device) if overload is not None else None
            if generator is None:
                _global_rng_used(func)
                return func(*args, **kwargs)
            return overload(*args, **kwargs, generator=generator)
        position, name = slot
        given = args[position] if position < len(args) else kwargs.get(name)
        if given is None:
            generator = self._resolve(target, device)
            if generator is None:
                _global_rng_used(func)
            elif position < len(args):
                args = (*args[:position], generator, *args[position + 1 :])
            else:
                kwargs[name] = generator
        return func(*args, **kwargs)


def _global_rng_used(func: Any) -> None:
    _log_once(
        f"global:{func}",
        logging.WARNING,
        "fastinit: %s draws from the global RNG during start-up (no generator variant, or none "
        "chosen for its device); replicated values it makes are verified after construction",
        func,
    )


@contextlib.contextmanager
def explicit_rng(resolve: Resolver) -> Iterator[None]:
    """Within the block, on this thread only, every random aten op issued without a generator
    draws from ``resolve(target, device)`` instead of the global RNG.

    ``target`` is the tensor the op fills (its first tensor argument or ``out``), or None for
    factory ops; a resolver returning None leaves that op to torch. Other threads are not
    affected: dispatch modes are per thread.
    """
    with _ExplicitRng(resolve):
        yield


@contextlib.contextmanager
def scratch_rng(seed: int, name: str) -> Iterator[None]:
    """Within the block, this thread's random ops without a generator draw from generators seeded
    by ``(seed, name, device)``: deterministic, and the global RNG is neither drawn nor reseeded.

    For construction code whose random values are overwritten afterwards (TorchRec's kernels
    initialise their weights before the sharded module's ``reset_parameters``), or any code that
    must not touch the global RNG.
    """
    generators: dict[torch.device, torch.Generator] = {}

    def resolve(_target: torch.Tensor | None, device: torch.device) -> torch.Generator:
        g = generators.get(device)
        if g is None:
            g = generators[device] = _generator(seed, f"{name}\0scratch\0{device}", device)
        return g

    with explicit_rng(resolve):
        yield


# --------------------------------------------------------------------------------------------
# Tables: fixed row blocks, seeded by (seed, FQN, block).
# --------------------------------------------------------------------------------------------

_ELEMENTWISE_INITS: tuple[Any, ...] = (
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.constant_,
    torch.nn.init.ones_,
    torch.nn.init.zeros_,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.fill_,
    torch.Tensor.zero_,
)


def _unwrap(init_fn: Any) -> tuple[Any, dict[str, Any]]:
    keywords: dict[str, Any] = {}
    fn = init_fn
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return fn, keywords


def is_elementwise(init_fn: Any) -> bool:
    """Whether ``init_fn`` fills each element independently of the tensor's shape, so that a
    table can be generated block by block (uniform, normal, trunc_normal, constant, ones, zeros,
    and ``functools.partial`` of them: TorchRec's default ``init_fn``)."""
    fn, keywords = _unwrap(init_fn)
    return any(fn is f for f in _ELEMENTWISE_INITS) and keywords.get("generator") is None


@functools.cache
def _takes_generator(fn: Any) -> bool:
    try:
        return "generator" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def block_rows(dim: int) -> int:
    """Rows per seeded block of a table ``dim`` wide (at least 1)."""
    return max(1, BLOCK_ELEMENTS // max(1, dim))


def _generation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return dtype
    return torch.float32  # fp8 and integer tables: generated in fp32 and cast, as TorchRec does


def _only(generator: torch.Generator) -> Resolver:
    """A resolver that gives every op on the generator's device that one generator."""

    def resolve(_target: torch.Tensor | None, device: torch.device) -> torch.Generator | None:
        return generator if device == generator.device else None

    return resolve


def _call_with(init_fn: Any, tensor: torch.Tensor, generator: torch.Generator) -> None:
    fn, _ = _unwrap(init_fn)
    if _takes_generator(fn):
        init_fn(tensor, generator=generator)
        return
    with explicit_rng(_only(generator)):
        init_fn(tensor)


# Below ATen's parallel grain size (32 Ki elements), so a CPU copy runs on this thread: a copy
# split across intra-op threads costs milliseconds when the cores are busy (measured here).
_SERIAL_COPY_ELEMENTS = 1 << 14


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type != "cpu" or dst.numel() <= _SERIAL_COPY_ELEMENTS:
        dst.copy_(src)
        return
    step = max(1, _SERIAL_COPY_ELEMENTS // max(1, dst.shape[1]))
    for i in range(0, dst.shape[0], step):
        dst[i : i + step].copy_(src[i : i + step])


#: A local piece of a table: ``(tensor, first global row, first global column)``.
Piece = tuple[torch.Tensor, int, int]


@torch.no_grad()
def init_table_shards(
    init_fn: Callable[[torch.Tensor], Any],
    fqn: str,
    seed: int,
    size: tuple[int, int],
    dtype: torch.dtype,
    pieces: Sequence[Piece],
) -> None:
    """Initialise this rank's pieces of the table ``fqn`` (full ``size`` = rows x dim).

    With an element-wise ``init_fn``, block ``b`` (rows ``[b R, (b + 1) R)``, R =
    :func:`block_rows` of the full dim) is generated at full width in ``dtype`` from a generator
    seeded by ``(seed, fqn, b)`` on the piece's device, and each piece copies its rows and columns
    out of the blocks it overlaps: a piece of ``h`` rows costs at most ``h + 2 R`` full-width rows
    of generation. Otherwise each piece is initialised on its own shape (stock behaviour) from a
    generator seeded by ``(seed, fqn, its offsets)``.
    """
    pieces = [p for p in pieces if p[0].numel() and p[0].device.type != "meta"]
    if not pieces:
        return
    if not is_elementwise(init_fn):
        _log_once(
            f"shape:{fqn}",
            logging.INFO,
            "fastinit: table %s: init_fn %r is not a known element-wise initialiser; each shard "
            "is initialised on its own shape (distinct per shard, but not plan-invariant)",
            fqn,
            init_fn,
        )
        for tensor, row, col in pieces:
            g = _generator(seed, f"{fqn}\0shard\0{row}\0{col}", tensor.device)
            with explicit_rng(_only(g)):
                init_fn(tensor)
        return
    rows, dim = size
    per_block = block_rows(dim)
    gen_dtype = _generation_dtype(dtype)
    # block index -> the pieces (and their row ranges) it feeds; one block in memory at a time
    by_block: dict[tuple[int, torch.device], list[Piece]] = {}
    for piece in pieces:
        tensor, row, _ = piece
        last = min(rows, row + tensor.shape[0])
        for b in range(row // per_block, -(-last // per_block)):
            by_block.setdefault((b, tensor.device), []).append(piece)
    for (b, device), feeds in sorted(by_block.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        start = b * per_block
        stop = min(rows, start + per_block)
        # A piece that holds the whole block (full width, contiguous, same dtype: table-wise,
        # row-wise, data-parallel) is generated in place; anything else copies out of a block.
        block = next(
            (
                view
                for tensor, row, col in feeds
                if col == 0
                and tensor.shape[1] == dim
                and tensor.dtype == gen_dtype
                and row <= start
                and stop <= row + tensor.shape[0]
                and (view := tensor[start - row : stop - row]).is_contiguous()
            ),
            None,
        )
        if block is None:
            block = torch.empty(stop - start, dim, dtype=gen_dtype, device=device)
        _call_with(init_fn, block, _generator(seed, f"{fqn}\0block\0{b}", device))
        for tensor, row, col in feeds:
            lo, hi = max(start, row), min(stop, row + tensor.shape[0])
            dst = tensor[lo - row : hi - row]
            src = block[lo - start : hi - start, col : col + tensor.shape[1]]
            if dst.data_ptr() != src.data_ptr():
                _copy(dst, src)


# --------------------------------------------------------------------------------------------
# Dense parameters and buffers on meta.
# --------------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _per_tensor_resolver(seed: int, module_path: str, owned: dict[str, torch.Tensor]) -> Resolver:
    """Generators keyed by the tensor an op fills: ``(seed, its FQN)``; anything else (a temporary
    the initialiser copies from) draws from one generator per module, ``(seed, module path)``."""
    by_storage = {k: name for name, t in owned.items() if (k := _storage_key(t)) is not None}
    generators: dict[tuple[str, torch.device], torch.Generator] = {}

    def resolve(target: torch.Tensor | None, device: torch.device) -> torch.Generator:
        key = _storage_key(target) if target is not None else None
        name = (by_storage.get(key) if key is not None else None) or f"{module_path}\0module"
        g = generators.get((name, device))
        if g is None:
            g = generators[(name, device)] = _generator(seed, name, device)
        return g

    return resolve


@torch.no_grad()
def materialize_dense(
    module: nn.Module, sharded: list[str], device: torch.device, seed: int
) -> None:
    """Materialise every meta parameter and buffer outside the ``sharded`` subtrees on ``device``.

    As ``DistributedModelParallel.init_parameters``: buffers become zeros, and a module that had a
    meta parameter runs its ``reset_parameters`` — here with explicit generators, one per tensor,
    seeded by ``(seed, tensor FQN)`` (:func:`explicit_rng`; the global RNG is never touched). A
    meta parameter that no ``reset_parameters`` initialises is zero (stock leaves it uninitialised
    memory). Parameters shared by several modules stay shared.
    """
    if "" in sharded:
        return
    prefixes = tuple(f"{p}." for p in sharded)
    made: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its materialised parameter
    uninitialised: list[str] = []
    for path, m in module.named_modules():
        if path in sharded or (prefixes and path.startswith(prefixes)):
            continue
        prefix = f"{path}." if path else ""
        fresh: list[str] = []
        for name, param in m._parameters.items():
            if not isinstance(param, torch.Tensor) or param.device.type != "meta":
                continue
            new = made.get(id(param))
            if new is None:
                new = nn.Parameter(
                    torch.zeros_like(param, device=device), requires_grad=param.requires_grad
                )
                made[id(param)] = new
                fresh.append(prefix + name)
            m._parameters[name] = new
        for name, buf in m._buffers.items():
            if isinstance(buf, torch.Tensor) and buf.device.type == "meta":
                m._buffers[name] = torch.zeros_like(buf, device=device)
        if not fresh:
            continue
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            uninitialised.extend(fresh)
            continue
        owned = {prefix + n: t for n, t in m._parameters.items() if isinstance(t, torch.Tensor)}
        owned.update({prefix + n: t for n, t in m._buffers.items() if isinstance(t, torch.Tensor)})
        with explicit_rng(_per_tensor_resolver(seed, path, owned)):
            reset()
    if uninitialised:
        shown = ", ".join(uninitialised[:8]) + (" ..." if len(uninitialised) > 8 else "")
        logger.warning(
            "fastinit: %d meta parameter(s) have no reset_parameters and start at zero: %s",
            len(uninitialised),
            shown,
        )
