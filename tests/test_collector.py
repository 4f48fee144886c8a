"""NOTE [no full collections]: while our backend compiles (and, once ``fully_shard`` ran, while Dynamo
traces and builds guards), Python's collector runs no full collection; its settings are the user's again
afterwards."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import fsdp_compile.backend as backend
from fsdp_compile import make_backend
from fsdp_compile.backend import no_full_collections


def test_only_the_young_generations_are_collected_while_compiling() -> None:
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    with no_full_collections():
        seen.append(gc.get_threshold())
        with no_full_collections():  # nested: as the outer one left it
            seen.append(gc.get_threshold())
    assert seen[0][:2] == before[:2] and seen[0][2] > 10**9 and seen[1] == seen[0]
    assert gc.get_threshold() == before


def test_a_switched_off_collector_and_a_raised_error_are_left_as_they_were() -> None:
    before = gc.get_threshold()
    gc.disable()
    try:
        with no_full_collections():
            assert gc.get_threshold() == before and not gc.isenabled()
    finally:
        gc.enable()
    try:
        with no_full_collections():
            raise KeyError("inside")
    except KeyError:
        pass
    assert gc.get_threshold() == before


def test_the_backend_compiles_with_full_collections_held_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward and the backward (compiled at its first call) both see the raised threshold."""
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    original = backend._compile_graph

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(gc.get_threshold())
        return original(*args, **kw)

    monkeypatch.setattr(backend, "_compile_graph", spy)
    torch._dynamo.reset()
    compiled = torch.compile(nn.Linear(3, 3), backend=make_backend(inductor=False))
    compiled(torch.randn(2, 3)).sum().backward()
    assert len(seen) == 2 and all(t[2] > 10**9 for t in seen)
    assert gc.get_threshold() == before


def test_a_whole_compile_traces_and_builds_guards_with_full_collections_held_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [no full collections], for whole compiles: Dynamo's trace before the backend and its guards
    after it, not only the backend, once ``fully_shard`` (or our backend) has run in the process."""
    from fsdp_compile.collector import hold_full_collections_in_compiles

    torch._dynamo.reset()  # forgets every compile callback
    hold_full_collections_in_compiles()  # as fully_shard does
    before = gc.get_threshold()
    seen: dict[str, tuple[int, int, int]] = {}
    handler = torch._dynamo.callback_handler

    def at_start(_args: Any) -> None:  # registered after ours: runs after it
        seen.setdefault("trace", gc.get_threshold())

    guards = torch._dynamo.guards.CheckFunctionManager.__init__

    def spy(self: Any, *args: Any, **kw: Any) -> None:
        seen.setdefault("guards", gc.get_threshold())
        guards(self, *args, **kw)

    monkeypatch.setattr(torch._dynamo.guards.CheckFunctionManager, "__init__", spy)
    handler.register_start_callback(at_start)
    try:
        compiled = torch.compile(nn.Linear(3, 3), backend=make_backend(inductor=False))
        compiled(torch.randn(2, 3)).sum().backward()
    finally:
        handler.remove_start_callback(at_start)
    assert set(seen) == {"trace", "guards"} and all(t[2] > 10**9 for t in seen.values()), seen
    assert gc.get_threshold() == before  # the user's again once the compile ended


def test_a_backend_called_by_hand_leaves_the_collector_as_it_was() -> None:
    """Outside a Dynamo compile nothing would end a deferral: the backend defers only its own work."""
    from fsdp_compile.collector import defer_full_collections_while_compiling

    before = gc.get_threshold()
    defer_full_collections_while_compiling()  # what the backend does first
    assert gc.get_threshold() == before
