"""The old location of :mod:`fastinit.plan._json`: importing this gives that very module."""

import sys

from fastinit.plan import _json as _moved

sys.modules[__name__] = _moved
