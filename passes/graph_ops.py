"""The ``fsdp::`` ops that the passes put into graphs; the two per-parameter markers they start from,
``fsdp::unshard`` and ``fsdp::reduce_grad``, are ``fsdp_compile/ops.py``'s.

- Grouped markers: ``unshard_many`` / ``reduce_grad_many`` (NOTE [grouped markers] in
  ``capture/group_markers.py``) and ``unshard_flat`` / ``reduce_grad_flat`` (NOTE [flat shards], same
  file): one op for every parameter one outlined call reads; their eager implementations call the
  per-parameter markers.
- Bucket copies: ``pack_shards``, ``copy_out_rows``, ``pack_rows`` (NOTE [bucket copies] below): one op
  per copy into or out of a unit's bucket.

An op's schema takes no nested int lists and no string lists: shapes travel flattened
(:func:`flatten_shapes`), names joined by ``NAMES_SEP``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NAMES_SEP", "copy_out_rows", "flat_pieces", "flatten_shapes", "numel", "pack_rows", "pack_shards",
           "reduce_grad_flat", "reduce_grad_many", "unflatten_shapes", "unshard_flat", "unshard_many"]

NAMES_SEP = "\n"  # between the names a grouped marker carries (a name holding it is never grouped)


def flatten_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Shapes as (their ranks, their sizes one after another): what an op's schema can carry."""
    return [len(s) for s in shapes], [int(d) for s in shapes for d in s]


