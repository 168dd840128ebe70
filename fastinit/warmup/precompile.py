"""Precompiled compile targets: Dynamo's output kept across jobs, so a restart does not trace.

With ``CompileConfig(precompile=True)`` each compile target is compiled at its first call by
Dynamo's ahead-of-time path (``torch.compile(..., fullgraph=True).aot_compile``, torch 2.13's
``torch._dynamo.aot_compile.aot_compile_fullgraph``): one full graph with its guards, forward and
backward lowered eagerly and bundled (AOTAutograd's bundled cache entry), in a form
:meth:`AOTCompiledFunction.serialize` turns into bytes. :class:`fastinit.warmup.CompileCache` saves
those bytes in its entry after the first compiled step and hands them back on the next start,
where ``torch.compiler.load_compiled_function``'s loader
(:meth:`AOTCompiledFunction.deserialize`) rebuilds the callable: the first step of a warm restart
runs the compiled code with no Dynamo trace, no guard building and no cache look-ups.

The target's module is passed as an argument (``forward.__func__(module, *args)``), so its
parameters and buffers are graph inputs read at each call, never constants baked into the
artifact: the artifact holds code only, and the same artifact serves any values of the same
shapes (a restart from a checkpoint).

Guards are checked at every call (Dynamo's guard manager, restored from the artifact; it keeps the
guards that can be serialised: input tensor dtypes, shapes and the dynamic batch dimension's
range, module attributes such as ``training``). Whatever does not match — another model, batch
schema, dtype, a batch of 1 where the batch dimension was compiled dynamic — is a miss for that
call, logged once with the guard's reason, and served by the fallback:

1. a loaded artifact that does not fit, or none: compile ahead of time now (Inductor's caches,
   which the compile cache's MegaCache file or Inductor directory may have filled, serve what they
   can), and that compiled form is what :meth:`CompileCache.save` writes;
2. a target that cannot be compiled ahead of time (a graph break — ``aot_compile`` needs one full
   graph — or an input Dynamo cannot serialise guards for): plain ``torch.compile``, as without
   ``precompile``, logged with the reason.

Numerics: the run that writes an artifact runs that same compiled code (it is compiled once, used,
then saved), so a restart that loads it computes what the writer computed, bit for bit on CPU.
It is not the same code as plain ``torch.compile`` (the backward is lowered eagerly, the graph is
captured whole), so the two paths may differ in the last bits of floating point.

**Artifacts are code**, like every compile-cache entry: the same ownership rules apply (see
:mod:`fastinit.warmup.compile_cache`).
"""

from __future__ import annotations

import copy
import io
import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from fastinit.warmup.targets import CompileConfig

logger = logging.getLogger(__name__)

__all__ = ["PrecompiledTarget"]


