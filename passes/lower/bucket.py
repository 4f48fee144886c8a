"""What a marker's parameters lower to: one collective per bucket, or one for a parameter alone.

``lower/markers.py`` decides which parameters share a collective; this file writes the collectives, as
eager code spliced into the graph (``splice.py``). A *bucket* (several parameters of one unit)::

    gather:  out = pack_shards([s_1..s_k], W, r) -> all_gather_into_tensor_out(out[r*N:(r+1)*N], out=out)
             -> wait_tensor -> copy_out_rows(out, W, [n_1..n_k])        (member i: columns off_i : off_i + n_i)
    reduce:  pack_rows([g_1..g_k], W) -> reduce_scatter_tensor -> wait_tensor [-> all_reduce -> wait_tensor]
             -> div(dp ranks) -> [cast] -> member i: as_strided(off_i, shape_i), or the output whole

(one op for each copy, NOTE [bucket copies] in ``graph_ops.py``). A parameter *alone*::

    shard -> [cast] -> all_gather_into_tensor -> wait_tensor -> [narrow] -> view
    grad -> [cast] -> [pad] -> reduce_scatter_tensor -> wait_tensor [-> all_reduce -> wait_tensor] -> div -> [cast] -> view

See NOTE [padding] in ``fsdp_compile/api/markers.py``. Where a group of one rank's collectives are
elided, only the casts (and views) remain.

NOTE [in-place all-gather]: with a separate packed input, a bucket's bytes exist twice while the
collective runs (the packed copy beside the output), and at world size 1 NCCL copies the one into the
other. Packing into the output's own slice needs this rank's index in the group (``rank``, from the
pass's ``rank_of(group)``); ``pack_shards`` writes the slice in one kernel. Without it the bucket is
packed out of place (``pack_shards -> all_gather_into_tensor``).

NOTE [a flat gathers as it is]: a bucket whose one input is a contiguous shard already in the gather's
dtype and of the bucket's size (a unit's flat shard, NOTE [flat shards] in
``fsdp_compile/api/flat_shard.py``) is gathered straight from that shard, out of place. The in-place
gather exists to keep a packed copy from living beside the output; here the input is the persistent
shard, which lives anyway, so packing would only add a copy kernel on the compute stream.

NOTE [pieces as strided views]: a member of a bucket's 1-D result is one ``as_strided`` node, where
``split`` and a ``view`` of each piece take two and one more, each a node Inductor lowers (nine pieces per
unit and graph). A contiguous piece is the same view either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx

from ..graph_ops import flatten_shapes, numel  # (and registers the fsdp::* copy ops)
from ..splice import splice

__all__ = ["cast", "splice_gather", "splice_reduce"]

c10d = torch.ops._c10d_functional


def cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``x`` in ``dtype`` as the prim Inductor lowers (``Tensor.to`` would trace to ``_to_copy``)."""
    if dtype is None or x.dtype == dtype:
        return x
    return torch.ops.prims.convert_element_type.default(x, dtype)


def _gather(x: Tensor, world: int, group: str, elide: bool) -> Tensor:
    if world == 1 and elide:
        return x
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group))


def _gather_alone(world: int, group: str, dtype: torch.dtype, shape: Sequence[int], elide: bool
                  ) -> Callable[[Tensor], list[Tensor]]:
    def fn(shard: Tensor) -> list[Tensor]:
        x = cast(shard, dtype)  # (the shard in its shape, or 1-D: a flat of this one parameter)
        rows = _gather(x.reshape(-1), world, group, elide).view(-1, *shape[1:])
        dim0 = shape[0] if shape else 1
        if rows.shape[0] != dim0:  # padding (NOTE [padding])
            rows = rows[:dim0]
        return [rows.reshape(list(shape))]

    return fn


def _gather_bucket(world: int, group: str, sizes: Sequence[int], rank: int | None, dtype: torch.dtype,
                   shapes: Sequence[Sequence[int]]) -> Callable[..., list[Tensor]]:
    def fn(*shards: Tensor) -> list[Tensor]:
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

    return fn


