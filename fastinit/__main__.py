"""``python -m fastinit``: the ``fastinit`` command (see :mod:`fastinit.cli`)."""

import sys

from fastinit.cli import main

sys.exit(main())
