"""``python -m benchmarks.warmup``: :func:`benchmarks.warmup.main.main`."""

import sys

from benchmarks.warmup.main import main

sys.argv[0] = "python -m benchmarks.warmup"  # what --help shows

main()