def _reduce_alone(world: int, group: str, dtype: torch.dtype | None, shape: Sequence[int], elide: bool,
                  replicated: bool) -> Callable[[Tensor], list[Tensor]]:
    """Cast, pad (NOTE [padding]) and reduce-scatter one full gradient: this rank's rows, flat. Where
    elided, a gradient already in the shard's shape (a strided one, a transposed matmul's, is not
    flattened only to be viewed back) goes on as it is: cast once, by the finish, to the shard's dtype."""
    def fn(grad: Tensor) -> list[Tensor]:
        if world == 1 and elide and tuple(grad.shape) == tuple(shape):
            return [cast(grad, dtype) if replicated else grad]
        g = cast(grad.reshape(-1), dtype)
        padded = numel(shape) * world
        if g.numel() < padded:
            g = torch.nn.functional.pad(g, (0, padded - g.numel()))
        if world == 1 and elide:
            return [g]
        return [c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", world, group))]

    return fn


def _reduce_bucket(world: int, group: str, dtype: torch.dtype) -> Callable[..., list[Tensor]]:
    def fn(*grads: Tensor) -> list[Tensor]:
        packed = torch.ops.fsdp.pack_rows(list(grads), world, dtype)  # NOTE [bucket copies]
        return [c10d.wait_tensor(c10d.reduce_scatter_tensor(packed, "sum", world, group))]

    return fn


def _finish(replicate_group: str, divisor: int | None, out_dtype: torch.dtype, sizes: Sequence[int],
            shapes: Sequence[Sequence[int]] | None) -> Callable[[Tensor], list[Tensor]]:
    """The end of a reduction: the all-reduce across replicas (HSDP), one average and one cast, then
    each member's piece in its own shape (``shapes`` ``None``: the result whole, a flat shard's gradient)."""
    def fn(out: Tensor) -> list[Tensor]:
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

    return fn


def _pieces(flat: Tensor, sizes: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Member ``i``: the next ``sizes[i]`` elements of the contiguous 1-D ``flat``, viewed as ``shapes[i]``
    (NOTE [pieces as strided views])."""
    out, offset = [], flat.storage_offset()
    for size, shape in zip(sizes, shapes):
        strides, step = [], 1
        for d in reversed(list(shape)):
            strides.append(step)
            step *= int(d)
        out.append(flat.as_strided(list(shape), strides[::-1], offset))
        offset += int(size)
    return out


def _cut(cuts: Sequence[tuple[int, Sequence[int]]]) -> Callable[[Tensor], list[Tensor]]:
    """The pieces ``(offset, shape)`` of a 1-D flat shard."""
    return lambda flat: [flat.narrow(0, offset, numel(shape)).view(list(shape)) for offset, shape in cuts]


def splice_gather(graph: fx.Graph, inputs: Sequence[fx.Node], *, before: fx.Node, meta: dict[str, object],
                  world: int, group: str, sizes: Sequence[int], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                  rank: int | None, elide: bool, cuts: Sequence[tuple[int, Sequence[int]]] | None = None,
                  whole: bool = False, inserted: list[fx.Node] | None = None) -> list[fx.Node]:
    """Splice the gather of the members of ``sizes`` elements per rank (full ``shapes``, gathered in
    ``dtype``) before ``before``; returns their full parameters. ``inputs``: the members' shards, or one
    flat shard that ``cuts`` (``(offset, shard shape)`` per member) cuts them from, or that is the
    members ``whole``. One member goes alone, several share a bucket."""
    alone = len(sizes) == 1 and not whole
    if alone:
        body = _gather_alone(world, group, dtype, shapes[0], elide)
    else:
        body = _gather_bucket(world, group, sizes, rank, dtype, shapes)
    cut = _cut(cuts) if cuts is not None else None
    fn = body if cut is None else (lambda flat: body(*cut(flat)))
    key = ("gather", alone, world, group, tuple(sizes), rank, dtype, elide, _shapes_key(shapes),
           None if cuts is None else tuple((o, tuple(s)) for o, s in cuts))
    return splice(graph, fn, inputs, before=before, meta=meta, inserted=inserted, cache_key=key)


def splice_reduce(graph: fx.Graph, grads: Sequence[fx.Node], *, before: fx.Node, meta: dict[str, object],
                  world: int, group: str, sizes: Sequence[int], shapes: Sequence[Sequence[int]],
                  dtype: torch.dtype | None, replicate_group: str, divisor: int | None, out_dtype: torch.dtype,
                  elide: bool, whole: bool = False) -> list[fx.Node]:
    """Splice the reduction of the full ``grads`` (shard ``shapes`` of ``sizes`` elements, reduced in
    ``dtype``) before ``before``; returns each member's shard gradient (``whole``: the one 1-D result, a
    flat shard's gradient). One member goes alone, several share a bucket; with a ``replicate_group``
    (HSDP) an all-reduce follows the reduce-scatter, as a region of its own."""
    alone = len(grads) == 1 and not whole
    if alone:
        scatter = _reduce_alone(world, group, dtype, shapes[0], elide, bool(replicate_group))
    else:
        assert dtype is not None, "a bucket's gradients are reduced in one dtype"
        scatter = _reduce_bucket(world, group, dtype)
    key = (alone, world, group, tuple(sizes), dtype, elide, bool(replicate_group), _shapes_key(shapes))
    (out,) = splice(graph, scatter, grads, before=before, meta={**meta, "kind": "reduce_scatter"},
                    cache_key=("scatter",) + key)
    finish = _finish(replicate_group, divisor, out_dtype, sizes, None if whole else shapes)
    kind = "all_reduce" if replicate_group else "reduce_scatter"
    return splice(graph, finish, [out], before=before, meta={**meta, "kind": kind},
                  cache_key=("finish", replicate_group, divisor, out_dtype, whole) + key)


def _shapes_key(shapes: Sequence[Sequence[int]]) -> tuple:
    return tuple(tuple(s) for s in shapes)
