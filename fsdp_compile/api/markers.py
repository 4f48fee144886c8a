"""The two marker ops that Dynamo and AOTAutograd see: ``fsdp::unshard`` and ``fsdp::reduce_grad``.

A sharded module calls ``unshard(shard) -> [full param]`` for each read (the backend groups a unit's reads
into one marker of its flat: NOTE [flat markers] in ``passes/capture/group_markers.py``); its autograd
backward is ``reduce_grad([full grads]) -> shard grad``. Both carry what the passes need as plain op
arguments, and the passes replace them with collectives; the eager kernels below run only off
``fsdp_backend``.

NOTE [padding]: a param of dim-0 size ``n`` is stored as ``ceil(n / world)`` rows on every rank, the last
ranks holding zero rows past ``n``: ``unshard`` narrows the gathered rows to ``n``, ``reduce_grad`` pads the
gradient with zero rows, so padding never reaches the user's compute and a shard's padded grad rows stay 0.

NOTE [eager gather, no copy]: an eager ``unshard`` of one piece returns a tensor of the full shape set over
the all-gather output's storage: not a view (autograd forbids writing into a view made inside a custom op,
and an init writes into what it reads: NOTE [reading a sharded parameter]) and not a copy.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from fsdp_compile.passes.graph_ops import (NAMES_SEP, REDUCE_GRAD_ARGS, UNSHARD_ARGS, by_name, in_order, numel,
                                          unflatten_shapes)

__all__ = ["ANONYMOUS_UNIT", "unshard", "reduce_grad", "reduce_full_grad", "shard_rows"]

# NOTE [anonymous reads]: the unit argument of every traced marker (its names are traced as ""), so alike
# blocks trace alike (NOTE [outlined units] in module.py) and a Dynamo graph holds no unit numbering; the
# backend names each marker after the shard it reads (``name_markers`` in ``compiler/outlined_markers.py``)
# before any pass looks at it. Eager reads are named.
ANONYMOUS_UNIT = -1

_warned = threading.Event()
_outside_forward = threading.local()  # set while a read outside any unit's forward runs


@contextlib.contextmanager
def read_outside_forward() -> Iterator[None]:
    """NOTE [the slow-path warning]: the warning below is for a model that *runs* off ``fsdp_backend``; a read
    outside any forward (initialising, loading) is a documented gather and runs in this context, silent."""
    before = getattr(_outside_forward, "on", False)
    _outside_forward.on = True
    try:
        yield
    finally:
        _outside_forward.on = before


def _warn_slow_path() -> None:
    if not _warned.is_set() and not getattr(_outside_forward, "on", False):
        _warned.set()
        warnings.warn(
            "fsdp_compile: a sharded parameter was gathered eagerly: a sharded model ran uncompiled or "
            "compiled by another backend. Results are correct, but each such read is a blocking all-gather "
            "that every rank must make, and nothing overlaps. Use torch.compile(model, "
            "backend=fsdp_backend) for the scheduled path.",
            stacklevel=3,
        )


def shard_rows(dim0: int, world_size: int) -> int:
    """Rows of dim 0 that each rank stores of a param whose dim 0 is ``dim0`` (NOTE [padding])."""
    return -(-dim0 // world_size)


# The schemas come from NOTE [one marker spec] (``passes/graph_ops.py``); the kernels read arguments by name.
def unshard(*args: Any) -> list[Tensor]:
    """``fsdp::unshard``: gather the full parameters whose dim-0 shards are the pieces of ``shard``, cast to
    ``param_dtype`` first. ``accumulate`` (NOTE [no-sync]): a full-shape leaf per parameter, whose ``.grad``
    receives its full gradient instead of a reduction."""
    _warn_slow_path()
    a = by_name(UNSHARD_ARGS, args)
    shard, param_dtype, world_size = a["shard"], a["param_dtype"], a["world_size"]
    fulls = unflatten_shapes(a["ranks"], a["dims"])
    x = (shard if param_dtype is None else shard.to(param_dtype)).reshape(-1)
    fresh = world_size > 1 or x.dtype != shard.dtype
    if world_size > 1:
        x = _gather_eagerly(x, world_size, a["ag_group"], a["names"])
    if len(fulls) == 1 and fresh:
        return [_full_of(x, fulls[0])]
    sizes = [numel(s) for s in unflatten_shapes(a["shard_ranks"], a["shard_dims"])]
    outs = torch.ops.fsdp.copy_out_rows(x, world_size, sizes, a["ranks"], a["dims"])
    return [_full_of(o, full) for o, full in zip(outs, fulls)]


def _full_of(padded: Tensor, full_shape: list[int]) -> Tensor:
    """(NOTE [eager gather, no copy]) A tensor of ``full_shape`` over ``padded``'s storage, not a view of it."""
    full = padded.new_empty(0)
    strides = torch.empty(full_shape, device="meta").stride()
    return full.set_(padded.untyped_storage(), padded.storage_offset(), full_shape, strides)


