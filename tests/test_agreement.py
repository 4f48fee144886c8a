"""The cross-rank agreement check: a graph whose collectives differ across ranks never runs them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import FsdpGroups, make_backend

from fsdp_compile.safety import lockstep
from fsdp_compile.safety.agreement import GraphIdentity, fingerprint
from fsdp_compile.examples.launch import RankFailure, run_ranks

from .graph_utils import ThreeUnits, capture, shard_blocks_then_root


class RankDependent(ThreeUnits):
    """Rank 1 skips the middle unit: its graph issues different collectives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (i == 1 and dist.get_rank() == 1):
                x = torch.relu(layer(x))
        return x


def _run(model: nn.Module, **backend_kw: object) -> None:
    compiled = torch.compile(model, backend=make_backend(inductor=False, **backend_kw))
    compiled(torch.randn(4, 8)).sum().backward()


def rank_dependent_branch(rank: int, world: int) -> None:
    groups = FsdpGroups.create()
    _run(shard_blocks_then_root(RankDependent(), groups))


def one_rank_compiles(rank: int, world: int) -> None:
    groups = FsdpGroups.create()
    model = shard_blocks_then_root(ThreeUnits(), groups)
    if rank == 0:
        _run(model, agreement_timeout_s=3.0)


def same_graph_everywhere(rank: int, world: int) -> None:
    groups = FsdpGroups.create()
    _run(shard_blocks_then_root(ThreeUnits(), groups))


def stacks_of_different_lengths(rank: int, world: int) -> None:
    """Rank 1's stack has one block more, so its graph gathers more (NOTE [stacked blocks])."""
    from fsdp_compile import fully_shard
    from fsdp_compile.api.stack import BlockStack

    groups = FsdpGroups.create()
    torch.manual_seed(0)
    stack = fully_shard(BlockStack(nn.Linear(8, 8) for _ in range(2 + rank)), groups=groups)
    compiled = torch.compile(stack, backend=make_backend(inductor=False))
    compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()


def test_a_stack_of_another_length_on_one_rank_raises_instead_of_hanging() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(stacks_of_different_lengths, 2, timeout=120)
    message = str(info.value)
    assert message.count("the parameter sizes differ across ranks") >= 2, message


def test_rank_dependent_branch_raises_on_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(rank_dependent_branch, 2, timeout=120)
    message = str(info.value)
    for rank in (0, 1):
        assert f"--- rank {rank} raised" in message
    assert message.count("differs across ranks") >= 2
    assert "First difference at collective #" in message
    assert time.monotonic() - start < 90  # seconds, not a hang (most of it is start-up and tracing)


def test_a_rank_that_never_compiles_the_graph_is_named() -> None:
    """Rank 1 returns without compiling (and exits): rank 0 names it, well before the 3 s timeout would
    fire had rank 1 stayed alive."""
    with pytest.raises(RankFailure, match=r"rank 0 raised.*but rank 1 exited|ranks \[1\] to compile"):
        run_ranks(one_rank_compiles, 2, timeout=120)


def test_agreeing_ranks_run() -> None:
    run_ranks(same_graph_everywhere, 2, timeout=120)


def test_fingerprint_lists_collectives_in_order(groups: FsdpGroups) -> None:
    graphs = capture(shard_blocks_then_root(ThreeUnits(), groups), torch.randn(4, 8))
    fwd = fingerprint(graphs["forward"])
    # a flat shard is gathered as it is (NOTE [a flat gathers as it is] in passes/lower/bucket.py)
    gather = "all_gather_into_tensor"
    assert fwd[:3] == [
        f"{gather}(unit 0, group g0, float32[36])",
        f"{gather}(unit 1, group g0, float32[36])",
        f"wait({gather}, unit 0)",
    ]
    assert sum(e.startswith("reduce_scatter") for e in fingerprint(graphs["backward"])) == 3


def test_a_failed_collective_is_noted_once_with_the_graph_last_checked_in_with(fake_world: int) -> None:
    """(NOTE [lockstep]) The error of a collective that fails inside a compiled graph gets one note naming
    that graph (the one this process last checked in with) and what the peers do, through both the
    graph's wrapper and the Dynamo-level one; other errors pass untouched."""
    graph = GraphIdentity(kind="backward", collectives=("reduce_scatter(unit 0, group g0, float32[4])",),
                          groups=((0, 1),), timeout_s=1.0)
    lockstep._state.get().last = graph

    def failing(error: Exception) -> Any:
        def run(args: list[Any]) -> None:
            raise error
        return lockstep.note_failures(lockstep.note_failures(run, boxed=True))

    with pytest.raises(RuntimeError) as info:
        failing(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation"))([])
    (note,) = info.value.__notes__
    assert note.startswith("fsdp_compile: a collective of a backward graph with 1 collectives failed on rank 0. "
                           "Its peers: rank 1:"), note
    with pytest.raises(ValueError) as other:
        failing(ValueError("not a collective"))([])
    assert not getattr(other.value, "__notes__", None)
