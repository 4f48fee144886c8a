"""Bucket per unit: one all-gather and one reduce-scatter per unit per graph.

Before (after ``lower``), one collective per parameter::

    x_i -> all_gather_into_tensor -> wait_tensor -> (W * n_i,)        for each param i of the unit

After, one collective per (unit, group, dtype), packed and unpacked around it. An all-gather is
in place (NOTE [in-place all-gather]): the members are packed straight into this rank's slice of the
output, which the collective then fills around it::

    out = empty(W * N); out[r*N : (r+1)*N].copy_(cat(x_1..x_k))
    -> all_gather_into_tensor_out(out[r*N : (r+1)*N], out=out) -> wait_tensor
    -> fsdp.copy_out_rows(out, W, [n_1..n_k])          (member i: columns off_i : off_i + n_i of each row)

and for gradients (each ``g_i`` already padded to ``W * m_i``)::

    fsdp.pack_rows([g_1..g_k], W) -> reduce_scatter_tensor -> wait_tensor -> [off_i : off_i + m_i]

(one op for each copy, NOTE [bucket copies] in ``graph_ops.py``)

and, for HSDP, the all-reduces across replicas likewise (``cat -> all_reduce -> wait -> split``).

NOTE [in-place all-gather]: with a separate packed input, a bucket's bytes exist twice while the
collective runs (the packed copy beside the output), and at world size 1 NCCL copies the one into the
other. Packing into the output's own slice needs this rank's index in the group, which the pass gets
from ``rank_of(group)``; Inductor fuses ``copy_(cat(...))`` into one kernel that writes the slice.
Without ``rank_of`` the bucket is packed out of place (``cat -> all_gather_into_tensor``). A unit's
flat shard is neither packed nor gathered in place: it is gathered as it is (NOTE [a flat gathers as it is]).

NOTE [large params alone]: a parameter is stored as a dim-0 shard, so its own all-gather's output *is*
the full parameter (rank-major rows) and its own reduce-scatter's output is its shard's gradient: alone,
it needs neither a pack nor an unpack copy (in a bucket, world > 1 makes every member's gathered rows
strided, copied out to be used). With ``alone_bytes`` set, a member whose full size is at least that many
bytes keeps its own collective; the smaller ones share the unit's bucket, where one launch pays for them
all. Large collectives run near the links' bandwidth alone; the scheduling passes place a unit's
collectives together (``prefetch`` counts units, not collectives). HSDP units are always bucketed, and so
is a gradient whose reduction casts it (``reduce_dtype`` other than its dtype): the cast it needs anyway
writes it straight into its slice of the bucket, so alone it would save no copy, and for a flat shard
(NOTE [flat shards]) the bucket's output *is* the unit's gradient where alone pieces are copied together
again; what alone would cost is a launch per parameter, host time that a backward of large matmuls
cannot spare (the GPU idles between the launches: docs/performance.md).

Only collectives of one group, one dtype and one world size share a bucket, and members are packed in
graph order, which is the same on every rank. The bucket is placed where its first member was (an
all-gather) or where its last member was (a reduce-scatter); ``order.reorder`` then makes the graph
legal again, moving each member's consumers after the bucket's wait.

NOTE [gradients in stretches]: a unit's gradients usually exist together, in its own stretch of
backward. A unit that holds others (the root) does not: its output head's gradient exists at the start of
backward, its embedding's at the end, with every block's backward between. Its reduce-scatter members
are split where another unit's reduce-scatter comes between two of them in graph order, and each
stretch is a bucket of its own, launched as soon as that stretch exists (``schedule/reduce_scatter.py``):
the head's bucket runs under the blocks' backward instead of waiting, full size and cast to the reduce
dtype, for the embedding. In such a unit a stretch is split too before a member whose gradient needs
an all-gather that the members before it do not: the head's weight gradient needs only the loss's
gradient and the saved input, the final norm's needs the head's gathered weight (through the gradient
of its output), and in one bucket the head's reduce-scatter would wait for that gather and the matmul
behind it, at the start of backward, while the reduce-scatter link has nothing else to do. (A unit
whose gradients exist together, such as a block, is not split so: its gathers are prefetched and the
link is busy with the unit before, so a split only adds a launch.)
Pieces of one flat shard's gradient are never split (that gradient is one tensor); ``fully_shard``
lays out no flat for a unit that holds others (``flat_shard.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx

from ..graph_ops import flatten_shapes  # (and registers the fsdp::* copy ops)
from ..order import reorder
from ..predicates import (
    flat_piece,
    fsdp_meta,
    gathers_needed,
    is_all_gather,
    is_all_reduce,
    is_reduce_scatter,
    tensor_bytes,
    wait_of,
)
from ..splice import splice

__all__ = ["bucket_pass", "splice_gather_bucket", "splice_reduce_bucket"]

c10d = torch.ops._c10d_functional


def _bucket_key(launch: fx.Node) -> tuple:
    meta = fsdp_meta(launch)
    val = launch.args[0].meta["val"]  # type: ignore[union-attr]
    return (meta.get("unit"), launch.args[-1], val.dtype, launch.args[-2], launch.target)


def _groups(gm: fx.GraphModule, match: Callable[[fx.Node], bool], stretches: bool = False) -> list[list[fx.Node]]:
    """Each unit's collectives of ``match``, one list per bucket key, in graph order; ``stretches``: split
    where another unit's collective comes between two members (NOTE [gradients in stretches])."""
    buckets: dict[tuple, list[list[fx.Node]]] = {}
    previous = None  # the unit of the last collective seen
    for node in gm.graph.nodes:
        if not match(node) or (unit := fsdp_meta(node).get("unit")) is None:
            continue
        runs = buckets.setdefault(_bucket_key(node), [[]])
        if stretches and runs[-1] and previous != unit and not _flat_gradient(node):
            runs.append([])
        runs[-1].append(node)
        previous = unit
    if stretches and any(len(runs) > 1 for runs in buckets.values()):
        needs = gathers_needed(gm)
        for key, runs in buckets.items():
            if len(runs) > 1:
                buckets[key] = [part for run in runs for part in _split_at_gathers(run, needs)]
    return [run for runs in buckets.values() for run in runs]


