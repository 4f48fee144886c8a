"""``FsdpModule``: the class a ``fully_shard`` call mixes into the module's class, as FSDP2 does.

It adds methods only (``set_requires_gradient_sync``); all state lives in the unit registry
(``units.py``), none on the module. An *outlined* unit's class also compiles its forward once for every
unit of the same class (NOTE [outlined units]).

NOTE [outlined units]: a deep model is mostly one block repeated. A whole-model graph hands
AOTAutograd and Inductor one copy of the block's ops per block, so compile time grows with depth. The
blocks that ``fully_shard`` marks as outline candidates (their class carries ``OUTLINE_CANDIDATE``) are
still traced inline by Dynamo, every one of them, so Dynamo's guards are exactly plain
``torch.compile``'s; the backend then gives the blocks whose traced graphs are the same program one
``invoke_subgraph`` body, which AOTAutograd partitions once and Inductor compiles once (NOTE
[outlining by proof] in ``passes/capture/outline.py``). The ``fsdp::unshard`` markers inside a candidate's
forward carry no unit or parameter name, as no traced read does (NOTE [anonymous reads] in ``markers.py``),
so alike blocks trace alike; the backend moves them out of the body to each call
(``passes/capture/hoist.py``) and names them after the shards they read. The outer graph then holds every
unit's markers, as a whole-model graph does, and the passes place all-gathers and reduce-scatters across
unit boundaries exactly as before.

Which units: ``fully_shard(..., outline=None)`` (default) makes a candidate of a unit that holds no
other unit and shares its ``forward`` with at least one other such unit (the blocks of a transformer,
not its root); ``outline=True`` or ``False`` decides for that unit. Being a candidate never changes
what is computed: only blocks proven alike share a body.
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
        """``nn.Module._apply`` (``to``, ``half``, ``to_empty``, ...), then the unit's flat shard laid out
        again from the converted parameters (NOTE [flat shards] in ``flat_shard.py``)."""
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        unit = unit_of(self)  # type: ignore[arg-type]
        if unit is not None:
            refresh_flat(unit)
        return out


_classes: dict[tuple[type, bool], type] = {}

# Set on the class ``fully_shard`` mixes into an outline candidate (NOTE [outlined units]).
OUTLINE_CANDIDATE = "_fsdp_outline_candidate"


def _base(cls: type) -> type:
    """The class ``fully_shard`` found (the user's, or the one parametrizations made from it)."""
    if issubclass(cls, FsdpModule):
        return next(b for b in cls.__bases__ if b is not FsdpModule)
    return cls


def forward_of(module: nn.Module) -> Callable[..., Any]:
    """The user's ``forward`` function of ``module``'s class (candidates of one forward may share a body)."""
    return _base(type(module)).forward


def is_outline_candidate(cls: type) -> bool:
    """Whether modules of ``cls`` are outline candidates (NOTE [outlined units])."""
    return bool(getattr(cls, OUTLINE_CANDIDATE, False))


@assume_constant_result
def outlining() -> bool:
    """NOTE [regions for our backend only]: whether the graph being traced goes to a backend of
    ``make_backend`` that keeps outlined bodies (and so traces a ``BlockStack``'s blocks once, NOTE
    [stacked blocks] in ``stack.py``). Other backends get the whole-model graph they always got."""
    return bool(getattr(traced_for(), OUTLINES, False))


# The attribute a backend function of make_backend carries: True when it keeps outlined bodies.
OUTLINES = "fsdp_compile_outlines"


@assume_constant_result
def reading_flats() -> bool:
    """Whether the graph being traced goes to a backend of ``make_backend`` (every one carries
    ``OUTLINES``), which reads a unit's flat shard (NOTE [gradients through the parameters] in
    ``flat_shard.py``); another backend's graph reads each parameter's shard, as autograd sees it."""
    return hasattr(traced_for(), OUTLINES)


def mix_in(module: nn.Module, *, outlined: bool = False) -> None:
    """Make ``module`` an instance of ``FsdpModule`` too (one generated class per original class and
    ``outlined``), marked as an outline candidate when ``outlined`` (NOTE [outlined units])."""
    base = _base(type(module))
    key = (base, outlined)
    if key not in _classes:
        body: dict[str, Any] = {OUTLINE_CANDIDATE: True} if outlined else {}
        _classes[key] = type(f"Fsdp{base.__name__}", (FsdpModule, base), body)
    module.__class__ = _classes[key]
