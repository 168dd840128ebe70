"""``python -m benchmarks.planner``: :func:`benchmarks.planner.main.main`."""

import sys

from benchmarks.planner.main import main

sys.argv[0] = "python -m benchmarks.planner"  # what --help shows

sys.exit(main())