def _split_at_gathers(run: list[fx.Node], needs: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """``run`` split before each member that needs an all-gather its earlier members do not."""
    parts: list[list[fx.Node]] = [[]]
    needed = 0
    for node in run:
        if parts[-1] and needs[node] & ~needed:
            parts.append([])
        parts[-1].append(node)
        needed |= needs[node]
    return parts


def _flat_gradient(launch: fx.Node) -> bool:
    """Whether the reduce-scatter ``launch`` lands in a piece of a flat shard's gradient (one gradient
    tensor for the unit: its pieces are reduced in one bucket, whenever they exist)."""
    return _destination(_member_end(wait_of(launch), fsdp_meta(launch).get("kind"))[0]) is not None


aten, prims = torch.ops.aten, torch.ops.prims
# What lowering puts between a member's tensor and its collective (flatten, cast, pad) and after its
# wait (unflatten, narrow, average, cast): the bucket's copies do all of it (NOTE [bucket copies]).
_INTO = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
         prims.convert_element_type.default, aten.constant_pad_nd.default}
_OUT_OF = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
           aten.div.Tensor, prims.convert_element_type.default}


def _member_source(launch: fx.Node) -> fx.Node:
    """``x -> [cast, flatten, pad] -> launch``: the ``x`` a member's collective was lowered from."""
    kind = fsdp_meta(launch).get("kind")
    node = launch.args[0]
    assert isinstance(node, fx.Node)
    while (node.op == "call_function" and node.target in _INTO and fsdp_meta(node).get("kind") == kind
           and isinstance(node.args[0], fx.Node) and node.args[0].meta["val"].dim() >= 1):
        node = node.args[0]
    return node


