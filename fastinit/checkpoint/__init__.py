"""Checkpoints around training: how often to save, and publishing a model from a checkpoint.

``import fastinit.checkpoint`` loads neither torch nor torchrec: names are imported on first use.

* :func:`choose_interval` — the checkpoint interval minimising unsaved work plus blocking.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastinit.checkpoint.interval import IntervalChoice, choose_interval, format_choice

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("IntervalChoice", "choose_interval", "format_choice"), "interval"),
}

__all__ = ["IntervalChoice", "choose_interval", "format_choice"]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastinit.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fastinit.checkpoint.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
