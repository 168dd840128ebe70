"""The old location of :mod:`fastinit.plan.validate`: importing this gives that very module."""

import sys

from fastinit.plan import validate as _moved

sys.modules[__name__] = _moved
