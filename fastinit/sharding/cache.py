"""The old location of :mod:`fastinit.plan.cache`: importing this gives that very module."""

import sys

from fastinit.plan import cache as _moved

sys.modules[__name__] = _moved
