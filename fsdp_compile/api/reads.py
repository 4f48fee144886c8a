"""How a sharded parameter is read: the marker compiled code calls, and the guard against gathering.

A sharded module's parameter is read through its class's ``__getattr__`` (``sharding.py`` installs it); read
while Dynamo traces it is one ``fsdp::unshard`` marker on the shard (NOTE [traced reads]), read eagerly it
gathers through parametrize.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from fsdp_compile.api.module import reading_flats
from fsdp_compile.api.units import FLATS, ShardedParam
from fsdp_compile.passes.graph_ops import UNSHARD_ARGS, arg_names

__all__ = ["accumulator", "eager_args", "forward_depth_hooks", "in_eager_forward", "install_read", "traced_unshard"]


def traced_unshard(plan: tuple, shard: Callable[[], Tensor], param: Callable[[], ShardedParam],
                   flat: bool = True) -> Tensor:
    """The marker compiled code calls (NOTE [traced reads]), its constants from ``plan``, a parameter's
    ``read_plan`` (NOTE [one guard per read]); ``shard()`` is its shard and ``param()`` the parameter, looked
    at only where they are read. It reads the parameter's piece of its unit's flat shard where it has one
    (NOTE [flat shards] in ``flat_shard.py``) and our backend compiles the trace, else ``shard()`` (always
    with ``flat=False``: a stacked block's, NOTE [stacked blocks]). A parameter unfrozen since its flat was
    laid out without gradients is read from its shard; only then is its ``requires_grad`` read, and
    guarded.

    NOTE [one guard per read]: every compiled call first checks the guards Dynamo made of what the trace
    read, and the first kernel waits for that check: the step's host time before the GPU has work. A read
    takes its constants from one tuple, the plan (the flat's key, the piece's offset, size and shape, the
    marker's arguments, whether the unit accumulates), which Dynamo guards as one value, where the fields
    apart were a guard each. It finds the flat in ``FLATS``, one path for all of a flat's members, where
    each member's own path to the flat made Dynamo add a Python guard that the paths lead to one tensor.
    The plan is rebuilt whenever a field it copies changes (``ShardedParam.replan``)."""
    key, offset, numel, piece_shape, args, accumulating = plan
    whole = FLATS[key] if key and flat else None
    if whole is not None and reading_flats() and (whole.requires_grad or not shard().requires_grad):
        piece = whole.narrow(0, offset, numel).view(piece_shape)
    else:
        piece = shard()
    args = [list(a) if isinstance(a, tuple) else a for a in args]  # the op's int[] and str[] as lists
    accumulators = [param().accumulator] if accumulating else None
    return torch.ops.fsdp.unshard(piece, *args, accumulators)[0]  # NOTE [outlined units]


def accumulator(p: ShardedParam) -> list[Tensor] | None:
    """The leaf a read passes while its unit accumulates without sync (NOTE [no-sync]), else ``None``."""
    return [p.accumulator] if p.unit.accumulating else None  # type: ignore[list-item]


_forwards = threading.local()  # how many units' forwards run eagerly on this thread

_BETWEEN = arg_names(UNSHARD_ARGS)[1:-1]  # fsdp::unshard's arguments between the shard and the accumulators


def read_args(values: dict[str, object]) -> tuple:
    """``fsdp::unshard``'s arguments between the shard and the accumulators, in order, from ``values`` by
    name (NOTE [one marker spec])."""
    return tuple(values[name] for name in _BETWEEN)


def eager_args(p: ShardedParam) -> tuple:
    """The marker arguments of an eager read of ``p``. NOTE [reading a sharded parameter]: inside a unit's
    forward a read is cast to the mixed-precision ``param_dtype`` (as compiled code reads it); outside
    any (initialising, ``load_state_dict``, inspecting) it is the parameter's own dtype, so what is
    written into it lands exactly, as on the unsharded model."""
    if getattr(_forwards, "depth", 0) > 0:
        return read_args(p.marker_values)
    return read_args({**p.marker_values, "param_dtype": None})


def in_eager_forward() -> bool:
    """Whether some unit's forward runs eagerly on this thread now."""
    return getattr(_forwards, "depth", 0) > 0


def forward_depth_hooks(module: nn.Module) -> None:
    """Count ``module``'s eager forwards on this thread (what :func:`eager_args` reads); nothing while
    Dynamo traces."""

    def enter(*_: object) -> None:
        if not torch.compiler.is_compiling():
            _forwards.depth = getattr(_forwards, "depth", 0) + 1

    def leave(*_: object) -> None:
        if not torch.compiler.is_compiling():
            _forwards.depth = max(getattr(_forwards, "depth", 0) - 1, 0)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def install_read(cls: type, name: str) -> None:
    """NOTE [traced reads]: ``module.<name>``, a sharded parameter of a module of class ``cls`` (parametrize's
    class for that module alone), read while Dynamo traces, calls the marker on the shard straight away;
    read eagerly, it is parametrize's property. Through parametrize, each read is two module calls (the
    parametrization list, then ``Unshard``) that Dynamo traces with their hook checks, about as much work as
    the rest of a block's tracing, and as many guards; this reads the same shard and makes the same marker
    call.

    NOTE [tag-safe reads]: the read is no property on the class. Parametrize's property moves to
    ``cls._fsdp_props``, and ``cls`` gets a ``__getattr__`` (Python calls it once the attribute is found
    nowhere else) and a ``__setattr__`` that hands an assigned tensor to the property's setter, as the
    property did. The trace then reads the plan from the module's own ``_fsdp_reads`` dict (name -> the
    parameter's ``read_plan``, a tuple of constants; ``None`` off the lean read). Dynamo guards a property
    by its getter's code and closure, per parameter, and torch 2.11 evaluates the guards of a module
    subtree holding one every call; a dict of constant tuples is what its recursive dict-tag check skips
    whole while the module's dict is unchanged, as it skips plain ``nn.Linear``'s parameters. That skip
    also skips a tensor's guards, and changing ``requires_grad`` changes no dict: on torch 2.11 plain
    ``torch.compile`` then runs a graph compiled for the old value (a parameter unfrozen gets no
    gradient). So a read of the shard itself (a stacked block's, a frozen flat's) reaches it through
    its ``ShardedParam``, an object the skip never covers: its guards, ``requires_grad`` among them, are
    checked every call. Only flat reads, whose flat is a global checked every call, are skipped. A parameter
    given parametrizations of its own besides ``Unshard`` leaves the lean read (``_Chain`` sets its plan to
    ``None``), so the trace guarding on it compiles again, through parametrize's path, which applies them
    all."""
    props = cls.__dict__.get("_fsdp_props")
    if props is None:
        props = dict(getattr(cls, "_fsdp_props", {}))  # a base's names too
        cls._fsdp_props = props  # type: ignore[attr-defined]
        cls.__getattr__ = _read_attr  # type: ignore[attr-defined]
        cls.__setattr__ = _write_attr  # type: ignore[method-assign]
    props[name] = cls.__dict__[name]
    delattr(cls, name)


def _read_attr(self: nn.Module, name: str) -> object:
    # Through the module's attributes (self._fsdp_reads, self._parameters), not self.__dict__[...] as
    # nn.Module.__getattr__ may: that is the one way Dynamo reaches them that keeps the module a subtree
    # its guards may skip.
    reads = getattr(self, "_fsdp_reads", None) if name != "_fsdp_reads" else None
    if reads is None:
        return nn.Module.__getattr__(self, name)
    if name not in reads:
        for kind in (self._parameters, self._buffers, self._modules):
            if name in kind:
                return kind[name]
        return nn.Module.__getattr__(self, name)  # its error
    plan = reads[name]
    if plan is not None and torch.compiler.is_compiling():
        param: Any = lambda: self._modules["parametrizations"]._modules[name]._modules["0"].param  # noqa: E731
        return traced_unshard(plan, lambda: param().shard, param)  # via the ShardedParam: NOTE [tag-safe reads]
    return type(self)._fsdp_props[name].fget(self)  # type: ignore[attr-defined]


def _write_attr(self: nn.Module, name: str, value: object) -> None:
    prop = type(self)._fsdp_props.get(name)  # type: ignore[attr-defined]
    if prop is not None and not isinstance(value, (nn.Parameter, nn.Module, nn.Buffer)):
        prop.fset(self, value)  # parametrize's setter: each parametrization's right_inverse
    else:
        nn.Module.__setattr__(self, name, value)

