"""The one canonical JSON form fastinit hashes and encodes (fingerprints, provenance, plan codec)."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any, *, allow_nan: bool = True) -> str:
    """``obj`` as canonical JSON: keys sorted, no whitespace, non-ASCII kept as is.

    Args:
        obj: a JSON-serialisable value.
        allow_nan: write NaN/Infinity as JavaScript literals (``json.dumps``'s default); False
            raises ``ValueError`` on them instead (the plan codec's strict form).

    Returns:
        The text; equal values give equal text.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan
    )
