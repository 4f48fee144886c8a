"""How a sharded parameter is read: the marker compiled code calls, and the guard against gathering.

A sharded module's parameter is a property (``sharding.py`` installs it); read while Dynamo traces it is one
``fsdp::unshard`` marker on the shard (NOTE [traced reads]), read eagerly it gathers through parametrize.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from fsdp_compile.api.module import reading_flats
from fsdp_compile.api.units import FLATS, ShardedParam
from fsdp_compile.passes.graph_ops import UNSHARD_ARGS, arg_names

__all__ = ["accumulator", "eager_args", "forward_depth_hooks", "in_eager_forward", "traced_property",
           "traced_unshard"]


def traced_unshard(p: ShardedParam, shard: Tensor | None = None) -> Tensor:
    """The marker compiled code calls (NOTE [traced reads]), its constants from ``p.read_plan`` (NOTE [one
    guard per read]). It reads ``shard`` when given (a stacked block's, NOTE [stacked blocks]), else the
    parameter's piece of its unit's flat shard where it has one (NOTE [flat shards] in ``flat_shard.py``)
    when our backend compiles the trace, else its shard. A parameter unfrozen since its flat was laid out
    without gradients is read from its shard; only then is its ``requires_grad`` read, and guarded.

    NOTE [one guard per read]: every compiled call first checks the guards Dynamo made of what the trace
    read, and the first kernel waits for that check: the step's host time before the GPU has work. A read
    takes its constants from one tuple, ``ShardedParam.read_plan`` (the flat's key, the piece's offset,
    size and shape, the marker's arguments, whether the unit accumulates), which Dynamo guards as one
    value, where the fields apart were a guard each. It finds the flat in ``FLATS``, one path for all of
    a flat's members, where each member's own path to the flat made Dynamo add a Python guard that the
    paths lead to one tensor. The plan is rebuilt whenever a field it copies changes
    (``ShardedParam.replan``)."""
    key, offset, numel, piece_shape, args, accumulating = p.read_plan
    if shard is None:
        flat = FLATS[key] if key else None
        from_flat = flat is not None and reading_flats() and (flat.requires_grad or not p.shard.requires_grad)
        shard = flat.narrow(0, offset, numel).view(piece_shape) if from_flat else p.shard
    return torch.ops.fsdp.unshard(shard, *args, [p.accumulator] if accumulating else None)[0]  # NOTE [outlined units]


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


def traced_property(name: str, original: property) -> property:
    """NOTE [traced reads]: a sharded parameter's property as parametrize made it, except while Dynamo
    traces: then it calls the marker on the shard straight away. Through parametrize, each read is two
    module calls (the parametrization list, then ``Unshard``) that Dynamo traces with their hook checks,
    about as much work as the rest of a block's tracing, and as many guards; this reads the same shard and
    makes the same marker call.

    The shard is reached through the module's own ``_fsdp_reads`` dict (name -> ShardedParam), not
    through parametrize's modules, whose lookups are most of what sharding adds to an inline trace
    (docs/compile-time.md). A parameter
    given parametrizations of its own besides ``Unshard`` leaves that dict (``_Chain``), so the trace
    guarding on it compiles again, through parametrize's path, which applies them all."""
    through_parametrize = original.fget
    assert through_parametrize is not None

    def get(self: nn.Module) -> Tensor:
        if torch.compiler.is_compiling():
            sp = self._fsdp_reads.get(name)
            if sp is not None:
                return traced_unshard(sp)
        return through_parametrize(self)  # eager, or compiled off the lean read (Unshard's marker last)

    return property(get, original.fset, original.fdel, original.__doc__)
