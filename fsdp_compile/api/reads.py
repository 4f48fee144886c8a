"""How a sharded parameter is read: while Dynamo traces, one ``fsdp::unshard`` marker on the shard (NOTE
[traced reads]); eagerly, a gather through parametrize.
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
    """The marker compiled code calls (NOTE [traced reads]) with a parameter's ``read_plan``: on its piece of
    its flat (NOTE [flat shards] in ``flat_shard.py``) under our backend, else on ``shard()`` (a stacked
    block's, a parameter unfrozen since its flat was laid out frozen, another backend's).

    NOTE [one guard per read]: every compiled call first checks its guards, and the first kernel waits. A
    read takes its constants from one tuple, the plan, which Dynamo guards as one value, and finds the flat in
    ``FLATS``, one path for all of a flat's members. ``ShardedParam.replan`` rebuilds it on any change."""
    key, offset, numel, piece_shape, args, accumulating = plan
    whole = FLATS[key] if key and flat else None
    if whole is not None and reading_flats() and (whole.requires_grad or not shard().requires_grad):
        piece = whole.narrow(0, offset, numel).view(piece_shape)
    else:
        piece = shard()
    args = [list(a) if isinstance(a, tuple) else a for a in args]  # the op's int[] and str[] as lists
    accumulators = [param().accumulator] if accumulating else None
    return torch.ops.fsdp.unshard(piece, *args, accumulators)[0]


def accumulator(p: ShardedParam) -> list[Tensor] | None:
    """The leaf a read passes while its unit accumulates without sync (NOTE [no-sync]), else ``None``."""
    return [p.accumulator] if p.unit.accumulating else None  # type: ignore[list-item]


_forwards = threading.local()  # how many units' forwards run eagerly on this thread

_BETWEEN = arg_names(UNSHARD_ARGS)[1:-1]  # between the shard and the accumulators


def read_args(values: dict[str, object]) -> tuple:
    """``fsdp::unshard``'s arguments between the shard and the accumulators, from ``values`` by name."""
    return tuple(values[name] for name in _BETWEEN)


def eager_args(p: ShardedParam) -> tuple:
    """The marker arguments of an eager read of ``p``: cast to ``param_dtype`` inside a unit's forward (as
    compiled code reads it), the parameter's own dtype outside any (so what is written into it lands exactly:
    NOTE [reading a sharded parameter])."""
    if in_eager_forward():
        return read_args(p.marker_values)
    return read_args({**p.marker_values, "param_dtype": None})


def in_eager_forward() -> bool:
    """Whether some unit's forward runs eagerly on this thread now."""
    return getattr(_forwards, "depth", 0) > 0


def forward_depth_hooks(module: nn.Module) -> None:
    """Count ``module``'s eager forwards on this thread (what :func:`eager_args` reads)."""

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
    class for that module alone), read while Dynamo traces, calls the marker on the shard straight away,
    sparing Dynamo parametrize's two module calls and their guards; read eagerly, it is parametrize's property.

    NOTE [tag-safe reads]: parametrize's property moves to ``cls._fsdp_props``, and ``cls`` gets a
    ``__getattr__`` and a ``__setattr__`` (to the property's setter). The trace reads the plan from the
    module's ``_fsdp_reads`` dict (``None``: off the lean read), which Dynamo's dict-tag check skips whole
    while unchanged, as for ``nn.Linear``, where it guards a property per parameter every call. The skip also
    skips a tensor's guards (``requires_grad`` changes no dict), so a read of the shard itself (a stacked
    block's, a frozen flat's) goes through its ``ShardedParam``, which the skip never covers. A parameter
    with parametrizations besides ``Unshard`` leaves the lean read (``_Chain``) for parametrize's path."""
    props = cls.__dict__.get("_fsdp_props")
    if props is None:
        props = dict(getattr(cls, "_fsdp_props", {}))  # a base's names too
        cls._fsdp_props = props  # type: ignore[attr-defined]
        cls.__getattr__ = _read_attr  # type: ignore[attr-defined]
        cls.__setattr__ = _write_attr  # type: ignore[method-assign]
    props[name] = cls.__dict__[name]
    delattr(cls, name)


def _read_attr(self: nn.Module, name: str) -> object:
    # Through the module's attributes, not self.__dict__[...]: the way Dynamo reaches them that keeps the
    # module a subtree its guards may skip.
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
