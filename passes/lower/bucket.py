"""The collectives a marker's parameters lower to, as eager code spliced into the graph (``splice.py``).

A *bucket* (several parameters of one unit; one op per copy, NOTE [bucket copies] in ``graph_ops.py``)::

    gather:  out = pack_shards([s_1..s_k], W, r) -> all_gather_into_tensor_out(out[r*N:(r+1)*N], out=out)
             -> wait_tensor -> copy_out_rows(out, W, [n_1..n_k])        (member i: columns off_i : off_i + n_i)
    reduce:  pack_rows([g_1..g_k], W) -> reduce_scatter_tensor -> wait_tensor [-> all_reduce -> wait_tensor]
             -> div(dp ranks) -> [cast] -> member i: as_strided(off_i, shape_i), or the output whole

A parameter *alone* (padding: NOTE [padding] in ``fsdp_compile/api/markers.py``; where a one-rank group's
collectives are elided, only the casts and views remain)::

    shard -> [cast] -> all_gather_into_tensor -> wait_tensor -> [narrow] -> view
    grad -> [cast] -> [pad] -> reduce_scatter_tensor -> wait_tensor [-> all_reduce -> wait] -> div -> [cast] -> view

NOTE [in-place all-gather]: a separately packed input would exist beside the output while the collective
runs (and at world size 1 NCCL copies one into the other). Given this rank's index in the group
(``rank_of``), ``pack_shards`` writes the shards straight into the output's own slice; without it the
bucket is packed out of place.

NOTE [a flat gathers as it is]: a bucket whose one input is a contiguous shard in the gather's dtype and of
the bucket's size (a flat shard, NOTE [flat shards] in ``fsdp_compile/api/flat_shard.py``) is gathered
straight from it, out of place: the shard lives anyway, and packing would only add a copy.

NOTE [pieces as strided views]: each member of a bucket's 1-D result is one ``as_strided`` node (``split``
and ``view`` take two and more, each lowered by Inductor).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, fx

from ..graph_ops import flatten_shapes, numel  # (registers the fsdp:: copy ops)
from ..splice import splice

__all__ = ["cast", "splice_gather", "splice_reduce"]

c10d = torch.ops._c10d_functional


def cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``x`` in ``dtype``, as the prim Inductor lowers (not ``_to_copy``)."""
    if dtype is None or x.dtype == dtype:
        return x
    return torch.ops.prims.convert_element_type.default(x, dtype)


def _gather_alone(world: int, group: str, dtype: torch.dtype, shape: Sequence[int], elide: bool,
                  shard: Tensor) -> list[Tensor]:
    rows = cast(shard, dtype).reshape(-1)  # (the shard in its shape, or a flat of this one parameter)
    if not (world == 1 and elide):
        rows = c10d.wait_tensor(c10d.all_gather_into_tensor(rows, world, group))
    rows = rows.view(-1, *shape[1:])
    dim0 = shape[0] if shape else 1
    if rows.shape[0] != dim0:  # padding (NOTE [padding])
        rows = rows[:dim0]
    return [rows.reshape(list(shape))]


def _gather_bucket(world: int, group: str, sizes: Sequence[int], rank: int | None, dtype: torch.dtype,
                   shapes: Sequence[Sequence[int]], *shards: Tensor) -> list[Tensor]:
    n = sum(sizes)
    if len(shards) == 1 and shards[0].dtype == dtype and shards[0].is_contiguous() and shards[0].numel() == n:
        flat = shards[0] if shards[0].dim() == 1 else shards[0].reshape(-1)  # NOTE [a flat gathers as it is]
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, world, group))
    elif rank is None:
        packed = torch.ops.fsdp.pack_shards(list(shards), 1, 0, dtype)
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(packed, world, group))
    else:  # NOTE [in-place all-gather]
        buffer = torch.ops.fsdp.pack_shards(list(shards), world, rank, dtype)
        out = c10d.wait_tensor(c10d.all_gather_into_tensor_out(buffer.narrow(0, rank * n, n), world, group,
                                                               out=buffer))
    if world == 1:  # one row: each member is a contiguous slice already, and unpadded
        return _pieces(out, sizes, shapes)
    return list(torch.ops.fsdp.copy_out_rows(out, world, list(sizes), *flatten_shapes(shapes)))