def _member_end(wait: fx.Node, kind: object) -> tuple[fx.Node, list[fx.Node]]:
    """``wait -> [unflatten, narrow, div, cast] -> end -> users``: ``end`` and the nodes up to it."""
    chain: list[fx.Node] = []
    node = wait
    while len(node.users) == 1:
        (user,) = node.users
        if not (user.op == "call_function" and user.target in _OUT_OF and fsdp_meta(user).get("kind") == kind):
            break
        chain.append(user)
        node = user
    return node, chain


def _divisor(chain: list[fx.Node]) -> object:
    divs = [n.args[1] for n in chain if n.target is aten.div.Tensor]
    return divs[0] if divs else None


def _gather_bucket(world: int, group: str, sizes: Sequence[int], rank: int | None, dtype: torch.dtype,
                   shapes: Sequence[Sequence[int]]) -> Callable[..., list[Tensor]]:
    def fn(*shards: Tensor) -> list[Tensor]:
        if _gathers_as_is(shards, dtype, sum(sizes)):  # NOTE [a flat gathers as it is]
            flat = shards[0] if shards[0].dim() == 1 else shards[0].reshape(-1)
            out = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, world, group))
        elif rank is None:
            packed = torch.ops.fsdp.pack_shards(list(shards), 1, 0, dtype)
            out = c10d.wait_tensor(c10d.all_gather_into_tensor(packed, world, group))
        else:  # NOTE [in-place all-gather]
            n = sum(sizes)
            buffer = torch.ops.fsdp.pack_shards(list(shards), world, rank, dtype)
            out = c10d.wait_tensor(c10d.all_gather_into_tensor_out(buffer.narrow(0, rank * n, n), world, group,
                                                                   out=buffer))
        if world == 1:  # one row: each member is a contiguous slice already, and unpadded
            return _pieces(out, sizes, shapes)
        return list(torch.ops.fsdp.copy_out_rows(out, world, list(sizes), *flatten_shapes(shapes)))

    return fn


def _gathers_as_is(shards: Sequence[Tensor], dtype: torch.dtype, n: int) -> bool:
    """NOTE [a flat gathers as it is]: a bucket whose one member is a contiguous shard already in the
    gather's dtype and of the bucket's size (a unit's flat shard, NOTE [flat markers] in ``capture/group_markers.py``) is
    gathered straight from that shard, out of place. The in-place gather exists to keep a packed copy
    from living beside the output (NOTE [in-place all-gather]); here the input is the persistent shard,
    which lives anyway, so packing would only add a copy kernel on the compute stream (and two nodes per
    unit and graph for Inductor to lower: the pack and its slice)."""
    return (len(shards) == 1 and shards[0].dtype == dtype and shards[0].is_contiguous()
            and shards[0].numel() == n)


def _reduce_bucket(world: int, group: str, sizes: Sequence[int], dtype: torch.dtype, divisor: object,
                   out_dtype: torch.dtype, shapes: Sequence[Sequence[int]]) -> Callable[..., list[Tensor]]:
    def fn(*flats: Tensor) -> list[Tensor]:
        out = c10d.wait_tensor(c10d.all_reduce(torch.cat([f.reshape(-1) for f in flats]), "sum", group))
        return _finish(out, sizes, divisor, out_dtype, shapes)

    return fn


def _scatter_bucket(world: int, group: str, sizes: Sequence[int], dtype: torch.dtype, divisor: object,
                    out_dtype: torch.dtype, shapes: Sequence[Sequence[int]], whole: bool = False
                    ) -> Callable[..., list[Tensor]]:
    def fn(*grads: Tensor) -> list[Tensor]:
        packed = torch.ops.fsdp.pack_rows(list(grads), world, dtype)  # NOTE [bucket copies]
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(packed, "sum", world, group))
        return _finish(out, sizes, divisor, out_dtype, None if whole else shapes)

    return fn


