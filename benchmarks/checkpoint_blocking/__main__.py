"""``python -m benchmarks.checkpoint_blocking``: :func:`benchmarks.checkpoint_blocking.main.main`."""

import sys

from benchmarks.checkpoint_blocking.main import main

if __name__ == "__main__":  # torch_checkpointing's writer process is spawned: not again there
    sys.argv[0] = "python -m benchmarks.checkpoint_blocking"  # what --help shows
    main(sys.argv[1:])
