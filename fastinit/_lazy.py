"""The package faces' one way of being lazy: a public name is imported from its module on first
use, so ``import fastinit`` (or ``fastinit.checkpoint``, ...) loads neither torch nor torchrec.

Each face lists its names three times, each for its reader: ``__all__`` (star imports, docs), the
imports under ``TYPE_CHECKING`` (type checkers, editors) and the map given here (run time);
``tests/package/test_import.py`` checks that they agree.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package face ``package``.

    Args:
        package: the face's ``__name__``.
        exports: each public name -> the module that defines it, relative to ``package``
            (``".loading"``) or absolute (``"fastinit.errors"``); a name mapped to ``"." + name``
            is that submodule itself.

    Returns:
        ``(__getattr__, __dir__)``; a name, once imported, is kept in the face's namespace.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module, package)
        value = imported if module == f".{name}" else getattr(imported, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
