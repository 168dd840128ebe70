"""Compile and exercise the model on a fast batch without changing what the job trains.

:func:`compile_modules` compiles the chosen submodules in place (their ``forward`` is replaced, so
parameter names and state_dict keys do not change) and marks the batch dimension of their tensor
inputs dynamic, so a real batch of another size — or with other jagged lengths upstream — reuses
the compiled code instead of recompiling.

:func:`warm_up` runs forward and backward (or one step of a ``TrainPipelineSparseDist``) on a fast
batch inside :func:`preserved_state`, which afterwards restores:

* **values, bit for bit**: the rows of the embedding tables the warm-up step looked up and their
  fused optimizer state (torchrec's fused optimizers, e.g. EXACT_ROWWISE_ADAGRAD, update the
  looked-up rows *during backward*); every other parameter, buffer and tensor attribute (dense
  parameters, data-parallel tables, counters); every gradient (``None`` stays ``None``); the
  state of the given optimizers; the CPU (and CUDA) random number generators;
* **what TorchRec derives from the first batch it sees**: each sharded module's input
  distribution (the feature order ``_features_order``, the per-sharding feature splits, the
  input-dist modules, mean-pooling and variable-batch helpers), restored to "not yet built"; and a
  train pipeline's state (its model rewrite, queued batches and contexts, counters), so the real
  first batch builds all of it exactly as in a job without warm-up, whatever its feature order.

Only touched rows are copied: the snapshot is the size of the dense part plus a few rows per
table, not a copy of the tables (``WarmupConfig(snapshot="full")`` copies everything, the
behaviour of earlier versions; a TBE with a device-side software cache is always copied whole).

Not restored, and why it cannot change training: compiled code and dynamo's caches (the point of
warm-up); DDP's gradient-bucket rebuild, whose order follows the autograd graph, not the batch.

Collectives: a forward through sharded embedding modules issues all-to-alls and DDP's backward an
all-reduce, so warm-up on a sharded model is a collective stage (every rank runs it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fastinit import compat
from fastinit.warmup.targets import CompileConfig, resolve_targets, unwrap

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fastinit.warmup.compile_cache import CompileCache

__all__ = [
    "StateSnapshot",
    "set_thread_device",
    "WarmupConfig",
    "WarmupReport",
    "compile_modules",
    "compile_count",
    "preserved_state",
    "swap_in_compiled",
    "warm_up",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class WarmupConfig:
    """How :func:`warm_up` runs."""

    compile: CompileConfig | None = None
    """Compile these targets first (None: compile nothing; already compiled modules are kept)."""
    steps: int = 1
    """Forward+backward passes on the fast batch (one compiles forward and backward)."""
    snapshot: str = "touched"
    """"touched": fused tables are saved row by row as the step looks them up (a few rows per
    table); "full": every local tensor is copied whole (costs a copy of the rank's model)."""
    compile_in_background: bool = False
    """Opt-in: do not compile before the first step. The targets are installed (precompiled
    form, :attr:`CompileConfig.precompile` implied) and the warm-up steps are skipped; a target
    without a saved form compiles on another thread from its first real call while the first
    steps run eager, and :func:`swap_in_compiled` at a step boundary switches it to the
    compiled code. Numerics: eager steps and compiled steps may differ in the last bits (on
    Inductor; ``aot_eager`` runs the same kernels), so the steps before the swap train what
    eager trains, the later ones what the compiled code trains. Off by default."""
    loss_fn: Callable[[Any], Any] | None = None
    """Maps the model's output to a scalar to differentiate; default: the output itself, or its
    first element for a tuple/list (TorchRec's ``(loss, aux)`` convention), summed if not scalar."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.snapshot not in ("touched", "full"):
            raise ValueError(f"snapshot must be 'touched' or 'full', got {self.snapshot!r}")


@dataclasses.dataclass(kw_only=True, slots=True)
class WarmupReport:
    """What :func:`warm_up` did."""

    seconds: float
    """Wall time of the warm-up (compilation included)."""
    graphs_compiled: int
    """Graphs dynamo compiled during the warm-up."""
    compiled_modules: list[str]
    """Paths of the modules compiled by this call."""
    snapshot_bytes: int
    """Bytes the snapshot held at its largest (the extra memory warm-up needed for it)."""
    model_bytes: int = 0
    """Local bytes of the model and optimizer state (what a whole copy would hold)."""


_COMPILED_ATTR = "_fastinit_compiled"


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_modules(
    model: nn.Module, config: CompileConfig, cache: CompileCache | None = None
) -> list[str]:
    """Compile ``config.targets`` of ``model`` in place; returns the paths compiled now.

    Each target's ``forward`` becomes a compiled function (``torch.compile``) behind a small eager
    wrapper that marks dimension ``config.batch_dim`` of its tensor inputs dynamic. The module
    object, its parameters and state_dict keys are unchanged. Compilation itself happens at the
    first call. Targets already compiled by fastinit are skipped.

    With ``config.precompile``, each target is a :class:`fastinit.warmup.precompile.
    PrecompiledTarget`: the form ``cache`` restored for it (a previous job's), else compiled ahead
    of time at the first call and registered with ``cache`` for :meth:`CompileCache.save`.

    Raises:
        AttributeError: a path names no submodule.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    compiled: list[str] = []
    for path, module in resolve_targets(model, config.targets):
        if getattr(module, _COMPILED_ATTR, False):
            continue
        if config.precompile:
            # The precompiled form serves the calls; plain torch.compile only what it cannot
            # take. torch.compile imports Inductor's lowering and kernel templates at once
            # (about 1 s per process on a CPU): a warm restart that loads its artifacts never
            # pays that unless a call falls back.
            fn: Any = _LazyCompile(module.forward, config)
        else:
            fn = torch.compile(
                module.forward, backend=config.backend, mode=config.mode, fullgraph=config.fullgraph
            )
        dim = config.batch_dim

        def forward(*args: Any, _fn: Any = fn, _dim: int | None = dim, **kwargs: Any) -> Any:
            if _dim is not None:
                for leaf in tree_leaves((args, kwargs)):
                    if isinstance(leaf, torch.Tensor) and leaf.dim() > _dim:
                        torch._dynamo.maybe_mark_dynamic(leaf, _dim)
            return _fn(*args, **kwargs)

        forward.compiled = fn  # type: ignore[attr-defined]
        if config.precompile:
            from fastinit.warmup.precompile import PrecompiledTarget

            data = cache.precompiled_artifact(path) if cache is not None else None
            target = PrecompiledTarget(
                path, module, config, data, fallback=forward, background=config.background
            )
            if cache is not None:
                cache.track(target)
            module.forward = target
        else:
            module.forward = forward
        setattr(module, _COMPILED_ATTR, True)
        compiled.append(path)
    return compiled


class _LazyCompile:
    """``torch.compile(forward, ...)``, made at the first call (once, under a lock)."""

    def __init__(self, forward: Any, config: CompileConfig) -> None:
        self._forward = forward
        self._config = config
        self._fn: Any = None
        self._lock = threading.Lock()

    @property
    def built(self) -> bool:
        """Whether a call needed it (``torch.compile`` was called)."""
        return self._fn is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        if fn is None:
            with self._lock:
                if self._fn is None:
                    import torch

                    config = self._config
                    self._fn = torch.compile(
                        self._forward,
                        backend=config.backend,
                        mode=config.mode,
                        fullgraph=config.fullgraph,
                    )
                fn = self._fn
        return fn(*args, **kwargs)


def swap_in_compiled(model: nn.Module, wait: float | None = 0.0) -> list[str]:
    """At a step boundary (after ``optimizer.step()``, before the next forward): let every
    target compiled in the background (:attr:`WarmupConfig.compile_in_background`) serve the
    next calls, if its compile is done (waiting up to ``wait`` seconds each; None: until done).
    Parameters, gradients and optimizer state are the module's own throughout (the compile ran
    on copies), so nothing else changes at the swap. Returns the paths swapped in now or
    before."""
    from fastinit.warmup.precompile import PrecompiledTarget

    out = []
    for path, module in unwrap(model).named_modules():
        target = module.__dict__.get("forward")
        if isinstance(target, PrecompiledTarget) and target.swap_in(wait):
            out.append(path)
    return out


# -- state snapshot ----------------------------------------------------------------------------


def _local_tensors(obj: Any) -> list[torch.Tensor]:
    """The local tensors behind a tensor, ShardedTensor or DTensor (others: none)."""
    import torch

    if hasattr(obj, "local_shards") and callable(obj.local_shards):
        return [shard.tensor for shard in obj.local_shards()]
    if hasattr(obj, "to_local") and hasattr(obj, "placements"):
        return [obj.to_local()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    return []


def _leaf_optimizers(optimizers: Iterable[Any]) -> list[Any]:
    """Optimizers that own a ``state`` dict: CombinedOptimizers are opened, duplicates dropped."""
    from fastinit.warmup._torchrec import combined_children

    out: list[Any] = []
    seen: set[int] = set()
    stack = list(optimizers)[::-1]
    while stack:
        opt = stack.pop()
        if opt is None:
            continue
        children = combined_children(opt)
        if children is not None:
            stack.extend(reversed(children))
            continue
        state = getattr(opt, "state", None)
        if isinstance(state, dict) and id(state) not in seen:
            seen.add(id(state))
            out.append(opt)
    return out


def _all_modules(model: nn.Module) -> list[nn.Module]:
    """Every module reachable from ``model``: registered children, and modules held in plain
    attributes or lists (TorchRec's sharded modules keep their lookups - and so FBGEMM's kernels
    with the tables - in a plain list, which ``modules()`` does not visit)."""
    from torch import nn

    out: list[nn.Module] = []
    seen: set[int] = set()
    stack: list[nn.Module] = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        children: list[nn.Module] = list(module._modules.values())  # type: ignore[arg-type]
        for value in vars(module).values():
            if isinstance(value, nn.Module):
                children.append(value)
            elif isinstance(value, list | tuple):
                children.extend(v for v in value if isinstance(v, nn.Module))
        stack.extend(reversed([c for c in children if c is not None]))
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_whole(t: torch.Tensor) -> bool:
    """``t`` spans its whole storage."""
    return (
        t.device.type != "meta"
        and t.storage_offset() == 0
        and t.is_contiguous()
        and _nbytes(t) == t.untyped_storage().nbytes()
    )


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _contents(value: Any) -> Any:
    """A shallow copy of a mutable container's contents (None for anything else)."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, set):
        return set(value)
    if type(value).__name__ == "deque":
        return list(value)
    return None


class _Bindings:
    """An object's attribute bindings, restorable: attributes added later are removed, rebound
    ones rebound, and mutable containers (lists, dicts, sets, deques) get their contents back in
    place (hook handles and other holders of those containers stay valid)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.saved = {k: (v, _contents(v)) for k, v in vars(obj).items()}

    def restore(self) -> None:
        live = vars(self.obj)
        for key in [k for k in live if k not in self.saved]:
            del live[key]
        for key, (value, contents) in self.saved.items():
            if contents is not None:
                if isinstance(value, dict | set):
                    value.clear()
                    value.update(contents)
                else:  # list or deque
                    value.clear()
                    value.extend(contents)
            live[key] = value


class _TouchedRows:
    """Rows of one FBGEMM TBE's tables (and their optimizer states) saved as the warm-up step
    looks them up, before its backward updates them."""

    def __init__(
        self,
        snapshot: StateSnapshot,
        module: nn.Module,
        tables: tuple[list[torch.Tensor], list[list[torch.Tensor]], list[int]],
    ) -> None:
        self.snapshot = snapshot
        self.weights, self.states, self.feature_table = tables
        self.saved: dict[int, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}
        self.rows: dict[int, torch.Tensor] = {}
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def views(self) -> list[torch.Tensor]:
        return [*self.weights, *(s for per_table in self.states for s in per_table)]

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        names = ("indices", "offsets", "per_sample_weights", "feature_requires_grad")
        bound = dict(zip(names, args)) | kwargs
        indices, offsets = bound["indices"], bound["offsets"]
        per_rank = bound.get("batch_size_per_feature_per_rank")
        features = len(self.feature_table)
        if per_rank is not None:
            bags = [sum(b) for b in per_rank]
        else:
            bags = [(offsets.numel() - 1) // max(features, 1)] * features
        with torch.no_grad():
            offsets = offsets.to("cpu", torch.int64)
            bounds = [0]
            for b in bags:
                bounds.append(bounds[-1] + b)
            for f, table in enumerate(self.feature_table):
                lo, hi = int(offsets[bounds[f]]), int(offsets[bounds[f + 1]])
                if hi > lo:
                    self._save(table, indices[lo:hi])

    def _save(self, table: int, ids: torch.Tensor) -> None:
        import torch

        weight = self.weights[table]
        rows = torch.unique(ids.to(weight.device, torch.int64))
        rows = rows[(rows >= 0) & (rows < weight.shape[0])]
        done = self.rows.get(table)
        if done is not None:
            rows = rows[~torch.isin(rows, done)]
            self.rows[table] = torch.cat([done, rows])
        else:
            self.rows[table] = rows
        if rows.numel() == 0:
            return
        saved = (rows, [self.snapshot._clone(weight[rows], row=True)])
        for state in self.states[table]:
            saved[1].append(self.snapshot._clone(state[rows.to(state.device)], row=True))
        self.snapshot.nbytes += _nbytes(rows)
        self.saved.setdefault(table, []).append(saved)

    def restore(self) -> None:
        for table, entries in self.saved.items():
            targets = [self.weights[table], *self.states[table]]
            for rows, values in entries:
                for target, value in zip(targets, values):
                    target[rows.to(target.device)] = value


class StateSnapshot:
    """What a warm-up step can change, saved so it can be put back in place (see the module
    docstring); ``touched_rows=False`` copies every table whole."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[Any],
        pipeline: Any = None,
        *,
        touched_rows: bool = True,
    ) -> None:
        import torch

        from fastinit.warmup._torchrec import fused_tables, is_sharded_module

        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.optimizers: list[tuple[Any, dict[Any, Any], list[dict[str, Any]]]] = []
        self.nbytes = 0
        self.model_bytes = 0
        self._covered: set[int] = set()
        self._seen: set[tuple[Any, ...]] = set()
        self._by_rows: set[int] = set()
        self.rows: list[_TouchedRows] = []
        self.bindings: list[_Bindings] = []
        self.pipeline = pipeline
        self.pipeline_was_rewritten = False
        modules = _all_modules(model)
        try:
            if pipeline is not None:
                from fastinit.warmup._torchrec import pipeline_rewrote_model

                self.pipeline_was_rewritten = pipeline_rewrote_model(pipeline)
                self.bindings.append(_Bindings(pipeline))
            with torch.no_grad():
                for module in modules:
                    if is_sharded_module(module):
                        self.bindings.append(_Bindings(module))
                    tables = fused_tables(module) if touched_rows else None
                    if tables is not None:
                        touched = _TouchedRows(self, module, tables)
                        self.rows.append(touched)
                        for view in touched.views():
                            if view.numel() and _ptr(view) not in self._by_rows:
                                self._by_rows.add(_ptr(view))
                                self.model_bytes += view.untyped_storage().nbytes()
                found: list[torch.Tensor] = []
                for module in modules:
                    for p in module.parameters(recurse=False):
                        found.append(p)
                        grad = None if p.grad is None else self._clone(p.grad)
                        self.grads.append((p, p.grad, grad))
                    found.extend(module.buffers(recurse=False))
                    found.extend(  # e.g. FBGEMM's iter_cpu
                        v for v in vars(module).values() if isinstance(v, torch.Tensor)
                    )
                for value in model.state_dict(keep_vars=True).values():
                    found.extend(_local_tensors(value))
                # Whole storages first, so views into them (a table's shards) are not copied twice.
                for t in sorted(found, key=lambda t: not _is_whole(t)):
                    self._add(t)
                for opt in _leaf_optimizers(optimizers):
                    self.optimizers.append((opt, self._save_state(opt.state), self._groups(opt)))
                self.cpu_rng = torch.get_rng_state()
                self.cuda_rng = (
                    torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
                )
        except BaseException:
            self._unhook()
            raise

    def _clone(self, t: torch.Tensor, *, row: bool = False) -> torch.Tensor:
        self.nbytes += _nbytes(t)
        if not row:  # a whole copy: part of what a full snapshot holds
            self.model_bytes += _nbytes(t)
        return t.detach().clone()

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.numel() == 0:
            return
        t = t.detach()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._covered:
            return
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in self._seen:
            return
        self._seen.add(key)
        whole = t.storage_offset() == 0 and t.is_contiguous() and _nbytes(t) == storage.nbytes()
        if whole:
            self._covered.add(ptr)
        if ptr in self._by_rows:  # a fused table or its state: saved row by row
            return
        self.tensors.append((t, self._clone(t)))

    def _save_state(self, state: dict[Any, Any]) -> dict[Any, Any]:
        saved: dict[Any, Any] = {}
        for param, entry in state.items():
            if not isinstance(entry, dict):
                saved[param] = (entry, copy.deepcopy(entry))
                continue
            values: dict[str, Any] = {}
            for k, v in entry.items():
                locals_ = _local_tensors(v)
                if locals_:
                    copies = [None if self._saved_elsewhere(t) else self._clone(t) for t in locals_]
                    values[k] = (v, copies)
                else:
                    values[k] = (v, copy.deepcopy(v))
            saved[param] = (entry, values)
        return saved

    def _saved_elsewhere(self, t: torch.Tensor) -> bool:
        """``t`` lies in a storage saved whole, or row by row, already."""
        if t.numel() == 0:
            return False
        if _ptr(t) in self._by_rows:
            return True
        return _ptr(t) in self._covered

    @staticmethod
    def _groups(opt: Any) -> list[dict[str, Any]]:
        groups = getattr(opt, "param_groups", None) or []
        return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]

    def _unhook(self) -> None:
        for touched in self.rows:
            touched.handle.remove()

    def restore(self) -> None:
        """Put back everything the snapshot holds."""
        import torch

        self._unhook()
        if self.pipeline is not None and not self.pipeline_was_rewritten:
            from fastinit.warmup._torchrec import pipeline_rewrote_model

            if pipeline_rewrote_model(self.pipeline):
                self.pipeline.detach()  # puts back forwards and postprocs it rewrote
        for bindings in self.bindings:
            bindings.restore()
        with torch.no_grad():
            for touched in self.rows:
                touched.restore()
            for live, saved in self.tensors:
                live.copy_(saved)
            for p, grad, saved_grad in self.grads:
                if grad is None:
                    p.grad = None
                else:
                    assert saved_grad is not None
                    grad.copy_(saved_grad)
                    p.grad = grad
            for opt, saved_state, groups in self.optimizers:
                self._restore_state(opt.state, saved_state)
                for group, saved_group in zip(getattr(opt, "param_groups", []) or [], groups):
                    group.update(saved_group)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    @staticmethod
    def _restore_state(state: dict[Any, Any], saved: dict[Any, Any]) -> None:
        for param in [p for p in state if p not in saved]:
            del state[param]
        for param, (entry, values) in saved.items():
            if not isinstance(entry, dict):
                state[param] = values
                continue
            for k in [k for k in entry if k not in values]:
                del entry[k]
            for k, (original, copy_) in values.items():
                if isinstance(copy_, list):
                    for live, data in zip(_local_tensors(original), copy_):
                        if data is not None:
                            live.copy_(data)
                    entry[k] = original
                else:
                    entry[k] = copy_
            state[param] = entry


@contextlib.contextmanager
def preserved_state(
    model: nn.Module,
    optimizers: Sequence[Any] = (),
    *,
    pipeline: Any = None,
    touched_rows: bool = True,
) -> Iterator[StateSnapshot]:
    """Snapshot what a training step can change; put it back on exit (also on error).

    Args:
        model: the model (plain, DDP- or DMP-wrapped).
        optimizers: optimizers whose state must come back too.
        pipeline: a TorchRec train pipeline whose state (model rewrite, queued batches) must come
            back too.
        touched_rows: save fused tables row by row as they are looked up (False: whole).

    Yields:
        The snapshot: ``nbytes`` is what it holds (it grows as rows are looked up),
        ``model_bytes`` the local model and optimizer bytes a whole copy would hold.
    """
    snapshot = StateSnapshot(model, optimizers, pipeline, touched_rows=touched_rows)
    try:
        yield snapshot
    finally:
        snapshot.restore()


def _default_loss(output: Any) -> Any:
    loss = output[0] if isinstance(output, tuple | list) else output
    return loss if loss.dim() == 0 else loss.sum()


def _pipeline_step(pipeline: Any, batch: Any) -> None:
    """One ``progress`` of a TorchRec train pipeline on ``batch`` (its state is restored later)."""
    pipeline.progress(iter([batch]))


def set_thread_device(device: Any) -> None:
    """Make ``device`` the current CUDA device of the calling thread (no-op for other devices).

    The CUDA current device is per thread: a stage running on a worker thread starts on
    ``cuda:0`` unless it sets its own.
    """
    import torch

    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def _batch_device(batch: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_leaves

    if hasattr(batch, "__dict__"):
        leaves = [*vars(batch).values()]
    else:
        leaves = tree_leaves(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
        device = getattr(leaf, "device", None)
        if callable(device):
            return device()
    return None


def warm_up(
    model: nn.Module,
    batch: Any,
    *,
    optimizers: Sequence[Any] = (),
    pipeline: Any = None,
    config: WarmupConfig | None = None,
    compile_cache: CompileCache | None = None,
) -> WarmupReport:
    """Compile (optionally) and run training steps on ``batch``; leave training as it was.

    Afterwards the model, the optimizers, the pipeline and the RNG are as before the call (see
    the module docstring), including what TorchRec derives from the first batch it sees: the
    real first batch, in whatever feature order the pipeline uses, sets it up as in a job without
    warm-up. The warm-up batch should still have the pipeline's form
    (:func:`fastinit.warmup.schema_from_batch`, :func:`fastinit.warmup.check_batch`), or the
    compiled code is exercised on another input than the job's.

    Args:
        model: the model (plain, DDP- or DMP-wrapped).
        batch: a fast batch (:func:`fastinit.warmup.fast_batch`), on the model's device.
        optimizers: optimizers whose state must not change (dense ones; a DMP's fused optimizer is
            added automatically).
        pipeline: a ``TrainPipelineSparseDist`` (or any pipeline with ``progress``): it runs
            full steps on the batch (forward, backward, its optimizer's step), and then its own
            state and its optimizer's are restored too.
        config: compile targets, steps, snapshot mode.
        compile_cache: the restored cache entry that serves and keeps precompiled targets
            (``CompileConfig(precompile=True)``; see :func:`compile_modules`).

    Returns:
        A :class:`WarmupReport`.
    """
    from fastinit.warmup._torchrec import pipeline_optimizer

    compat.require("warmup")
    config = config or WarmupConfig()
    start = time.perf_counter()
    set_thread_device(_batch_device(batch))
    graphs = compile_count()
    if config.compile_in_background and config.compile is not None:
        background = dataclasses.replace(config.compile, precompile=True, background=True)
        compiled = compile_modules(model, background, compile_cache)
        return WarmupReport(
            seconds=time.perf_counter() - start,
            graphs_compiled=0,
            compiled_modules=compiled,
            snapshot_bytes=0,
        )
    compiled = (
        compile_modules(model, config.compile, compile_cache) if config.compile is not None else []
    )
    opts = list(optimizers)
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        opts.append(fused)
    if pipeline is not None:
        opts.append(pipeline_optimizer(pipeline))
    loss_fn = config.loss_fn or _default_loss
    touched = config.snapshot == "touched"
    with preserved_state(model, opts, pipeline=pipeline, touched_rows=touched) as snapshot:
        for _ in range(config.steps):
            if pipeline is not None:
                _pipeline_step(pipeline, batch)
            else:
                loss_fn(model(batch)).backward()
    return WarmupReport(
        seconds=time.perf_counter() - start,
        graphs_compiled=compile_count() - graphs,
        compiled_modules=compiled,
        snapshot_bytes=snapshot.nbytes,
        model_bytes=snapshot.model_bytes,
    )
