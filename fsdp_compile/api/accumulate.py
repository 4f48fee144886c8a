"""Gradient accumulation without communication: ``set_requires_gradient_sync(False)``.

NOTE [no-sync]: while a unit does not sync, each read passes a full-shape *accumulation leaf* (a
zero-stride expansion of one element) to ``fsdp::unshard``, whose backward sends the full gradient to the
leaf's ``.grad`` (accumulated by autograd) instead of reducing it. Once sync is on again, the next forward
still reads through the leaves (the same graph: its guard is "not sync or pending"), and the end of that
backward reduces everything accumulated into the shards' ``.grad``. So a run switches between two graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fsdp_compile._compat import queue_end_of_backward
from fsdp_compile.api.grads import as_shard_grad
from fsdp_compile.api.markers import reduce_full_grad
from fsdp_compile.api.units import ShardedParam, Unit, units_under

__all__ = ["set_requires_gradient_sync"]


def _leaf(sp: ShardedParam) -> Tensor:
    leaf = torch.zeros((), dtype=sp.shard.dtype, device=sp.shard.device).expand(sp.full_shape)
    leaf.requires_grad_(True)
    leaf.register_post_accumulate_grad_hook(lambda _t, sp=sp: _on_accumulated(sp))
    return leaf


def _on_accumulated(sp: ShardedParam) -> None:
    unit = sp.unit
    unit.set_sync(pending=True)
    if unit.requires_grad_sync and not unit.flush_queued:
        unit.flush_queued = True
        queue_end_of_backward(lambda: _flush(unit))


def _flush(unit: Unit) -> None:
    """End of a synced backward: one bucketed reduce of the unit's accumulated full grads into its shards' grads."""
    ready = [sp for sp in unit.params if sp.accumulator is not None and sp.accumulator.grad is not None]
    unit.set_sync(pending=False)
    unit.flush_queued = False
    if not ready:
        return
    g = unit.groups
    world = g.shard_size
    dtype = unit.mp_policy.reduce_dtype or ready[0].accumulator.grad.dtype  # type: ignore[union-attr]
    rows = [_padded_rows(sp, world) for sp in ready]  # (world, shard numel) each
    packed = torch.cat([r.to(dtype) for r in rows], dim=1).reshape(-1)
    reduced = reduce_full_grad(
        packed, [packed.numel() // world], world, g.reduce_scatter.group_name,
        g.replicate.group_name if g.replicate is not None else "", g.replicate_size, None, dtype,
    )
    for sp, part in zip(ready, reduced.split([r.shape[1] for r in rows])):
        shard_grad = part.to(sp.shard.dtype).view(sp.shard.shape)
        if sp.shard.grad is None:
            sp.shard.grad = as_shard_grad(shard_grad, g.all_gather.group_name, sp.real_rows)  # NOTE [global norms]
        else:
            sp.shard.grad += shard_grad
        sp.accumulator.grad = None  # type: ignore[union-attr]


def _padded_rows(sp: ShardedParam, world: int) -> Tensor:
    """The accumulated full grad as (world, shard numel): rank-major, zero-padded (NOTE [padding])."""
    full = sp.accumulator.grad.reshape(-1)  # type: ignore[union-attr]
    padded = full.new_zeros(sp.shard.numel() * world)
    padded[: full.numel()] = full
    return padded.view(world, -1)


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """Turn gradient reduction on or off for ``module``'s unit (and, with ``recurse``, its sub-units).

    Off: backward keeps full-size gradients locally and reduces nothing (accumulation microbatches).
    On again: the next backward reduces everything accumulated, once. As FSDP2's method of this name.
    """
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"set_requires_gradient_sync: expected a bool, got {type(requires_gradient_sync).__name__}")
    units = units_under(module) if recurse else [u for u in units_under(module) if u.module is module]
    if not units:
        raise ValueError(f"set_requires_gradient_sync: {type(module).__name__} holds no fully_shard unit; call "
                         "fully_shard on it (or its blocks) first.")
    for unit in units:
        if not requires_gradient_sync:
            for sp in unit.params:
                if sp.accumulator is None and sp.shard.requires_grad:
                    sp.accumulator = _leaf(sp)
        unit.set_sync(requires_grad_sync=requires_gradient_sync)
