"""The two marker ops that Dynamo and AOTAutograd see: ``fsdp::unshard`` and ``fsdp::reduce_grad``.

``unshard(shard) -> [full param]`` is what a sharded module calls (through a parametrization) each time
it reads a parameter; the backend groups a unit's reads into one marker of its flat shard, ``unshard(flat)
-> [full params]`` (NOTE [flat markers] in ``passes/capture/group_markers.py``). Its registered autograd
backward is ``reduce_grad([full grads]) -> shard grad``, so the joint graph AOTAutograd builds holds one
marker in forward and its partner in backward, each carrying, as plain op arguments, everything the
passes need: the unit, the groups, the world size, the shapes and the dtypes. The passes in
``passes/`` replace both with functional collectives; the eager implementations below only run when a
sharded model is *not* compiled by ``fsdp_backend``.

NOTE [padding]: a param of dim-0 size ``n`` is stored as ``ceil(n / world)`` rows on every rank; the
last ranks hold zero rows past ``n``. ``unshard`` gathers ``world * rows`` rows and narrows to ``n``;
``reduce_grad`` pads the gradient with zero rows back to ``world * rows`` before reduce-scattering,
so padding never reaches the user's compute, and the padded rows of a shard's grad are always zero.

NOTE [eager gather, no copy]: an eager ``unshard`` of one piece (a read) returns the all-gather's output
itself: a tensor of the full shape set over the output's storage from its start, so the padding rows lie
unused past its end. It is not a view (autograd forbids writing in place into a view made inside a
custom op, and an init writes into what it reads: NOTE [reading a sharded parameter]), and it is not a
copy: a read costs one full parameter, freed when the caller's last reference dies (gloo also stages the
gathered rows in a buffer of the same size inside the collective, and copies this rank's shard; NCCL
writes into the output). Several pieces are copied out of the gathered rows, each its own tensor.
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

# NOTE [anonymous reads]: the unit argument of every traced marker (its name is traced as ""). A read
# traces the same whichever unit it belongs to, so alike blocks trace alike (NOTE [outlined units] in
# module.py) and a Dynamo graph holds no unit numbering; the backend names each marker after the shard it
# reads (``name_markers`` in ``compiler/outlined_markers.py``), before any pass looks at it. Eager reads
# are named.
ANONYMOUS_UNIT = -1

_warned = threading.Event()
_outside_forward = threading.local()  # set while a read outside any unit's forward runs (NOTE below)


@contextlib.contextmanager
def read_outside_forward() -> Iterator[None]:
    """NOTE [the slow-path warning]: the warning below is for a model that *runs* off the scheduled path:
    a unit's forward run uncompiled, or compiled by another backend. A read of ``module.<name>`` outside
    any forward (initialising after ``to_empty``, loading, inspecting) is a documented blocking gather
    (NOTE [reading a sharded parameter]) and says nothing; ``reads.py`` marks it with this context."""
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
    """Rows of dim 0 that each rank stores for a param whose dim 0 is ``dim0`` (see NOTE [padding])."""
    return -(-dim0 // world_size)


# ---------------------------------------------------------------------------------------------
# unshard
# ---------------------------------------------------------------------------------------------


# The schemas are built from NOTE [one marker spec] (``passes/graph_ops.py``); the kernels read their
# arguments by those names.
def unshard(*args: Any) -> list[Tensor]:
    """``fsdp::unshard(shard, shard_ranks, shard_dims, ranks, dims, names, world_size, unit, ag_group,
    rs_group, replicate_group, replicate_size, reshard, param_dtype, reduce_dtype, accumulate=None)``:
    gather the full parameters whose dim-0 shards are the pieces of ``shard`` (NOTE [one marker spec]),
    from every rank.

    Piece ``i`` has ``shard_rows(full[0], world_size)`` rows of its full shape ``full``; parameter ``i``
    has ``full`` and ``param_dtype`` (the shard's dtype when ``None``): the cast happens before the
    gather. The other arguments only inform the backward (``reduce_grad``) and the graph passes.

    ``accumulate`` (gradient accumulation without communication, see ``accumulate.py``): a full-shape
    leaf per parameter, whose ``.grad`` receives its full gradient instead; the shard gets none and
    nothing is reduced.
    """
    _warn_slow_path()
    a = by_name(UNSHARD_ARGS, args)
    shard, param_dtype, world_size = a["shard"], a["param_dtype"], a["world_size"]
    fulls = unflatten_shapes(a["ranks"], a["dims"])
    x = (shard if param_dtype is None else shard.to(param_dtype)).reshape(-1)  # the cast: a shard, before the gather
    fresh = world_size > 1 or x.dtype != shard.dtype
    if world_size > 1:
        x = _gather_eagerly(x, world_size, a["ag_group"], a["names"])
    if len(fulls) == 1 and fresh:
        return [_full_of(x, fulls[0])]
    sizes = [numel(s) for s in unflatten_shapes(a["shard_ranks"], a["shard_dims"])]
    outs = torch.ops.fsdp.copy_out_rows(x, world_size, sizes, a["ranks"], a["dims"])  # (no alias of the input)
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
        raise RuntimeError(
            f"fsdp_compile: gathering {name or 'a sharded parameter'} outside compiled code failed ({first}). "
            "Reading a sharded parameter outside a graph compiled by fsdp_backend is a collective: every rank "
            "of its group must read it at the same point (not `if rank == 0: print(module.weight)`). To read "
            "this rank's rows without communication, use fsdp_compile.local_shard(module, name)."
        ) from e


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
    ctx.reduce_args = in_order(REDUCE_GRAD_ARGS, **a, grads=None, out_dtype=shard.dtype)[1:]  # (no tensor among them)
    # No gradient for the arguments between the shard and the leaves: ``None``, or an empty list for an
    # empty list (a 0-d parameter's ``dims``), as autograd matches the inputs' structure.
    ctx.no_grads = tuple([] if isinstance(v, (list, tuple)) and not v else None for v in inputs[1:len(UNSHARD_ARGS) - 1])


def _unshard_backward(ctx: Any, grads: list[Tensor | None]) -> tuple:
    no_grads = ctx.no_grads
    if ctx.accumulating:  # no communication: each full gradient to its leaf, in the shard's dtype
        return (None, *no_grads, [g.to(ctx.shard_dtype) if g is not None else None for g in grads])
    # A parameter the forward never read has no gradient: zeros, which reduce to its zero gradient.
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device)
            for g, (shape, dtype) in zip(grads, ctx.full)]
    grad = torch.ops.fsdp.reduce_grad(full, *ctx.reduce_args)
    # (``accumulate`` left ``None`` reaches autograd as no input: no gradient for it)
    return (grad if list(grad.shape) == ctx.shard_shape else grad.view(ctx.shard_shape), *no_grads)


torch.library.impl("fsdp::unshard", "CompositeExplicitAutograd")(unshard)
torch.library.register_fake("fsdp::unshard")(_unshard_fake)
torch.library.register_autograd("fsdp::unshard", _unshard_backward, setup_context=_unshard_setup_context)


# ---------------------------------------------------------------------------------------------
# reduce_grad
# ---------------------------------------------------------------------------------------------


def reduce_grad(*args: Any) -> Tensor:
    """``fsdp::reduce_grad(grads, shard_ranks, shard_dims, names, world_size, unit, ag_group, rs_group,
    replicate_group, replicate_size, reduce_dtype, out_dtype)``: average each full gradient over all
    data-parallel ranks and keep this rank's shard of it; the gradient of ``fsdp::unshard``'s ``shard``.

    Each gradient is cast to ``reduce_dtype`` (when given), padded to ``world_size`` shards, summed with
    a reduce-scatter on ``rs_group``, all-reduced over ``replicate_group`` when one is named (HSDP),
    divided by the number of data-parallel ranks and cast to ``out_dtype``. The result is the one piece
    in its shape, or the pieces one after another, 1-D. ``ag_group`` only tells the passes whether the
    two collectives share a communicator.
    """
    _warn_slow_path()
    a = by_name(REDUCE_GRAD_ARGS, args)
    shapes = unflatten_shapes(a["shard_ranks"], a["shard_dims"])
    outs = [reduce_full_grad(g, s, a["world_size"], a["rs_group"], a["replicate_group"], a["replicate_size"],
                             a["reduce_dtype"], a["out_dtype"]) for g, s in zip(a["grads"], shapes)]
    return outs[0] if len(outs) == 1 else torch.cat([g.reshape(-1) for g in outs])


def reduce_full_grad(
    grad: Tensor,
    shard_shape: list[int],
    world_size: int,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``reduce_grad``'s arithmetic with blocking collectives (also used to flush accumulated grads)."""
    g = grad if reduce_dtype is None else grad.to(reduce_dtype)
    rows = shard_shape[0] if shard_shape else 1
    g = g if g.dim() > 0 else g.reshape(1)
    if g.shape[0] < rows * world_size:
        g = torch.cat([g, g.new_zeros(rows * world_size - g.shape[0], *g.shape[1:])])
    if world_size > 1:
        g = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.reduce_scatter_tensor(g.contiguous(), "sum", world_size, rs_group)
        )
    if replicate_group:
        g = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(g.contiguous(), "sum", replicate_group)
        )
    g = g / (world_size * max(replicate_size, 1))
    return g.to(out_dtype).reshape(shard_shape)


def _reduce_grad_fake(*args: Any) -> Tensor:
    a = by_name(REDUCE_GRAD_ARGS, args)
    shapes = unflatten_shapes(a["shard_ranks"], a["shard_dims"])
    out_shape = shapes[0] if len(shapes) == 1 else [sum(numel(s) for s in shapes)]
    return a["grads"][0].new_empty(out_shape, dtype=a["out_dtype"])


torch.library.impl("fsdp::reduce_grad", "CompositeExplicitAutograd")(reduce_grad)
torch.library.register_fake("fsdp::reduce_grad")(_reduce_grad_fake)