def unflatten_shapes(ranks: Sequence[int], dims: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for r in ranks:
        out.append(list(dims[start:start + r]))
        start += r
    return out


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``."""
    out = 1
    for s in shape:
        out *= s
    return out


# ---------------------------------------------------------------------------------------------
# Grouped markers: every parameter one call reads
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fsdp::unshard_many", mutates_args=())
def unshard_many(
    shards: list[Tensor],
    ranks: list[int],
    dims: list[int],
    names: str,
    world_size: int,
    unit: int,
    ag_group: str,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reshard: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> list[Tensor]:
    """``fsdp::unshard`` of each shard: ``shards[i]`` is the parameter ``names.split(NAMES_SEP)[i]`` of
    full shape ``unflatten_shapes(ranks, dims)[i]``; the other arguments are shared."""
    return [torch.ops.fsdp.unshard(s, shape, world_size, unit, name, ag_group, rs_group, replicate_group,
                                   replicate_size, reshard, param_dtype, reduce_dtype, None)
            for s, shape, name in zip(shards, unflatten_shapes(ranks, dims), names.split(NAMES_SEP))]


@unshard_many.register_fake
def _unshard_many_fake(shards: list[Tensor], ranks: list[int], dims: list[int], *args: object) -> list[Tensor]:
    param_dtype = args[-2]
    return [s.new_empty(shape, dtype=param_dtype or s.dtype)  # type: ignore[arg-type]
            for s, shape in zip(shards, unflatten_shapes(ranks, dims))]


def _unshard_many_setup(ctx: object, inputs: tuple, output: list[Tensor]) -> None:
    (shards, ranks, dims, names, world_size, unit, ag_group, rs_group, replicate_group, replicate_size,
     _reshard, param_dtype, reduce_dtype) = inputs
    ctx.full = [(shape, param_dtype or s.dtype) for s, shape in zip(shards, unflatten_shapes(ranks, dims))]  # type: ignore[attr-defined]
    ctx.shard_shapes = flatten_shapes([s.shape for s in shards])  # type: ignore[attr-defined]
    ctx.device = shards[0].device  # type: ignore[attr-defined]
    ctx.out_dtype = shards[0].dtype  # type: ignore[attr-defined]
    ctx.args = (names, world_size, unit, ag_group, rs_group, replicate_group, replicate_size, reduce_dtype)  # type: ignore[attr-defined]


def _unshard_many_backward(ctx: object, grads: list[Tensor | None]) -> tuple:
    # A parameter the call never read has no gradient: zeros, which reduce to its zero gradient.
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device)  # type: ignore[attr-defined]
            for g, (shape, dtype) in zip(grads, ctx.full)]  # type: ignore[attr-defined]
    ranks, dims = ctx.shard_shapes  # type: ignore[attr-defined]
    out = torch.ops.fsdp.reduce_grad_many(full, ranks, dims, *ctx.args, ctx.out_dtype)  # type: ignore[attr-defined]
    return (list(out),) + (None,) * 12


unshard_many.register_autograd(_unshard_many_backward, setup_context=_unshard_many_setup)


@torch.library.custom_op("fsdp::reduce_grad_many", mutates_args=())
def reduce_grad_many(
    grads: list[Tensor],
    ranks: list[int],
    dims: list[int],
    names: str,
    world_size: int,
    unit: int,
    ag_group: str,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> list[Tensor]:
    """``fsdp::reduce_grad`` of each full gradient to a shard of shape ``unflatten_shapes(ranks, dims)[i]``."""
    return [torch.ops.fsdp.reduce_grad(g, shape, world_size, unit, name, ag_group, rs_group, replicate_group,
                                       replicate_size, reduce_dtype, out_dtype)
            for g, shape, name in zip(grads, unflatten_shapes(ranks, dims), names.split(NAMES_SEP))]


@reduce_grad_many.register_fake
def _reduce_grad_many_fake(grads: list[Tensor], ranks: list[int], dims: list[int], *args: object) -> list[Tensor]:
    out_dtype = args[-1]
    return [g.new_empty(shape, dtype=out_dtype) for g, shape in zip(grads, unflatten_shapes(ranks, dims))]  # type: ignore[arg-type]


@torch.library.custom_op("fsdp::unshard_flat", mutates_args=())
def unshard_flat(
    flat: Tensor,
    shard_ranks: list[int],
    shard_dims: list[int],
    ranks: list[int],
    dims: list[int],
    names: str,
    world_size: int,
    unit: int,
    ag_group: str,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reshard: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> list[Tensor]:
    """``fsdp::unshard`` of each piece of the 1-D ``flat``: piece ``i`` is the next elements of ``flat``,
    of shape ``unflatten_shapes(shard_ranks, shard_dims)[i]``, the shard of the parameter
    ``names.split("\\n")[i]`` of full shape ``unflatten_shapes(ranks, dims)[i]``; the pieces tile ``flat``."""
    out = []
    for piece, shape, name in zip(flat_pieces(flat, unflatten_shapes(shard_ranks, shard_dims)),
                                  unflatten_shapes(ranks, dims), names.split(NAMES_SEP)):
        out.append(torch.ops.fsdp.unshard(piece, shape, world_size, unit, name, ag_group, rs_group, replicate_group,
                                          replicate_size, reshard, param_dtype, reduce_dtype, None))
    return out


@unshard_flat.register_fake
def _unshard_flat_fake(flat: Tensor, shard_ranks: list[int], shard_dims: list[int], ranks: list[int],
                       dims: list[int], *args: object) -> list[Tensor]:
    param_dtype = args[-2]
    return [flat.new_empty(shape, dtype=param_dtype or flat.dtype) for shape in unflatten_shapes(ranks, dims)]  # type: ignore[arg-type]


def flat_pieces(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """The 1-D ``flat`` cut into consecutive pieces of ``shapes``."""
    out, offset = [], 0
    for shape in shapes:
        n = numel(shape)
        out.append(flat.narrow(0, offset, n).view(list(shape)))
        offset += n
    return out


def _unshard_flat_setup(ctx: object, inputs: tuple, output: list[Tensor]) -> None:
    (flat, shard_ranks, shard_dims, ranks, dims, names, world_size, unit, ag_group, rs_group, replicate_group,
     replicate_size, _reshard, param_dtype, reduce_dtype) = inputs
    ctx.full = [(shape, param_dtype or flat.dtype) for shape in unflatten_shapes(ranks, dims)]  # type: ignore[attr-defined]
    ctx.device = flat.device  # type: ignore[attr-defined]
    ctx.args = (shard_ranks, shard_dims, names, world_size, unit, ag_group, rs_group, replicate_group,  # type: ignore[attr-defined]
                replicate_size, reduce_dtype, flat.dtype)


def _unshard_flat_backward(ctx: object, grads: list[Tensor | None]) -> tuple:
    # A piece the call never read has no gradient: zeros, which reduce to its zero gradient.
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device)  # type: ignore[attr-defined]
            for g, (shape, dtype) in zip(grads, ctx.full)]  # type: ignore[attr-defined]
    return (torch.ops.fsdp.reduce_grad_flat(full, *ctx.args),) + (None,) * 14  # type: ignore[attr-defined]


unshard_flat.register_autograd(_unshard_flat_backward, setup_context=_unshard_flat_setup)


@torch.library.custom_op("fsdp::reduce_grad_flat", mutates_args=())
def reduce_grad_flat(
    grads: list[Tensor],
    shard_ranks: list[int],
    shard_dims: list[int],
    names: str,
    world_size: int,
    unit: int,
    ag_group: str,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """The flat's gradient: ``fsdp::reduce_grad`` of each full gradient to its piece's shape, in order."""
    return torch.cat([torch.ops.fsdp.reduce_grad(g, shape, world_size, unit, name, ag_group, rs_group,
                                                 replicate_group, replicate_size, reduce_dtype, out_dtype).reshape(-1)
                      for g, shape, name in zip(grads, unflatten_shapes(shard_ranks, shard_dims), names.split(NAMES_SEP))])


@reduce_grad_flat.register_fake
def _reduce_grad_flat_fake(grads: list[Tensor], shard_ranks: list[int], shard_dims: list[int], *args: object) -> Tensor:
    out_dtype = args[-1]
    total = sum(numel(s) for s in unflatten_shapes(shard_ranks, shard_dims))
    return grads[0].new_empty(total, dtype=out_dtype)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Bucket copies
# ---------------------------------------------------------------------------------------------

# NOTE [bucket copies]: at world size W a unit's gathered bucket is (W, N) rank-major, so each member's
# rows are strided: every member is copied out before use, and every gradient is copied in, interleaved,
# before the reduce-scatter. Written with aten ops (per member a flatten, a cast, a pad, a ``split`` and
# reshapes), Inductor lowers each member's nodes and generates a copy kernel per bucket, and its compile
# time grows with the number of parameters. As one op per copy, each is a single node to compile and a
# single launch to run, whatever the bucket holds: the members go in and come out in their own shapes,
# cast and padded inside the op (torch's ``cat(out=)``, ``split_with_sizes_copy`` and ``_chunk_cat``:
# one CUDA kernel each, as FSDP2 uses them). The ops are opaque to Inductor, which has nothing to fuse
# there anyway: the members' consumers are matmuls, and their producers too.
#
# NOTE [copies take any layout]: the pack of shards and the copy out of a gathered bucket read their
# inputs through ``reshape`` (any strides will do), so Inductor need not pin the inputs to the traced
# strides: by default it checks and fixes the layout of every tensor input of a custom op, about a
# millisecond per input when lowering the outer graph, nine shards per unit's pack. ``flexible_layout``
# lets it pass them as they are. (The gradients' pack keeps the default: ``_chunk_cat`` is left the
# layouts it was traced with.)
_ANY_LAYOUT = (torch.Tag.flexible_layout,)


@torch.library.custom_op("fsdp::pack_shards", mutates_args=(), tags=_ANY_LAYOUT)
def pack_shards(shards: list[Tensor], world: int, rank: int, dtype: torch.dtype) -> Tensor:
    """A new ``world * N`` buffer in ``dtype`` (``N``: the shards' elements) whose slice ``rank`` holds the
    shards, flattened and concatenated: an all-gather's output, this rank's part already in place
    (NOTE [in-place all-gather] in ``lower/bucket.py``); the rest is left for the collective to fill."""
    sizes = [s.numel() for s in shards]
    out = shards[0].new_empty(world * sum(sizes), dtype=dtype)
    mine = out.narrow(0, rank * sum(sizes), sum(sizes))
    torch.cat([s.reshape(-1) for s in shards], out=mine)
    return out


@pack_shards.register_fake
def _pack_shards_fake(shards: list[Tensor], world: int, rank: int, dtype: torch.dtype) -> Tensor:
    return shards[0].new_empty(world * sum(s.numel() for s in shards), dtype=dtype)


@torch.library.custom_op("fsdp::copy_out_rows", mutates_args=(), tags=_ANY_LAYOUT)
def copy_out_rows(gathered: Tensor, world: int, sizes: list[int], ranks: list[int], dims: list[int]) -> list[Tensor]:
    """``gathered`` viewed as (``world``, sum(sizes)): member ``i`` is columns ``[off_i, off_i + sizes[i])``
    of every row, its ``world`` pieces one after another; returned contiguous in its own shape, the
    next ``ranks[i]`` sizes of ``dims``, whose dim 0 may be shorter than the gathered rows (the padding
    left off, NOTE [padding])."""
    outs = [gathered.new_empty(world * s) for s in sizes]
    torch.split_with_sizes_copy(gathered.reshape(world, -1), sizes, dim=1,
                                out=[o.view(world, s) for o, s in zip(outs, sizes)])
    return [o.narrow(0, 0, numel(shape)).view(shape) for o, shape in zip(outs, unflatten_shapes(ranks, dims))]


@copy_out_rows.register_fake
def _copy_out_rows_fake(gathered: Tensor, world: int, sizes: list[int], ranks: list[int],
                        dims: list[int]) -> list[Tensor]:
    return [gathered.new_empty(shape) for shape in unflatten_shapes(ranks, dims)]


@torch.library.custom_op("fsdp::pack_rows", mutates_args=())
def pack_rows(grads: list[Tensor], world: int, dtype: torch.dtype) -> Tensor:
    """Each gradient split into ``world`` chunks of rows (dim 0, the last chunk zero-padded: NOTE
    [padding]), chunk ``r`` of every gradient in turn, flat in ``dtype``: the reduce-scatter input, rank
    ``r`` receiving chunk ``r`` (one ``_chunk_cat``)."""
    rows = [g.reshape(1) if g.dim() == 0 else g for g in grads]
    out = rows[0].new_empty(world, _chunk_numel(rows, world), dtype=dtype)
    torch._chunk_cat(rows, 0, world, out=out)
    return out.view(-1)


def _chunk_numel(grads: list[Tensor], world: int) -> int:
    total = 0
    for g in grads:
        per_row = g.numel() // g.shape[0] if g.shape[0] else 0
        total += -(-g.shape[0] // world) * per_row
    return total


@pack_rows.register_fake
def _pack_rows_fake(grads: list[Tensor], world: int, dtype: torch.dtype) -> Tensor:
    rows = [g.reshape(1) if g.dim() == 0 else g for g in grads]
    return rows[0].new_empty(world * _chunk_numel(rows, world), dtype=dtype)
