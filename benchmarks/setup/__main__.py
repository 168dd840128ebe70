"""``python -m benchmarks.setup``: :func:`benchmarks.setup.main.main`."""

import sys

from benchmarks.setup.main import main

sys.argv[0] = "python -m benchmarks.setup"  # what --help shows

main()
