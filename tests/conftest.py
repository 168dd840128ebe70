"""Fixtures shared by the test files."""

from __future__ import annotations

import logging
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
