"""(NOTE [no full collections]) While our backend compiles, and from its call to the end of that Dynamo
compile (guards included), Python's collector runs no full collection; its settings are the user's again
afterwards, and compiles of other backends are left alone."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import fsdp_compile.compiler.backend as backend
from fsdp_compile import make_backend
from fsdp_compile.compiler.backend import no_full_collections


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


def _thresholds_in_trace_and_guards(monkeypatch: pytest.MonkeyPatch, backend_fn: Any) -> dict[str, Any]:
    """The collector's thresholds seen at the start of a Dynamo compile (its trace) and in its guards."""
    seen: dict[str, tuple[int, int, int]] = {}
    handler = torch._dynamo.callback_handler

    def at_start(_args: Any) -> None:
        seen.setdefault("trace", gc.get_threshold())

    guards = torch._dynamo.guards.CheckFunctionManager.__init__

    def spy(self: Any, *args: Any, **kw: Any) -> None:
        seen.setdefault("guards", gc.get_threshold())
        guards(self, *args, **kw)

    monkeypatch.setattr(torch._dynamo.guards.CheckFunctionManager, "__init__", spy)
    handler.register_start_callback(at_start)
    try:
        compiled = torch.compile(nn.Linear(3, 3), backend=backend_fn)
        compiled(torch.randn(2, 3)).sum().backward()
    finally:
        handler.remove_start_callback(at_start)
    return seen


def test_our_compile_builds_guards_with_full_collections_held_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [no full collections], to the end of our compile: the guards Dynamo builds after our backend
    returned are covered too; the settings are the user's again once the compile ended."""
    torch._dynamo.reset()  # forgets every compile callback: the backend registers its own again
    before = gc.get_threshold()
    seen = _thresholds_in_trace_and_guards(monkeypatch, make_backend(inductor=False))
    assert seen["guards"][2] > 10**9, seen
    assert gc.get_threshold() == before


def test_a_compile_of_another_backend_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """After our backend ran in the process, a compile with another backend keeps the user's collector
    settings throughout: no process-wide effect."""
    torch._dynamo.reset()
    torch.compile(nn.Linear(3, 3), backend=make_backend(inductor=False))(torch.randn(2, 3)).sum().backward()
    before = gc.get_threshold()
    seen = _thresholds_in_trace_and_guards(monkeypatch, "eager")
    assert set(seen) == {"trace", "guards"} and all(t == before for t in seen.values()), seen
    assert gc.get_threshold() == before


def test_a_backend_called_by_hand_leaves_the_collector_as_it_was() -> None:
    """Outside a Dynamo compile nothing would end a deferral: the backend defers only its own work."""
    from fsdp_compile.compiler.collector import defer_full_collections_while_compiling

    before = gc.get_threshold()
    defer_full_collections_while_compiling()  # what the backend does first
    assert gc.get_threshold() == before
