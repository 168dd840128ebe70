"""Compile and exercise the model on a fast batch without changing any training state.

:func:`compile_modules` compiles the chosen submodules in place (their ``forward`` is replaced, so
parameter names and state_dict keys do not change) and marks the batch dimension of their tensor
inputs dynamic, so a real batch of another size — or with other jagged lengths upstream — reuses
the compiled code instead of recompiling.

:func:`warm_up` runs forward and backward (or one step of a ``TrainPipelineSparseDist``) on a fast
batch inside :func:`preserved_state`, which snapshots and afterwards restores, bit for bit:

* every parameter, buffer and plain tensor attribute of every submodule — this includes the
  tables and optimizer states held inside FBGEMM's fused TBE kernels, which torchrec's fused
  embedding optimizers (e.g. EXACT_ROWWISE_ADAGRAD) update *during backward*;
* every gradient (``None`` stays ``None``);
* the state of the given optimizers (dense ones and torchrec's Keyed/Combined/fused ones);
* the CPU (and CUDA) random number generators.

What it does not restore, on purpose: Python-side counters that do not affect numbers (FBGEMM's
``step`` used for stats reporting), the lazily built input distribution of sharded modules (built
from the first batch's feature order, which is why a fast batch must present the features in the
pipeline's order), DDP's bucket rebuild, and a train pipeline's rewritten model.

The snapshot costs one copy of the rank's local model and optimizer state in host/device memory.

Collectives: a forward through sharded embedding modules issues all-to-alls and DDP's backward an
all-reduce, so warm-up on a sharded model is a collective stage (every rank runs it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CompileConfig",
    "WarmupConfig",
    "WarmupReport",
    "compile_modules",
    "compile_count",
    "preserved_state",
    "warm_up",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class CompileConfig:
    """What is compiled, and how."""

    targets: tuple[Any, ...] = ()
    """Submodules to compile: paths relative to the unwrapped model (``"over_arch"``; ``""`` is the
    whole model) or the modules themselves. Empty: nothing is compiled (warm-up still runs). A TorchRec trainer compiles its dense part;
    the sharded embedding modules need not be compiled."""
    backend: str = "inductor"
    """``torch.compile`` backend ("inductor"; "aot_eager" to check tracing cheaply)."""
    mode: str | None = None
    """``torch.compile`` mode."""
    fullgraph: bool = False
    """Fail on graph breaks instead of splitting."""
    batch_dim: int | None = 0
    """Dimension of every tensor input marked dynamic (the batch); None: leave it to dynamo."""

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            raise TypeError("targets must be a sequence of paths or modules, not one string")
        if self.batch_dim is not None and self.batch_dim < 0:
            raise ValueError(f"batch_dim must be >= 0, got {self.batch_dim}")


@dataclasses.dataclass(kw_only=True, slots=True)
class WarmupConfig:
    """How :func:`warm_up` runs."""

    compile: CompileConfig | None = None
    """Compile these targets first (None: compile nothing; already compiled modules are kept)."""
    steps: int = 1
    """Forward+backward passes on the fast batch (one compiles forward and backward)."""
    loss_fn: Callable[[Any], Any] | None = None
    """Maps the model's output to a scalar to differentiate; default: the output itself, or its
    first element for a tuple/list (TorchRec's ``(loss, aux)`` convention), summed if not scalar."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


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
    """Bytes copied to snapshot the state."""


_COMPILED_ATTR = "_fastinit_compiled"


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if type(model).__name__ == "DistributedModelParallel":
            model = model.module  # type: ignore[assignment]
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_modules(model: nn.Module, config: CompileConfig) -> list[str]:
    """Compile ``config.targets`` of ``model`` in place; returns the paths compiled now.

    Each target's ``forward`` becomes a compiled function (``torch.compile``) behind a small eager
    wrapper that marks dimension ``config.batch_dim`` of its tensor inputs dynamic. The module
    object, its parameters and state_dict keys are unchanged. Compilation itself happens at the
    first call. Targets already compiled by fastinit are skipped.

    Raises:
        AttributeError: a path names no submodule.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    root = _unwrap(model)
    compiled: list[str] = []
    for target in config.targets:
        if isinstance(target, str):
            module = root.get_submodule(target) if target else root
            path = target
        else:
            module, path = target, _path_of(root, target)
        if getattr(module, _COMPILED_ATTR, False):
            continue
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

        module.forward = forward
        setattr(module, _COMPILED_ATTR, True)
        compiled.append(path)
    return compiled


def _path_of(root: nn.Module, module: nn.Module) -> str:
    for path, m in root.named_modules():
        if m is module:
            return path
    return type(module).__name__


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


class _Snapshot:
    """Saved copies of every tensor of a model and its optimizers, restorable in place."""

    def __init__(self, model: nn.Module, optimizers: Sequence[Any]) -> None:
        import torch

        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.optimizers: list[tuple[Any, dict[Any, Any], list[dict[str, Any]]]] = []
        self.nbytes = 0
        self._covered: set[int] = set()
        self._seen: set[tuple[Any, ...]] = set()
        with torch.no_grad():
            for module in model.modules():
                for p in module.parameters(recurse=False):
                    self._add(p)
                    self.grads.append((p, p.grad, None if p.grad is None else self._clone(p.grad)))
                for b in module.buffers(recurse=False):
                    self._add(b)
                for value in vars(module).values():  # e.g. FBGEMM's iter_cpu
                    if isinstance(value, torch.Tensor):
                        self._add(value)
            for value in model.state_dict(keep_vars=True).values():
                for t in _local_tensors(value):
                    self._add(t)
            for opt in _leaf_optimizers(optimizers):
                self.optimizers.append((opt, self._save_state(opt.state), self._groups(opt)))
            self.cpu_rng = torch.get_rng_state()
            self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def _clone(self, t: torch.Tensor) -> torch.Tensor:
        self.nbytes += t.numel() * t.element_size()
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
        if (
            t.storage_offset() == 0
            and t.is_contiguous()
            and t.numel() * t.element_size() == storage.nbytes()
        ):
            self._covered.add(ptr)
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
                    values[k] = (v, [self._clone(t) for t in locals_])
                else:
                    values[k] = (v, copy.deepcopy(v))
            saved[param] = (entry, values)
        return saved

    @staticmethod
    def _groups(opt: Any) -> list[dict[str, Any]]:
        groups = getattr(opt, "param_groups", None) or []
        return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]

    def restore(self) -> None:
        import torch

        with torch.no_grad():
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
                        live.copy_(data)
                    entry[k] = original
                else:
                    entry[k] = copy_
            state[param] = entry


@contextlib.contextmanager
def preserved_state(model: nn.Module, optimizers: Sequence[Any] = ()) -> Iterator[int]:
    """Snapshot the model's and optimizers' state; restore it bit for bit on exit (also on error).

    Yields:
        The bytes the snapshot holds.
    """
    snapshot = _Snapshot(model, optimizers)
    try:
        yield snapshot.nbytes
    finally:
        snapshot.restore()


def _default_loss(output: Any) -> Any:
    loss = output[0] if isinstance(output, tuple | list) else output
    return loss if loss.dim() == 0 else loss.sum()


def _pipeline_step(pipeline: Any, batch: Any) -> None:
    """One ``progress`` of a TorchRec train pipeline on ``batch``, then an empty pipeline."""
    try:
        pipeline.progress(iter([batch]))
    finally:
        reset = getattr(pipeline, "reset", None)
        if callable(reset):
            reset()


def warm_up(
    model: nn.Module,
    batch: Any,
    *,
    optimizers: Sequence[Any] = (),
    pipeline: Any = None,
    config: WarmupConfig | None = None,
) -> WarmupReport:
    """Compile (optionally) and run forward+backward on ``batch``; leave every state as it was.

    Args:
        model: the model (plain, DDP- or DMP-wrapped).
        batch: a fast batch (:func:`fastinit.warmup.fast_batch`), on the model's device.
        optimizers: optimizers whose state must not change (dense ones; a DMP's fused optimizer is
            added automatically). The fused optimizer's tables and states are also restored
            through the module walk.
        pipeline: a ``TrainPipelineSparseDist`` (or any pipeline with ``progress``/``reset``): it
            runs one full step on the batch (priming its model rewrite and input dist), and its
            optimizer's state is restored too.
        config: compile targets and steps.

    Returns:
        A :class:`WarmupReport`.
    """
    from fastinit.warmup._torchrec import pipeline_optimizer

    config = config or WarmupConfig()
    start = time.perf_counter()
    graphs = compile_count()
    compiled = compile_modules(model, config.compile) if config.compile is not None else []
    opts = list(optimizers)
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        opts.append(fused)
    if pipeline is not None:
        opts.append(pipeline_optimizer(pipeline))
    loss_fn = config.loss_fn or _default_loss
    with preserved_state(model, opts) as nbytes:
        for _ in range(config.steps):
            if pipeline is not None:
                _pipeline_step(pipeline, batch)
            else:
                loss_fn(model(batch)).backward()
    return WarmupReport(
        seconds=time.perf_counter() - start,
        graphs_compiled=compile_count() - graphs,
        compiled_modules=compiled,
        snapshot_bytes=nbytes,
    )
