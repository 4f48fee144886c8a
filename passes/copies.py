"""A bucket's copies as one op each: out of a gathered bucket, into a reduce-scatter bucket.

NOTE [bucket copies]: at world size W a unit's gathered bucket is (W, N) rank-major, so each member's
rows are strided: every member is copied out before use, and every gradient is copied in, interleaved,
before the reduce-scatter. Written as ``split`` + ``reshape`` per member (or a ``cat`` of strided
views), Inductor lowers and launches one copy kernel per member, and its lowering time grows with the
number of parameters. As one op per bucket, each is a single node to compile and a single launch to run
(torch's ``split_with_sizes_copy`` into preallocated outputs, and ``_chunk_cat``: one CUDA kernel each,
as FSDP2 uses them). The ops are opaque to Inductor, which has nothing to fuse there anyway: the
members' consumers are matmuls, and their producers too.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["copy_out_rows", "pack_rows"]


@torch.library.custom_op("fsdp::copy_out_rows", mutates_args=())
def copy_out_rows(gathered: Tensor, world: int, sizes: list[int]) -> list[Tensor]:
    """``gathered`` viewed as (``world``, sum(sizes)): member ``i`` is columns ``[off_i, off_i + sizes[i])``
    of every row, returned contiguous and flat (``world * sizes[i]`` elements, rank-major)."""
    outs = [gathered.new_empty(world * s) for s in sizes]
    torch.split_with_sizes_copy(gathered.view(world, -1), sizes, dim=1,
                                out=[o.view(world, s) for o, s in zip(outs, sizes)])
    return outs


@copy_out_rows.register_fake
def _copy_out_rows_fake(gathered: Tensor, world: int, sizes: list[int]) -> list[Tensor]:
    return [gathered.new_empty(world * s) for s in sizes]


@torch.library.custom_op("fsdp::pack_rows", mutates_args=())
def pack_rows(flats: list[Tensor], world: int) -> Tensor:
    """Each flat ``f_i`` (``world * m_i`` elements) as (``world``, ``m_i``), concatenated along dim 1 and
    flattened: the reduce-scatter input, rank ``r`` receiving row ``r`` (one ``_chunk_cat``)."""
    return torch._chunk_cat(flats, 0, world).reshape(-1)


@pack_rows.register_fake
def _pack_rows_fake(flats: list[Tensor], world: int) -> Tensor:
    return flats[0].new_empty(sum(f.numel() for f in flats))
