"""``FsdpModule``: the class a ``fully_shard`` call mixes into the module's class, as FSDP2 does; its state
lives in the unit registry (``units.py``).

NOTE [outlined units]: a whole-model graph hands AOTAutograd and Inductor one copy of the block's ops per
block. Dynamo still traces every outline candidate (its class carries ``OUTLINE_CANDIDATE``) inline, so its
guards are plain ``torch.compile``'s; the backend then gives blocks whose traced graphs are the same
program one ``invoke_subgraph`` body, compiled once (NOTE [outlining by proof] in
``passes/capture/outline.py``). Their markers name no unit (NOTE [anonymous reads] in ``markers.py``), so
alike blocks trace alike; the backend hoists them to each call (``passes/capture/hoist.py``), and the passes
schedule collectives across units as in a whole-model graph. By default a unit is a candidate when it holds
no other unit and shares its ``forward`` with another such unit; ``fully_shard(outline=)`` decides otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fsdp_compile._compat import assume_constant_result, traced_for
from fsdp_compile.api.accumulate import set_requires_gradient_sync
from fsdp_compile.api.flat_shard import refresh_flat
from fsdp_compile.api.units import unit_of

__all__ = ["OUTLINES", "OUTLINE_CANDIDATE", "FsdpModule", "forward_of", "is_outline_candidate", "mix_in", "outlining",
           "reading_flats"]


class FsdpModule:
    """Methods every ``fully_shard``-ed module gains."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's name for :func:`fsdp_compile.set_requires_gradient_sync` on this module."""
        assert isinstance(self, nn.Module)
        set_requires_gradient_sync(self, requires_gradient_sync, recurse=recurse)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to``, ``to_empty``), then the unit's flat laid out again if needed."""
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        unit = unit_of(self)  # type: ignore[arg-type]
        if unit is not None:
            refresh_flat(unit)
        return out


_classes: dict[tuple[type, bool], type] = {}

# Set on the class ``fully_shard`` mixes into an outline candidate (NOTE [outlined units]).
OUTLINE_CANDIDATE = "_fsdp_outline_candidate"


def _base(cls: type) -> type:
    """The class ``fully_shard`` found (the user's, or parametrize's made from it)."""
    if issubclass(cls, FsdpModule):
        return next(b for b in cls.__bases__ if b is not FsdpModule)
    return cls


def forward_of(module: nn.Module) -> Callable[..., Any]:
    """The user's ``forward`` function of ``module``'s class."""
    return _base(type(module)).forward


def is_outline_candidate(cls: type) -> bool:
    """Whether modules of ``cls`` are outline candidates (NOTE [outlined units])."""
    return bool(getattr(cls, OUTLINE_CANDIDATE, False))


@assume_constant_result
def outlining() -> bool:
    """NOTE [regions for our backend only]: whether the graph being traced goes to a backend of
    ``make_backend`` that keeps outlined bodies (and so traces a ``BlockStack`` once); others get a
    whole-model graph."""
    return bool(getattr(traced_for(), OUTLINES, False))


# The attribute a backend function of make_backend carries: True when it keeps outlined bodies.
OUTLINES = "fsdp_compile_outlines"


@assume_constant_result
def reading_flats() -> bool:
    """Whether the graph being traced goes to a backend of ``make_backend``, which reads flat shards."""
    return hasattr(traced_for(), OUTLINES)


def mix_in(module: nn.Module, *, outlined: bool = False) -> None:
    """Make ``module`` an ``FsdpModule`` too, an outline candidate when ``outlined``."""
    base = _base(type(module))
    key = (base, outlined)
    if key not in _classes:
        body: dict[str, Any] = {OUTLINE_CANDIDATE: True} if outlined else {}
        _classes[key] = type(f"Fsdp{base.__name__}", (FsdpModule, base), body)
    module.__class__ = _classes[key]
