"""A bucket's copies as one op each: shards into an all-gather bucket, params out of it, gradients into a
reduce-scatter bucket.

NOTE [bucket copies]: at world size W a unit's gathered bucket is (W, N) rank-major, so each member's
rows are strided: every member is copied out before use, and every gradient is copied in, interleaved,
before the reduce-scatter. Written with aten ops (per member a flatten, a cast, a pad, a ``split`` and
reshapes), Inductor lowers each member's nodes and generates a copy kernel per bucket, and its compile
time grows with the number of parameters. As one op per copy, each is a single node to compile and a
single launch to run, whatever the bucket holds: the members go in and come out in their own shapes,
cast and padded inside the op (torch's ``cat(out=)``, ``split_with_sizes_copy`` and ``_chunk_cat``:
one CUDA kernel each, as FSDP2 uses them). The ops are opaque to Inductor, which has nothing to fuse
there anyway: the members' consumers are matmuls, and their producers too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["copy_out_rows", "flatten_shapes", "pack_rows", "pack_shards", "unflatten_shapes"]

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
    (NOTE [in-place all-gather] in ``bucket.py``); the rest is left for the collective to fill."""
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
    return [o.narrow(0, 0, _numel(shape)).view(shape) for o, shape in zip(outs, unflatten_shapes(ranks, dims))]


def flatten_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Shapes as (their ranks, their sizes one after another): what an op's schema can carry."""
    return [len(s) for s in shapes], [int(d) for s in shapes for d in s]


def unflatten_shapes(ranks: Sequence[int], dims: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for r in ranks:
        out.append(list(dims[start:start + r]))
        start += r
    return out


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel


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
