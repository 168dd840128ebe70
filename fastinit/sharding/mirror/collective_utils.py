"""Mirrors ``torchrec/distributed/collective_utils.py``: ``init_collective_validation``
(:func:`set_collective_validation`), with rank 0's value already agreed by fastinit's start-up
exchange, so no broadcast. Sets the module's ``_INITIALIZED`` and ``_USE_COLLECTIVE_VALIDATION``
as the upstream function does.
"""

from __future__ import annotations

__all__ = ["set_collective_validation"]


def set_collective_validation(enabled: bool) -> None:
    """Configure TorchRec's collective validation as ``init_collective_validation`` would, with
    rank 0's value already known, so DMP's own call returns at once (no broadcasts)."""
    from torchrec.distributed import collective_utils

    if collective_utils._INITIALIZED:
        return
    collective_utils._USE_COLLECTIVE_VALIDATION = enabled
    collective_utils._INITIALIZED = True
