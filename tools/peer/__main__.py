"""``python -m tools.peer``: see :mod:`tools.peer.run`."""

from __future__ import annotations

import sys

from tools.peer.run import main

sys.exit(main())
