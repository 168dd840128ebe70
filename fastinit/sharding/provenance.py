"""The old location of :mod:`fastinit.plan.provenance`: importing this gives that very module."""

import sys

from fastinit.plan import provenance as _moved

sys.modules[__name__] = _moved