def _guard_reason(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The first failing guard, as Dynamo words it."""
    try:
        manager = compiled._artifacts.guard_manager
        info = manager.check_verbose(compiled.prepare_f_locals(*args, **kwargs))
        parts = getattr(info, "verbose_code_parts", None)
        return "; ".join(str(p) for p in parts) if parts else str(info)
    except Exception as e:  # noqa: BLE001 - a reason we cannot word is still a miss
        return f"guards failed ({type(e).__name__})"


class PrecompiledTarget:
    """A compile target's ``forward`` with a precompiled form (see the module docstring).

    Args:
        path: the target's path (for messages and the cache).
        module: the target module.
        config: the compile settings (backend, mode, batch dimension).
        data: the serialised form a previous job saved (None: none).
        fallback: the plain ``torch.compile`` forward, for inputs the precompiled form cannot take.
    """

    def __init__(
        self,
        path: str,
        module: nn.Module,
        config: CompileConfig,
        data: bytes | None,
        fallback: Any,
        background: bool = False,
    ) -> None:
        self.path = path
        self.config = config
        self.fallback = fallback
        self._func = _plain_function(module)
        self._module = module
        self._compiled: Any = None
        self._lock = threading.Lock()
        self.background = background
        """Compile on another thread (on a copy of the module); calls run eager meanwhile, and
        :meth:`swap_in` (at a step boundary) makes the compiled form serve the next calls."""
        self._thread: threading.Thread | None = None
        self.status = "none"
        """"loaded" (a saved artifact, not yet called), "hit" (it served a call), "compiled"
        (compiled ahead of time by this job: :meth:`serialize` has something to save),
        "unsupported" (plain ``torch.compile`` serves every call) or "none" (not called yet)."""
        self.reason = ""
        """Why the saved artifact, or the ahead-of-time compile, was not used."""
        self.calls = 0
        """Calls the precompiled form served."""
        self.fallback_calls = 0
        """Calls the plain ``torch.compile`` fallback served."""
        self.eager_calls = 0
        """Calls run eager while the background compile ran."""
        if self._func is None:
            self._unsupported("its forward is not a method of its class")
        elif data is not None:
            self._load(data)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Dynamo pickles the target module's state (this object is its ``forward``) with the
        # guards it saves: stand in for the compiled code and its lock with the path alone.
        return _saved_as_path, (self.path,)

    # -- loading and compiling -----------------------------------------------------------------

    def _load(self, data: bytes) -> None:
        import torch

        try:
            compiled: Any = torch.compiler.load_compiled_function(io.BytesIO(data))
            compiled.disable_guard_check()  # checked here, with a reason on a miss
        except Exception as e:  # noqa: BLE001 - an artifact that does not load is a miss
            self._miss(f"the saved artifact does not load: {type(e).__name__}: {e}")
            return
        self._compiled = compiled
        self.status = "loaded"

    def _compile(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None = None
    ) -> None:
        import torch

        module = self._module if module is None else module
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):
                wrapper: Any = torch.compile(
                    self._func,
                    fullgraph=True,
                    backend=self.config.backend,
                    mode=self.config.mode,
                )
            with warnings.catch_warnings():
                # Saving the guards reads ``.grad`` of every input (non-leaf ones warn).
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor")
                compiled = wrapper.aot_compile(((module, *args), kwargs))
            compiled.disable_guard_check()
        except Exception as e:  # noqa: BLE001 - not precompilable: plain torch.compile
            self._unsupported(f"aot_compile failed: {type(e).__name__}: {str(e)[:500]}")
            return
        self._compiled = compiled
        self.status = "compiled"

    def _miss(self, why: str) -> None:
        self.reason = why
        logger.info(
            "fastinit: precompiled %s not used (%s); compiling it ahead of time now", self.path, why
        )
        self._compiled = None
        self.status = "none"

    def _unsupported(self, why: str) -> None:
        self.reason = why
        logger.warning(
            "fastinit: %s cannot be precompiled (%s); using torch.compile", self.path, why
        )
        self._compiled = None
        self.status = "unsupported"

    # -- calling -------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._ready(args, kwargs)
        if compiled is _EAGER:
            self.eager_calls += 1
            return self._func(self._module, *args, **kwargs)
        if compiled is None:
            self.fallback_calls += 1
            return self.fallback(*args, **kwargs)
        self.calls += 1
        return compiled(self._module, *args, **kwargs)

    def _ready(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The precompiled form if its guards accept these inputs, else None (compiling it first
        when there is none yet)."""
        with self._lock:
            if self.background:
                if self._thread is None and self._compiled is None:  # nothing was loaded
                    self._start_background(args, kwargs)
                if self._thread is not None:  # compiling: eager until swap_in
                    return _EAGER
                self.background = False  # a saved form was loaded: nothing to compile
            if self.status == "unsupported":
                return None
            if self._compiled is not None:
                if self._compiled.guard_check(self._module, *args, **kwargs):
                    if self.status == "loaded":
                        self.status = "hit"
                    return self._compiled
                if self.status == "loaded":  # the saved artifact is for other inputs
                    self._miss(
                        f"guards: {_guard_reason(self._compiled, (self._module, *args), kwargs)}"
                    )
                else:  # compiled for the first inputs; these differ (e.g. a batch of 1)
                    logger.info(
                        "fastinit: precompiled %s does not take these inputs (%s); torch.compile",
                        self.path,
                        _guard_reason(self._compiled, (self._module, *args), kwargs),
                    )
                    return None
            self._mark_dynamic(args, kwargs)
            self._compile(args, kwargs)
            return self._compiled

    # -- compiling in the background -----------------------------------------------------------

    def _start_background(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Compile on a thread, on copies: of the module (its values are read by the compiled
        code as inputs, so a copy compiles the same code) and of these inputs (same shapes,
        dtypes, ``requires_grad``), so training goes on undisturbed on the originals."""
        import torch
        from torch.utils._pytree import tree_map

        def clone(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().clone().requires_grad_(x.requires_grad)
            return x

        with torch.no_grad():
            module = copy.deepcopy(self._module)
            example_args, example_kwargs = tree_map(clone, (args, kwargs))
        if module.__dict__.get("forward") is self:
            del module.__dict__["forward"]  # the copy runs its class's forward

        def run() -> None:  # what it sets is read only once background is off (swap_in)
            with _BACKGROUND_COMPILES:  # Dynamo's compile state is per process: one at a time
                self._mark_dynamic(example_args, example_kwargs)
                self._compile(example_args, example_kwargs, module)

        self.status = "compiling"
        self._thread = threading.Thread(target=run, name=f"fastinit-compile-{self.path}")
        self._thread.daemon = True
        self._thread.start()

    def swap_in(self, wait: float | None = 0.0) -> bool:
        """At a step boundary: let the background-compiled form serve the next calls, if it is
        done (waiting up to ``wait`` seconds; None: until it is). Returns whether it now does."""
        thread = self._thread
        if thread is None:
            return self._compiled is not None
        thread.join(wait)
        if thread.is_alive():
            return False
        with self._lock:
            self.background = False
            self._thread = None
            return self._compiled is not None

    def _mark_dynamic(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        dim = self.config.batch_dim
        if dim is None:
            return
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
                torch._dynamo.maybe_mark_dynamic(leaf, dim)

    # -- saving --------------------------------------------------------------------------------

    def serialize(self) -> bytes | None:
        """The compiled form to save: only what this job compiled ahead of time (None otherwise,
        or if it cannot be serialised — logged)."""
        if self.status != "compiled" or self._compiled is None:
            return None
        try:
            return bytes(type(self._compiled).serialize(self._compiled).serialized_data)
        except Exception as e:  # noqa: BLE001 - not savable: the next job compiles again
            logger.warning(
                "fastinit: precompiled %s cannot be saved (%s: %s)", self.path, type(e).__name__, e
            )
            return None


_BACKGROUND_COMPILES = threading.Lock()
_EAGER = object()  # _ready's answer while a background compile runs: run this call eager


def _plain_function(module: nn.Module) -> Any:
    """``module.forward`` as a function of ``(module, *args)``, or None when the instance's forward
    is not its class's method (replaced, wrapped)."""
    forward = module.forward
    func = getattr(forward, "__func__", None)
    if func is None or getattr(forward, "__self__", None) is not module:
        return None
    return func


def _saved_as_path(path: str) -> str:
    """What a pickled :class:`PrecompiledTarget` becomes (see its ``__reduce__``)."""
    return path
