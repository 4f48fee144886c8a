"""``FsdpModule``: the class a ``fully_shard`` call mixes into the module's class, as FSDP2 does.

It adds methods only (``set_requires_gradient_sync``); all state lives in the unit registry
(``units.py``), none on the module. An *outlined* unit's class also compiles its forward once for every
unit of the same class (NOTE [outlined units]).

NOTE [outlined units]: a deep model is mostly one block repeated. A whole-model graph hands Dynamo,
AOTAutograd and Inductor one copy of the block's ops per block, so compile time grows with depth. An
outlined unit's ``forward`` is a ``torch.compiler.nested_compile_region``: Dynamo traces it once
(torch 2.11's Dynamo traces every call, so there we stamp later alike blocks out of the first one's
trace: NOTE [stamped blocks] in ``stamp.py``) and emits every block as a call of one
``invoke_subgraph`` body, which AOTAutograd partitions once and Inductor compiles once. For that, the body's trace must be the same for every block, and the
``fsdp::unshard`` markers inside it are what differ: each names its unit and parameter. So compiled code
passes the markers of outlined units without those two (``ShardedParam.traced_args``), and the backend
fills them in from the shards each call is handed, after it has moved the markers out of the body to
the call (``passes/hoist.py``). The outer graph then holds every unit's markers, as a whole-model graph
does, and the passes place all-gathers and reduce-scatters across unit boundaries exactly as before.

Which units: ``fully_shard(..., outline=None)`` (default) outlines a unit that holds no other unit and
shares its ``forward`` with at least one other such unit (the blocks of a transformer, not its root);
``outline=True`` or ``False`` decides for that unit. A forward that Dynamo cannot trace whole (a graph
break inside the block) cannot be a region: shard such blocks with ``outline=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch._dynamo.comptime import comptime

from . import stamp
from ._compat import compile_region, stamping, traced_for
from .accumulate import set_requires_gradient_sync
from .flat import refresh_flat
from .units import unit_of

__all__ = ["OUTLINES", "FsdpModule", "mix_in", "forward_of", "outlining"]


class FsdpModule:
    """Methods every ``fully_shard``-ed module gains."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's name for :func:`fsdp_compile.set_requires_gradient_sync` on this module."""
        assert isinstance(self, nn.Module)
        set_requires_gradient_sync(self, requires_gradient_sync, recurse=recurse)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to``, ``half``, ``to_empty``, ...), then the unit's flat shard laid out
        again from the converted parameters (NOTE [flat shards] in ``flat.py``)."""
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        unit = unit_of(self)  # type: ignore[arg-type]
        if unit is not None:
            refresh_flat(self, unit)  # type: ignore[arg-type]
        return out


_classes: dict[tuple[type, bool], type] = {}
_regions: dict[Callable[..., Any], Callable[..., Any]] = {}


def _base(cls: type) -> type:
    """The class ``fully_shard`` found (the user's, or the one parametrizations made from it)."""
    if issubclass(cls, FsdpModule):
        return next(b for b in cls.__bases__ if b is not FsdpModule)
    return cls


def forward_of(module: nn.Module) -> Callable[..., Any]:
    """The user's ``forward`` function of ``module``'s class (outlined units of one forward share a body)."""
    return _base(type(module)).forward


def _outlined_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` as a compile region when Dynamo traces it for ``fsdp_backend`` (with outlining on),
    else ``forward`` itself (eagerly, and for other backends: NOTE [regions for our backend only])."""
    if forward not in _regions:
        _regions[forward] = compile_region(forward)
    region = _regions[forward]

    before = stamp.before_call(forward)

    def outlined(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and outlining():
            if not stamping():
                return region(self, *args, **kwargs)
            comptime(before)  # NOTE [stamped blocks]
            plan = stamp.stamp_plan()
            if plan is not None:
                key, positional, places, others, spec = plan
                own = [*self._fsdp_shards, *stamp.read_own(self, others)]
                tensors = list(args) if positional else stamp.flat_tensors((args, kwargs), [])
                flat = stamp.stamped_call(key, tensors, own, places)
                return stamp.rebuild(spec, flat)
            out = region(self, *args, **kwargs)
            comptime(stamp.after_call)
            return out
        return forward(self, *args, **kwargs)

    outlined.__name__, outlined.__qualname__, outlined.__doc__ = forward.__name__, forward.__qualname__, forward.__doc__
    return outlined


@torch._dynamo.assume_constant_result
def outlining() -> bool:
    """NOTE [regions for our backend only]: whether the graph being traced goes to a backend of
    ``make_backend`` that keeps outlined bodies (and so traces a ``BlockStack``'s blocks once, NOTE
    [stacked blocks] in ``stack.py``). Other backends get the whole-model graph they always
    got: torch's Inductor, handed the same regions, computed wrong gradients (torch 2.13, a Llama block
    as a ``nested_compile_region`` under plain ``torch.compile``, no sharding: 5e-3 off; right with
    ``reorder_for_peak_memory`` or buffer reuse off), and ``make_backend(outline=False)`` wants none."""
    return bool(getattr(traced_for(), OUTLINES, False))


# The attribute a backend function of make_backend carries: True when it keeps outlined bodies.
OUTLINES = "fsdp_compile_outlines"


def mix_in(module: nn.Module, *, outlined: bool = False) -> None:
    """Make ``module`` an instance of ``FsdpModule`` too (one generated class per original class), whose
    ``forward`` is a compile region when ``outlined``."""
    base = _base(type(module))
    key = (base, outlined)
    if key not in _classes:
        body: dict[str, Any] = {}
        if outlined:
            body["forward"] = _outlined_forward(base.forward)
        _classes[key] = type(f"Fsdp{base.__name__}", (FsdpModule, base), body)
    module.__class__ = _classes[key]
