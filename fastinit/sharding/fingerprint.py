"""The old location of :mod:`fastinit.plan.fingerprint`: importing this gives that very module."""

import sys

from fastinit.plan import fingerprint as _moved

sys.modules[__name__] = _moved
