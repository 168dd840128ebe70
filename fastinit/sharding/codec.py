"""The old location of :mod:`fastinit.plan.codec`: importing this gives that very module."""

import sys

from fastinit.plan import codec as _moved

sys.modules[__name__] = _moved
