"""Fixtures shared by the test files."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest


@pytest.fixture
def fastinit_logger_restored() -> Iterator[None]:
    """``fastinit.cli.main`` configures the ``fastinit`` logger; other tests get it back as it was."""
    log = logging.getLogger("fastinit")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:] = saved[0]
    log.setLevel(saved[1])
    log.propagate = saved[2]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the checkpoint staging buffers the session's ranks left in /dev/shm (they end with
    os._exit, as a crashed trainer would, so they keep them for a restart)."""
    from fastinit.checkpoint import tier

    tier.reclaim(launcher=os.getpid())  # this session's: others may run beside it
