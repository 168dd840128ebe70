"""What is compiled: :class:`CompileConfig` and its targets resolved on a model.

Shared by :mod:`fastinit.warmup.warmup` (which compiles), :mod:`fastinit.warmup.compile_cache`
(which keys its entries by the targets) and :mod:`fastinit.warmup.precompile`, none of which
imports another to reach it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CompileConfig", "resolve_targets"]


@dataclasses.dataclass(kw_only=True, slots=True)
class CompileConfig:
    """What is compiled, and how."""

    targets: tuple[Any, ...] = ()
    """Submodules to compile, each a dotted path relative to the *unwrapped* model (the module
    inside ``DistributedModelParallel`` / DDP; ``""`` is the whole model) or the module object.
    Empty: nothing is compiled (warm-up still runs). Compile the dense part; the sharded embedding
    modules need not (and, under a train pipeline, should not) be compiled. For TorchRec's
    ``DLRMTrain`` (``DLRMTrain.model`` is the ``DLRM``)::

        CompileConfig(targets=("model.dense_arch", "model.inter_arch", "model.over_arch"))

    :meth:`fastinit.warmup.CompileCache.for_targets` takes the same targets."""
    backend: str = "inductor"
    """``torch.compile`` backend ("inductor"; "aot_eager" to check tracing cheaply)."""
    mode: str | None = None
    """``torch.compile`` mode."""
    fullgraph: bool = False
    """Fail on graph breaks instead of splitting."""
    batch_dim: int | None = 0
    """Dimension of every tensor input marked dynamic (the batch); None: leave it to dynamo."""
    background: bool = False
    """With ``precompile``: compile on another thread, on a copy of each target, starting at its
    first call; calls run eager until :func:`swap_in_compiled` at a step boundary (see
    :attr:`WarmupConfig.compile_in_background`)."""
    precompile: bool = False
    """Compile each target ahead of time at its first call (one full graph, Dynamo's
    ``aot_compile``) so a :class:`fastinit.warmup.CompileCache` can save it and the next job load
    it with no Dynamo trace (:mod:`fastinit.warmup.precompile`). Off: plain ``torch.compile``."""

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            raise TypeError("targets must be a sequence of paths or modules, not one string")
        if self.batch_dim is not None and self.batch_dim < 0:
            raise ValueError(f"batch_dim must be >= 0, got {self.batch_dim}")


def unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if type(model).__name__ == "DistributedModelParallel":
            model = model.module  # type: ignore[assignment]
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            return model


def resolve_targets(model: nn.Module, targets: Iterable[Any]) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` for each compile target (see :attr:`CompileConfig.targets`).

    Raises:
        AttributeError: a path names no submodule of the unwrapped model.
    """
    root = unwrap(model)
    out: list[tuple[str, nn.Module]] = []
    for target in targets:
        if isinstance(target, str):
            out.append((target, root.get_submodule(target) if target else root))
        else:
            out.append((_path_of(root, target), target))
    return out


def _path_of(root: nn.Module, module: nn.Module) -> str:
    for path, m in root.named_modules():
        if m is module:
            return path
    return type(module).__name__
