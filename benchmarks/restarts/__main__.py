"""``python -m benchmarks.restarts``: :func:`benchmarks.restarts.main.main`."""

import sys

from benchmarks.restarts.main import main

sys.argv[0] = "python -m benchmarks.restarts"  # what --help shows

main()
