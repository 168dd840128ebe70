"""``python -m benchmarks.scale``: :func:`benchmarks.scale.main.main`."""

import sys

from benchmarks.scale.main import main

sys.argv[0] = "python -m benchmarks.scale"  # what --help shows

main()
