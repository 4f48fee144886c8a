from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compile import FsdpGroups


@pytest.fixture
def fake_world() -> Iterator[int]:
    """A fake default process group of 2 ranks (rank 0) in this process; no real communication."""
    assert not dist.is_initialized()
    torch._dynamo.reset()  # every test compiles new module instances: start below the recompile limit
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield 2
    finally:
        dist.destroy_process_group()


@pytest.fixture
def groups(fake_world: int) -> Iterator[FsdpGroups]:
    g = FsdpGroups.create()
    yield g
    g.destroy()
