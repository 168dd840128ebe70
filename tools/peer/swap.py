"""The swap, installed in every process of a peer run (the pytest process and each rank).

:func:`install` adds an import hook: when a module of TorchRec's test utilities
(``torchrec.distributed.test_utils.*``) or of its tests (``torchrec.distributed.tests.*``) has
been executed, every global of it that is ``DistributedModelParallel`` is replaced by
:class:`SwappedDMP`, whose call is ``fastinit.setup(...)`` with the same arguments. Nothing else
is touched: ``torchrec.distributed.model_parallel.DistributedModelParallel`` itself, and every
other module's reference to it, stay TorchRec's. ``isinstance(x, <the swapped name>)`` still
answers for the real class, so type checks in the utilities keep working.

Every call is logged as one JSON line (pid, device, outcome) to the file given to
:func:`install`, so a run can prove the swap took effect.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["PREFIXES", "SwappedDMP", "install"]

#: Modules whose ``DistributedModelParallel`` globals are swapped.
PREFIXES = ("torchrec.distributed.test_utils.", "torchrec.distributed.tests.")

_log_path: str | None = None
_log_lock = threading.Lock()


def _real_dmp() -> type:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return DistributedModelParallel


def _log(record: dict[str, Any]) -> None:
    if _log_path is None:
        return
    line = json.dumps({"pid": os.getpid(), **record}, sort_keys=True)
    with _log_lock, open(_log_path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


class _SwapMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _real_dmp())

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _real_dmp())

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        import fastinit

        device = kwargs.get("device", args[2] if len(args) > 2 else None)
        try:
            model = fastinit.setup(*args, **kwargs)
        except BaseException as e:
            _log({"device": str(device), "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
            raise
        _log({"device": str(device), "ok": True})
        return model


class SwappedDMP(metaclass=_SwapMeta):
    """Stands for ``DistributedModelParallel`` in the test utilities; calling it calls
    ``fastinit.setup`` (which returns a real ``DistributedModelParallel``)."""


def _swap_globals(module: types.ModuleType) -> None:
    real = _real_dmp()
    for name, value in list(vars(module).items()):
        if value is real:
            setattr(module, name, SwappedDMP)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the modules in :data:`PREFIXES`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PREFIXES):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original(module)
            _swap_globals(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(log_path: str | None) -> None:
    """Swap ``DistributedModelParallel`` in the test utilities of this process (idempotent).

    Args:
        log_path: file every ``fastinit.setup`` call made through the swap is logged to.
    """
    global _log_path
    _log_path = log_path
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, module in list(sys.modules.items()):  # already imported: swap now
        if name.startswith(PREFIXES) and module is not None:
            _swap_globals(module)
