"""``python -m benchmarks.micro [pytest arguments]``: the micro-benchmarks (``make micro``).

``pytest benchmarks/micro --benchmark-only`` with the arguments given (``-k``, ``--benchmark-...``).
"""

import pathlib
import sys

import pytest

sys.exit(pytest.main([str(pathlib.Path(__file__).parent), "--benchmark-only", *sys.argv[1:]]))