def _reduce_alone(world: int, group: str, dtype: torch.dtype | None, shape: Sequence[int], elide: bool,
                  replicated: bool, grad: Tensor) -> list[Tensor]:
    """Cast, pad (NOTE [padding]) and reduce-scatter one full gradient to this rank's rows, flat. Where
    elided, a gradient already in the shard's shape goes on as it is (not flattened only to be viewed back)."""
    if world == 1 and elide and tuple(grad.shape) == tuple(shape):
        return [cast(grad, dtype) if replicated else grad]
    g = cast(grad.reshape(-1), dtype)
    padded = numel(shape) * world
    if g.numel() < padded:
        g = torch.nn.functional.pad(g, (0, padded - g.numel()))
    if world == 1 and elide:
        return [g]
    return [c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", world, group))]


def _reduce_bucket(world: int, group: str, dtype: torch.dtype, *grads: Tensor) -> list[Tensor]:
    packed = torch.ops.fsdp.pack_rows(list(grads), world, dtype)  # NOTE [bucket copies]
    return [c10d.wait_tensor(c10d.reduce_scatter_tensor(packed, "sum", world, group))]


def _finish(replicate_group: str, divisor: int | None, out_dtype: torch.dtype, sizes: Sequence[int],
            shapes: Sequence[Sequence[int]] | None, out: Tensor) -> list[Tensor]:
    """The end of a reduction: the all-reduce across replicas (HSDP), average, cast, then each member's
    piece in its shape (``shapes`` ``None``: the result whole, a flat shard's gradient)."""
    if replicate_group:
        out = c10d.wait_tensor(c10d.all_reduce(out, "sum", replicate_group))
    if divisor is not None:
        out = out / divisor
    out = cast(out, out_dtype)
    if shapes is None:
        return [out]
    if len(shapes) == 1:
        return [out if tuple(out.shape) == tuple(shapes[0]) else out.view(list(shapes[0]))]
    return _pieces(out, sizes, shapes)


def _pieces(flat: Tensor, sizes: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Member ``i``: the next ``sizes[i]`` elements of the contiguous 1-D ``flat`` as ``shapes[i]`` (NOTE
    [pieces as strided views])."""
    out, offset = [], flat.storage_offset()
    for size, shape in zip(sizes, shapes):
        strides, step = [], 1
        for d in reversed(list(shape)):
            strides.append(step)
            step *= int(d)
        out.append(flat.as_strided(list(shape), strides[::-1], offset))
        offset += int(size)
    return out


def splice_gather(graph: fx.Graph, inputs: Sequence[fx.Node], *, before: fx.Node, meta: dict[str, object],
                  world: int, group: str, sizes: Sequence[int], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                  rank: int | None, elide: bool, cuts: Sequence[tuple[int, Sequence[int]]] | None = None,
                  whole: bool = False, inserted: list[fx.Node] | None = None) -> list[fx.Node]:
    """Splice before ``before`` the gather, in ``dtype``, of members of ``sizes`` elements per rank and full
    ``shapes``; return their full parameters. ``inputs``: the members' shards, or one flat shard that
    ``cuts`` (``(offset, shard shape)`` per member) cuts them from, or that is the members ``whole``."""
    alone = len(sizes) == 1 and not whole
    body = (partial(_gather_alone, world, group, dtype, shapes[0], elide) if alone
            else partial(_gather_bucket, world, group, sizes, rank, dtype, shapes))

    def fn(*shards: Tensor) -> list[Tensor]:  # (with ``cuts``: one flat shard, cut into the members)
        if cuts is None:
            return body(*shards)
        return body(*[shards[0].narrow(0, offset, numel(shape)).view(list(shape)) for offset, shape in cuts])

    key = ("gather", alone, world, group, tuple(sizes), rank, dtype, elide, _shapes_key(shapes),
           None if cuts is None else tuple((o, tuple(s)) for o, s in cuts))
    return splice(graph, fn, inputs, before=before, meta=meta, inserted=inserted, cache_key=key)


def splice_reduce(graph: fx.Graph, grads: Sequence[fx.Node], *, before: fx.Node, meta: dict[str, object],
                  world: int, group: str, sizes: Sequence[int], shapes: Sequence[Sequence[int]],
                  dtype: torch.dtype | None, replicate_group: str, divisor: int | None, out_dtype: torch.dtype,
                  elide: bool, whole: bool = False) -> list[fx.Node]:
    """Splice before ``before`` the reduction, in ``dtype``, of the full ``grads`` (shard ``shapes`` of
    ``sizes`` elements); return each member's shard gradient (``whole``: the one 1-D result). With a
    ``replicate_group`` (HSDP) an all-reduce follows, as a region of its own."""
    alone = len(grads) == 1 and not whole
    if alone:
        scatter = partial(_reduce_alone, world, group, dtype, shapes[0], elide, bool(replicate_group))
    else:
        assert dtype is not None, "a bucket's gradients are reduced in one dtype"
        scatter = partial(_reduce_bucket, world, group, dtype)
    key = (alone, world, group, tuple(sizes), dtype, elide, bool(replicate_group), _shapes_key(shapes))
    (out,) = splice(graph, scatter, grads, before=before, meta={**meta, "kind": "reduce_scatter"},
                    cache_key=("scatter",) + key)
    finish = partial(_finish, replicate_group, divisor, out_dtype, sizes, None if whole else shapes)
    kind = "all_reduce" if replicate_group else "reduce_scatter"
    return splice(graph, finish, [out], before=before, meta={**meta, "kind": kind},
                  cache_key=("finish", replicate_group, divisor, out_dtype, whole) + key)


def _shapes_key(shapes: Sequence[Sequence[int]]) -> tuple:
    return tuple(tuple(s) for s in shapes)
