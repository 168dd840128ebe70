"""``python -m fastinit.checkpoint._writer_main FD``: the writer process (see ``writer.py``).

A module of its own so that the writer's classes keep their real module name in the messages
it pickles (``__main__`` would not resolve in the trainer).
"""

import sys

from fastinit.checkpoint.writer import main

sys.exit(main())
