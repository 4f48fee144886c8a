from __future__ import annotations

from collections.abc import Iterator

import pytest

from fsdp_compile import FsdpGroups

from . import graph_utils


@pytest.fixture
def fake_world() -> Iterator[int]:
    """A fake default process group of 2 ranks (rank 0) in this process; no real communication."""
    with graph_utils.fake_process_group(2):
        yield 2


@pytest.fixture
def groups(fake_world: int) -> Iterator[FsdpGroups]:
    g = FsdpGroups.create()
    yield g
    g.destroy()