def _finish(out: Tensor, sizes: Sequence[int], divisor: object, out_dtype: torch.dtype,
            shapes: Sequence[Sequence[int]] | None) -> list[Tensor]:
    """One average and one cast for the whole bucket, then each member's piece in its own shape
    (``shapes`` ``None``: the bucket whole, a flat shard's gradient, NOTE [flat markers] in
    ``capture/group_markers.py``)."""
    if divisor is not None:
        out = out / divisor
    if out.dtype != out_dtype:
        out = torch.ops.prims.convert_element_type.default(out, out_dtype)
    return [out] if shapes is None else _pieces(out, sizes, shapes)


def _pieces(flat: Tensor, sizes: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Member ``i``: the next ``sizes[i]`` elements of the contiguous 1-D ``flat``, viewed as ``shapes[i]``.

    NOTE [pieces as strided views]: one ``as_strided`` node per member, where ``split`` and a ``view`` of
    each piece took two and one more (the ``split`` itself); Inductor lowered each ``view`` of a piece in
    about a millisecond, nine per unit and graph. A contiguous piece is the same view either way."""
    out, offset = [], flat.storage_offset()
    for size, shape in zip(sizes, shapes):
        strides, step = [], 1
        for d in reversed(list(shape)):
            strides.append(step)
            step *= int(d)
        out.append(flat.as_strided(list(shape), strides[::-1], offset))
        offset += int(size)
    return out


def splice_gather_bucket(graph: fx.Graph, shards: Sequence[fx.Node], *, before: fx.Node, meta: dict[str, object],
                         world: int, group: str, sizes: Sequence[int], rank: int | None, dtype: torch.dtype,
                         shapes: Sequence[Sequence[int]], inserted: list[fx.Node] | None = None) -> list[fx.Node]:
    """Splice one unit's all-gather bucket before ``before``: ``shards`` (in any dtype, of ``sizes``
    elements) packed, gathered in ``dtype`` and copied out as full parameters of ``shapes``; returns those."""
    make = _gather_bucket(world, group, sizes, rank, dtype, shapes)
    key = ("gather", world, group, tuple(sizes), rank, dtype, tuple(tuple(s) for s in shapes))
    return splice(graph, make, shards, before=before, meta=meta, inserted=inserted, cache_key=key)


def splice_reduce_bucket(graph: fx.Graph, grads: Sequence[fx.Node], *, before: fx.Node, meta: dict[str, object],
                         world: int, group: str, sizes: Sequence[int], dtype: torch.dtype, divisor: object,
                         out_dtype: torch.dtype, shapes: Sequence[Sequence[int]], all_reduce: bool = False,
                         inserted: list[fx.Node] | None = None, whole: bool = False) -> list[fx.Node]:
    """Splice one unit's reduce-scatter bucket (``all_reduce``: its HSDP all-reduce) before ``before``:
    the full ``grads`` packed in ``dtype`` and reduced, the ``sizes``-element results averaged
    (``divisor``), cast to ``out_dtype`` and viewed as ``shapes``; returns those (``whole``: the one 1-D
    result instead, a flat shard's gradient)."""
    assert not (whole and all_reduce), "a flat shard's gradient comes out of a reduce-scatter"
    if whole:
        make = _scatter_bucket(world, group, sizes, dtype, divisor, out_dtype, shapes, whole=True)
    else:
        make = (_reduce_bucket if all_reduce else _scatter_bucket)(world, group, sizes, dtype, divisor, out_dtype,
                                                                   shapes)
    name = "whole" if whole else (_reduce_bucket if all_reduce else _scatter_bucket).__name__
    key = (name, world, group, tuple(sizes), dtype, divisor, out_dtype, tuple(tuple(s) for s in shapes))
    return splice(graph, make, grads, before=before, meta=meta, inserted=inserted, cache_key=key)


def _flat_order(members: list[fx.Node], gather: bool) -> tuple[list[fx.Node], fx.Node | None]:
    """NOTE [flat markers] in ``capture/group_markers.py``: members that are the pieces of one flat shard,
    all of them, in the flat's order, and the flat (the bucket then packs it whole: no view of it left in
    the graph); for gradients, members whose results are scattered into one flat's gradient, in its order (``tiles.py``
    then takes the bucket's output whole), and ``None``. Else ``members`` as they are, and ``None``."""
    if gather:
        pieces = [flat_piece(_member_source(m)) for m in members]
    else:
        pieces = [_destination(_member_end(wait_of(m), fsdp_meta(m).get("kind"))[0]) for m in members]
    if any(p is None for p in pieces) or len({p[0] for p in pieces}) != 1:  # type: ignore[index]
        return members, None
    ordered = sorted(zip(pieces, members), key=lambda pm: pm[0][1])  # type: ignore[index]
    base, offset = pieces[0][0], 0  # type: ignore[index]
    for (_, start, n, *_), _ in ordered:  # type: ignore[misc]
        if start != offset:
            return members, None
        offset += n
    if offset != base.meta["val"].numel():
        return members, None
    return [m for _, m in ordered], (base if gather else None)


def _destination(end: fx.Node) -> tuple[fx.Node, int, int] | None:
    """``end -> [view] -> slice_scatter(zeros, ., 0, start, stop)``: ``(zeros, start, stop - start)``."""
    node = end
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is aten.slice_scatter.default and user.args[1] is node and len(user.args) >= 5:
            z, _, dim, start, stop = user.args[:5]
            if dim == 0 and isinstance(start, int) and isinstance(stop, int) and isinstance(z, fx.Node):
                return z, start, stop - start
            return None
        if user.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return None
        node = user
    return None


def _merge(gm: fx.GraphModule, members: list[fx.Node], *, gather: bool, hoist: dict[fx.Node, fx.Node],
           rank_of: Callable[[str], int] | None = None) -> None:
    reduce = is_all_reduce(members[0])
    # An all-gather goes where its first member was; a reduce-scatter where its last one was, which
    # is after all its inputs (each member came right after its own input).
    anchor = members[0] if gather else members[-1]
    members, flat = _flat_order(members, gather) if not reduce else (members, None)
    kind = fsdp_meta(members[0]).get("kind")
    world = 1 if reduce else int(members[0].args[-2])  # type: ignore[arg-type]
    group = str(members[0].args[-1])
    flats = [m.args[0] for m in members]
    dtype = flats[0].meta["val"].dtype  # type: ignore[union-attr]
    ends = [_member_end(wait_of(m), kind) for m in members]
    sizes = [int(f.meta["val"].numel()) // (1 if gather else world) for f in flats]  # type: ignore[union-attr]
    shapes = [tuple(end.meta["val"].shape) for end, _ in ends]
    meta = dict(fsdp_meta(members[0]))
    meta.pop("param", None)
    meta["params"] = [fsdp_meta(m).get("param") for m in members]
    new_nodes: list[fx.Node] = []
    if gather:
        sources = [_member_source(m) for m in members]
        inputs = [flat] if flat is not None else sources
        rank = rank_of(group) if rank_of is not None else None
        outs = splice_gather_bucket(gm.graph, inputs, before=anchor, meta=meta, inserted=new_nodes, world=world,
                                    group=group, sizes=sizes, rank=rank, dtype=dtype, shapes=shapes)
    else:
        divisors = {repr(_divisor(chain)) for _, chain in ends}
        out_dtypes = {end.meta["val"].dtype for end, _ in ends}
        assert len(divisors) == 1 and len(out_dtypes) == 1, "one unit's members are averaged and cast alike"
        divisor, out_dtype = _divisor(ends[0][1]), out_dtypes.pop()
        inputs = flats if reduce else [_member_source(m) for m in members]
        outs = splice_reduce_bucket(gm.graph, inputs, before=anchor, meta=meta, inserted=new_nodes, world=world,
                                    group=group, sizes=sizes, dtype=dtype, divisor=divisor, out_dtype=out_dtype,
                                    shapes=shapes, all_reduce=reduce)
    if gather:
        # The inputs (casts and views of graph inputs) move up with the bucket.
        for inp in inputs:
            for n in _ancestors(inp):  # type: ignore[arg-type]
                hoist.setdefault(n, new_nodes[0])
    for (end, _), out in zip(ends, outs):
        end.replace_all_uses_with(out)
    for member, (_, chain) in zip(members, ends):
        for n in [*reversed(chain), wait_of(member), member]:
            gm.graph.erase_node(n)
    _erase_unused(flats, kind)
    if gather and flat is not None:  # the flat's pieces, packed apart no more
        _erase_unused(sources, None)


def _erase_unused(nodes: Sequence[object], kind: object) -> None:
    """Erase ``nodes`` and the lowering nodes before them (tagged ``kind``) that nothing reads now."""
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function" or fsdp_meta(n).get("kind") != kind:
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen[n] = None
        stack.extend(n.all_input_nodes)
    return list(seen)


def _alone(launch: fx.Node, alone_bytes: int | None) -> bool:
    """(NOTE [large params alone]) Does this member keep its own collective?"""
    meta = fsdp_meta(launch)
    if alone_bytes is None or meta.get("replicate_group") or (is_reduce_scatter(launch) and meta.get("casts")):
        return False
    full = tensor_bytes(wait_of(launch)) if is_all_gather(launch) else tensor_bytes(launch.args[0])  # type: ignore[arg-type]
    return full >= alone_bytes


def bucket_pass(gm: fx.GraphModule, *, rank_of: Callable[[str], int] | None = None,
                alone_bytes: int | None = None) -> fx.GraphModule:
    """Merge each unit's per-parameter all-gathers, and reduce-scatters, into one collective each.

    ``rank_of(group_name)``: this rank's index in a group; given, all-gathers are packed in place
    (NOTE [in-place all-gather]). ``alone_bytes``: members of at least this full size keep a collective
    of their own (NOTE [large params alone]); ``None``: every member is bucketed."""
    hoist: dict[fx.Node, fx.Node] = {}
    for members in _groups(gm, is_all_gather):
        members = [m for m in members if not _alone(m, alone_bytes)]
        if len(members) > 1:
            _merge(gm, members, gather=True, hoist=hoist, rank_of=rank_of)
    for members in _groups(gm, is_reduce_scatter, stretches=True):
        members = [m for m in members if not _alone(m, alone_bytes)]
        if len(members) > 1:
            _merge(gm, members, gather=False, hoist=hoist)
    for members in _groups(gm, is_all_reduce):  # HSDP: across replicas, after the reduce-scatter
        if len(members) > 1:
            _merge(gm, members, gather=False, hoist=hoist)
    tag_pieces(gm, [n for n in gm.graph.nodes if is_all_gather(n)])  # NOTE [flat markers] in capture/group_markers.py
    reorder(gm.graph, before=hoist)
    return gm


def tag_pieces(gm: fx.GraphModule, launches: Sequence[fx.Node]) -> None:
    """Each piece of a flat shard that only a collective's packing reads (``narrow`` / ``slice`` and
    ``view`` of a graph input) gets that collective's annotations: it is part of the collective's prologue
    then, and moves with it (``schedule/prefetch.py``), as the packing of a shard read directly does."""
    for launch in launches:
        meta = launch.meta.get("fsdp")
        if not meta:
            continue
        stack = list(launch.all_input_nodes)
        while stack:
            node = stack.pop()
            tagged = node.meta.get("fsdp", {})
            if tagged.get("kind") == meta.get("kind") and tagged.get("unit") == meta.get("unit"):
                stack.extend(node.all_input_nodes)  # (the collective's own packing)
                continue
            piece = flat_piece(node)
            if piece is None or tagged or any(len(n.users) != 1 for n in piece[3]):
                continue
            for n in piece[3]:
                n.meta["fsdp"] = {k: v for k, v in meta.items() if k in ("kind", "unit", "ag_group", "rs_group")}

