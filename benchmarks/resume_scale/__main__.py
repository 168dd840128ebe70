"""``python -m benchmarks.resume_scale``: :func:`benchmarks.resume_scale.main.main`."""

import sys

from benchmarks.resume_scale.main import main

sys.argv[0] = "python -m benchmarks.resume_scale"  # what --help shows

main()
