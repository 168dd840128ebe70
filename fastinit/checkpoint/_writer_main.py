"""``python -m fastinit.checkpoint._writer_main FD``: the writer process (see ``writer.py``).

A module of its own so that the writer's classes keep their real module name in the messages
it pickles (``__main__`` would not resolve in the trainer).

It leaves with ``os._exit`` once ``main`` returned: every file it wrote is closed and synced by
then, and an interpreter that imported torch takes 0.7 s to tear itself down on a 2-core host
(measured), seconds a restarted worker would spend waiting for its predecessor's writer.
"""

import os
import sys

from fastinit.checkpoint.writer import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
