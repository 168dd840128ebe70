"""``python -m benchmarks.baseline``: :func:`benchmarks.baseline.main.main`."""

import sys

from benchmarks.baseline.main import main

sys.argv[0] = "python -m benchmarks.baseline"  # what --help shows

main()
