"""The two marker ops that Dynamo and AOTAutograd see: ``fsdp::unshard`` and ``fsdp::reduce_grad``.

``unshard(shard) -> full param`` is what a sharded module calls (through a parametrization) each time
it reads a parameter. Its registered autograd backward is ``reduce_grad(full grad) -> shard grad``, so
the joint graph AOTAutograd builds holds one marker in forward and its partner in backward, each
carrying, as plain op arguments, everything the passes need: the unit, the groups, the world size, the
full shape and the dtypes. The passes in ``passes/`` replace both with functional collectives; the
eager implementations below only run when a sharded model is *not* compiled by ``fsdp_backend``.

NOTE [padding]: a param of dim-0 size ``n`` is stored as ``ceil(n / world)`` rows on every rank; the
last ranks hold zero rows past ``n``. ``unshard`` gathers ``world * rows`` rows and narrows to ``n``;
``reduce_grad`` pads the gradient with zero rows back to ``world * rows`` before reduce-scattering,
so padding never reaches the user's compute, and the padded rows of a shard's grad are always zero.

NOTE [eager gather, no copy]: an eager ``unshard`` returns the all-gather's output itself: a tensor of the
full shape set over the output's storage from its start, so the padding rows lie unused past its end. It
is not a view (autograd forbids writing in place into a view made inside a custom op, and an init writes
into what it reads: NOTE [reading a sharded parameter]), and it is not a copy: a read costs one full
parameter, freed when the caller's last reference dies (gloo also stages the gathered rows in a buffer
of the same size inside the collective, and copies this rank's shard; NCCL writes into the output).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from fsdp_compile.passes.graph_ops import REDUCE_GRAD_ARGS, UNSHARD_ARGS, by_name, in_order

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
def unshard(*args: Any) -> Tensor:
    """``fsdp::unshard(shard, full_shape, world_size, unit, name, ag_group, rs_group, replicate_group,
    replicate_size, reshard, param_dtype, reduce_dtype, accumulate=None)``: gather the full parameter
    ``name`` of ``unit`` from every rank's dim-0 shard.

    ``shard`` has ``shard_rows(full_shape[0], world_size)`` rows; the result has ``full_shape`` and
    ``param_dtype`` (the shard's dtype when ``None``): the cast happens before the gather. The other
    arguments only inform the backward (``reduce_grad``) and the graph passes.

    ``accumulate`` (gradient accumulation without communication, see ``accumulate.py``): a full-shape
    leaf whose ``.grad`` receives the full gradient instead; the shard gets none and nothing is reduced.
    """
    _warn_slow_path()
    a = by_name(UNSHARD_ARGS, args)
    shard, param_dtype, world_size = a["shard"], a["param_dtype"], a["world_size"]
    full_shape = list(a["full_shape"])
    x = shard if param_dtype is None else shard.to(param_dtype)  # the cast: a shard, before the gather
    if world_size > 1:
        return _full_of(_gather_eagerly(x, world_size, a["ag_group"], a["name"]), full_shape)
    return _full_of(x, full_shape) if x is not shard else x.reshape(full_shape).clone()  # (no alias of the input)


def _full_of(padded: Tensor, full_shape: list[int]) -> Tensor:
    """(NOTE [eager gather, no copy]) A tensor of ``full_shape`` over ``padded``'s storage, not a view of it."""
    full = padded.new_empty(0)
    strides = torch.empty(full_shape, device="meta").stride()
    return full.set_(padded.untyped_storage(), padded.storage_offset(), full_shape, strides)


def _gather_eagerly(x: Tensor, world_size: int, group: str, name: str) -> Tensor:
    try:
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world_size, group)
        return torch.ops._c10d_functional.wait_tensor(gathered)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(
            f"fsdp_compile: gathering {name or 'a sharded parameter'} outside compiled code failed ({first}). "
            "Reading a sharded parameter outside a graph compiled by fsdp_backend is a collective: every rank "
            "of its group must read it at the same point (not `if rank == 0: print(module.weight)`). To read "
            "this rank's rows without communication, use fsdp_compile.local_shard(module, name)."
        ) from e


def _unshard_fake(shard: Tensor, full_shape: list[int], *args: object) -> Tensor:
    param_dtype = by_name(UNSHARD_ARGS, (shard, full_shape, *args))["param_dtype"]
    return shard.new_empty(full_shape, dtype=param_dtype or shard.dtype)  # type: ignore[arg-type]


def _unshard_setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    args = by_name(UNSHARD_ARGS, inputs)
    shard = args.pop("shard")
    ctx.accumulate = args.pop("accumulate", None) is not None
    ctx.args = args  # (no tensor among them)
    ctx.shard_shape = list(shard.shape)
    ctx.shard_dtype = shard.dtype


def _unshard_backward(ctx: Any, grad: Tensor) -> tuple:
    no_grads = (None,) * (len(UNSHARD_ARGS) - 1)
    if ctx.accumulate:
        # No communication: the full gradient goes to the accumulation leaf, in the shard's dtype.
        return no_grads + (grad.to(ctx.shard_dtype),)
    values = {**ctx.args, "grad": grad, "shard_shape": ctx.shard_shape, "out_dtype": ctx.shard_dtype}
    return (torch.ops.fsdp.reduce_grad(*in_order(REDUCE_GRAD_ARGS, **values)),) + no_grads


torch.library.impl("fsdp::unshard", "CompositeExplicitAutograd")(unshard)
torch.library.register_fake("fsdp::unshard")(_unshard_fake)
torch.library.register_autograd("fsdp::unshard", _unshard_backward, setup_context=_unshard_setup_context)


# ---------------------------------------------------------------------------------------------
# reduce_grad
# ---------------------------------------------------------------------------------------------


def reduce_grad(*args: Any) -> Tensor:
    """``fsdp::reduce_grad(grad, shard_shape, world_size, unit, name, ag_group, rs_group, replicate_group,
    replicate_size, reduce_dtype, out_dtype)``: average the full gradient of ``name`` over all
    data-parallel ranks and keep this rank's shard.

    The gradient is cast to ``reduce_dtype`` (when given), padded to ``world_size`` shards, summed with
    a reduce-scatter on ``rs_group``, all-reduced over ``replicate_group`` when one is named (HSDP),
    divided by the number of data-parallel ranks and cast to ``out_dtype``. ``ag_group`` only tells
    the passes whether the two collectives share a communicator.
    """
    _warn_slow_path()
    a = by_name(REDUCE_GRAD_ARGS, args)
    return reduce_full_grad(a["grad"], list(a["shard_shape"]), a["world_size"], a["rs_group"], a["replicate_group"],
                            a["replicate_size"], a["reduce_dtype"], a["out_dtype"])


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


def _reduce_grad_fake(grad: Tensor, shard_shape: list[int], *args: object) -> Tensor:
    out_dtype = by_name(REDUCE_GRAD_ARGS, (grad, shard_shape, *args))["out_dtype"]
    assert isinstance(out_dtype, torch.dtype)
    return grad.new_empty(shard_shape, dtype=out_dtype)


torch.library.impl("fsdp::reduce_grad", "CompositeExplicitAutograd")(reduce_grad)
torch.library.register_fake("fsdp::reduce_grad")(_reduce_grad_fake)