def _gather_eagerly(x: Tensor, world_size: int, group: str, names: str) -> Tensor:
    try:
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world_size, group)
        return torch.ops._c10d_functional.wait_tensor(gathered)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        name = names.split(NAMES_SEP)[0]
        raise RuntimeError(f"fsdp_compile: gathering {name or 'a sharded parameter'} outside compiled code failed "
                           f"({first}). Reading a sharded parameter outside a graph compiled by fsdp_backend is a "
                           "collective: every rank of its group must read it at the same point (not `if rank == 0: "
                           "print(module.weight)`). To read this rank's rows without communication, use "
                           "fsdp_compile.local_shard(module, name).") from e


def _unshard_fake(*args: Any) -> list[Tensor]:
    a = by_name(UNSHARD_ARGS, args)
    shard, dtype = a["shard"], a["param_dtype"] or a["shard"].dtype
    return [shard.new_empty(full, dtype=dtype) for full in unflatten_shapes(a["ranks"], a["dims"])]


def _unshard_setup_context(ctx: Any, inputs: tuple, output: list[Tensor]) -> None:
    a = by_name(UNSHARD_ARGS, inputs)
    shard = a["shard"]
    ctx.accumulating = a.get("accumulate") is not None
    ctx.full = [(full, a["param_dtype"] or shard.dtype) for full in unflatten_shapes(a["ranks"], a["dims"])]
    ctx.shard_shape, ctx.shard_dtype, ctx.device = list(shard.shape), shard.dtype, shard.device
    ctx.reduce_args = in_order(REDUCE_GRAD_ARGS, **a, grads=None, out_dtype=shard.dtype)[1:]
    # No gradient for the arguments between the shard and the leaves: ``None``, or ``[]`` for an empty list
    # (a 0-d parameter's ``dims``): autograd matches the inputs' structure.
    ctx.no_grads = tuple([] if isinstance(v, (list, tuple)) and not v else None for v in inputs[1:len(UNSHARD_ARGS) - 1])


def _unshard_backward(ctx: Any, grads: list[Tensor | None]) -> tuple:
    no_grads = ctx.no_grads
    if ctx.accumulating:  # no communication: each full gradient to its leaf, in the shard's dtype
        return (None, *no_grads, [g.to(ctx.shard_dtype) if g is not None else None for g in grads])
    # A parameter the forward never read: zeros, which reduce to its zero gradient.
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device)
            for g, (shape, dtype) in zip(grads, ctx.full)]
    grad = torch.ops.fsdp.reduce_grad(full, *ctx.reduce_args)
    return (grad if list(grad.shape) == ctx.shard_shape else grad.view(ctx.shard_shape), *no_grads)


torch.library.impl("fsdp::unshard", "CompositeExplicitAutograd")(unshard)
torch.library.register_fake("fsdp::unshard")(_unshard_fake)
torch.library.register_autograd("fsdp::unshard", _unshard_backward, setup_context=_unshard_setup_context)


def reduce_grad(*args: Any) -> Tensor:
    """``fsdp::reduce_grad``: average each full gradient over all data-parallel ranks (in ``reduce_dtype``)
    and keep this rank's shard of it, in ``out_dtype``: the one piece, or the pieces one after another, 1-D."""
    _warn_slow_path()
    a = by_name(REDUCE_GRAD_ARGS, args)
    shapes = unflatten_shapes(a["shard_ranks"], a["shard_dims"])
    outs = [reduce_full_grad(g, s, a["world_size"], a["rs_group"], a["replicate_group"], a["replicate_size"],
                             a["reduce_dtype"], a["out_dtype"]) for g, s in zip(a["grads"], shapes)]
    return outs[0] if len(outs) == 1 else torch.cat([g.reshape(-1) for g in outs])


def reduce_full_grad(grad: Tensor, shard_shape: list[int], world_size: int, rs_group: str, replicate_group: str,
                     replicate_size: int, reduce_dtype: torch.dtype | None, out_dtype: torch.dtype) -> Tensor:
    """``reduce_grad``'s arithmetic with blocking collectives (also flushes accumulated grads)."""
    g = grad if reduce_dtype is None else grad.to(reduce_dtype)
    rows = shard_shape[0] if shard_shape else 1
    g = g if g.dim() > 0 else g.reshape(1)
    if g.shape[0] < rows * world_size:
        g = torch.cat([g, g.new_zeros(rows * world_size - g.shape[0], *g.shape[1:])])
    c10d = torch.ops._c10d_functional
    if world_size > 1:
        g = c10d.wait_tensor(c10d.reduce_scatter_tensor(g.contiguous(), "sum", world_size, rs_group))
    if replicate_group:
        g = c10d.wait_tensor(c10d.all_reduce(g.contiguous(), "sum", replicate_group))
    g = g / (world_size * max(replicate_size, 1))
    return g.to(out_dtype).reshape(shard_shape)


def _reduce_grad_fake(*args: Any) -> Tensor:
    a = by_name(REDUCE_GRAD_ARGS, args)
    shapes = unflatten_shapes(a["shard_ranks"], a["shard_dims"])
    out_shape = shapes[0] if len(shapes) == 1 else [sum(numel(s) for s in shapes)]
    return a["grads"][0].new_empty(out_shape, dtype=a["out_dtype"])


torch.library.impl("fsdp::reduce_grad", "CompositeExplicitAutograd")(reduce_grad)
torch.library.register_fake("fsdp::reduce_grad")(_reduce_grad_fake)
