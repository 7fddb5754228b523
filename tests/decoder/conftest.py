"""Fixtures for the decoder tests that need a live server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.decoder.live import Source
from tests.plugins.clusters import ScratchDb


@pytest.fixture
def src(source_db: ScratchDb) -> Iterator[Source]:
    """A fresh source database wrapped for capturing pgoutput; cleaned up afterwards."""
    s = Source(source_db)
    try:
        yield s
    finally:
        s.close()
