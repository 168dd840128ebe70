"""What fastinit needs from the installed torch and TorchRec, checked in one place.

Every fastinit entry point that relies on TorchRec or torch internals calls :func:`require` with
its component name before touching them.
"""

from __future__ import annotations

from fastinit.errors import CompatibilityError

__all__ = ["CompatibilityError", "require"]

TORCHREC_VERSION = "1.8.0"


def require(component: str = "setup") -> None:
    """Raise :class:`CompatibilityError` unless ``component``'s TorchRec/torch touches are present."""
    import torchrec

    version = getattr(torchrec, "__version__", "unknown")
    if not str(version).startswith(TORCHREC_VERSION):
        raise CompatibilityError(
            f"fastinit ({component}) was written against torchrec {TORCHREC_VERSION}; found "
            f"{version}. Pass sharders explicitly or pin torchrec."
        )
