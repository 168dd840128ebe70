"""``python -m benchmarks.ttfb``: :func:`benchmarks.ttfb.main.main`."""

import sys

from benchmarks.ttfb.main import main

sys.argv[0] = "python -m benchmarks.ttfb"  # what --help shows

main()
