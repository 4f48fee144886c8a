"""Rank functions for tests/test_divergence.py: ranks that run different forwards while a peer is
already inside a collective, under the process group's default timeout (30 min on gloo)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from fsdp_compile import FsdpGroups, fully_shard, make_backend

from .misuse_workers import timed


class Blocks(nn.Module):
    """Three linear blocks; ``skip`` leaves one out (a keyword argument one rank passes alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: Tensor, skip: int | None = None) -> Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(block(x))
        return x


def _model(groups: FsdpGroups, backend_kw: dict[str, Any]) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Blocks()
    for block in model.blocks:
        fully_shard(block, groups=groups)
    fully_shard(model, groups=groups)
    return model, torch.compile(model, backend=make_backend(**backend_kw))


def _step(compiled: Any, **kw: Any) -> None:
    compiled(torch.randn(4, 8), **kw).sum().backward()


def diverging_forwards(rank: int, world: int, case: str, backend_kw: dict[str, Any]) -> None:
    """Two training steps on every rank, then ``case``: ``"skip-block"``, rank 0 runs a forward that
    skips a block (a new graph) while rank 1 trains on; ``"grad-vs-no-grad"``, rank 0 trains on while
    rank 1 runs a no-grad forward (an evaluation, compiled on every rank before); ``"idle"``, rank 0 runs
    the skipping forward while rank 1 sleeps outside any graph (alive, but it never comes)."""
    groups = FsdpGroups.create()
    _, compiled = _model(groups, backend_kw)
    for _ in range(2):
        _step(compiled)
    if case == "grad-vs-no-grad":
        with torch.no_grad():
            compiled(torch.randn(4, 8))
        _step(compiled)
    start = time.monotonic()
    try:
        if case == "idle" and rank == 1:
            time.sleep(20)
            return
        if case in ("skip-block", "idle"):
            _step(compiled, **({"skip": 1} if rank == 0 else {}))
        elif rank == 1:
            with torch.no_grad():
                compiled(torch.randn(4, 8))
        else:
            _step(compiled)
    except Exception as e:
        raise timed(start, e) from e
    raise AssertionError("the ranks diverged and nothing was raised")
