"""pytest plugin of a swapped peer run (``-p tools.peer.plugin``).

pytest imports every ``test_*.py`` module through its own assertion-rewriting import hook, which
sits in front of :mod:`tools.peer.swap`'s hook, so in the pytest process itself TorchRec's
``test_model_parallel_base.py`` and ``test_sharding.py`` load unswapped. The single-rank tests
call ``DistributedModelParallel`` there, so before each test the names of every test-utility
module already loaded are swapped again. The ranks a test spawns have no pytest hook: the import
hook swaps them as they load.
"""

from __future__ import annotations

import pytest

from tools.peer import swap


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    swap.swap_loaded()
