"""``python -m benchmarks.parts``: :func:`benchmarks.parts.main.main`."""

import sys

from benchmarks.parts.main import main

sys.argv[0] = "python -m benchmarks.parts"  # what --help shows

main()
