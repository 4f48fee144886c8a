"""A unit's parameters read as pieces of its one flat shard: one grouped marker of the flat itself.

NOTE [flat shards]: ``fully_shard`` lays a unit's shards out as one flat tensor per rank (every shard a
view of it, in the unit's order; ``fsdp_compile/flat.py``) and a compiled read of parameter ``i`` is the
marker on a piece of it, ``unshard(flat.narrow(0, off_i, n_i).view(shape_i), ...)``: Dynamo then takes
one input per unit, not one per parameter. When one outlined call reads every piece of a flat, its
markers become one ``fsdp::unshard_flat`` of the flat itself (:func:`group_flat`, called by
``group.py``), whose backward is one ``fsdp::reduce_grad_flat`` returning the flat's gradient::

    w_a = unshard(view(narrow(flat, 0, 0, n_a), s_a), ...); w_b = unshard(view(narrow(flat, 0, n_a, n_b), s_b), ...)
    -> ws = unshard_flat(flat, [s_a, s_b], [full_a, full_b], "a\\nb", ...); w_a = ws[0]; w_b = ws[1]

So the all-gather packs the flat in one copy, and the reduce-scatter's output *is* the flat's gradient,
where AOTAutograd would otherwise rebuild it from the pieces' gradients (a zero tensor and a
``slice_scatter`` and an add per piece). Lowered at once to the unit's bucket where the grouped path
applies (``lower_grouped.py``), else split back (:func:`expand_flat`) into the per-parameter markers on
views of the flat and a ``cat`` of their gradients.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor, fx

from .copies import _numel, flatten_shapes, unflatten_shapes
from .predicates import UnshardArgs, _schema_name
from .splice import splice

__all__ = ["flat_piece", "group_flat", "expand_flat", "is_flat_unshard", "is_flat_reduce_grad", "tag_pieces"]

_SEP = "\n"  # (group.NAMES_SEP; not imported: group.py imports this module)


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
    for piece, shape, name in zip(_pieces(flat, unflatten_shapes(shard_ranks, shard_dims)),
                                  unflatten_shapes(ranks, dims), names.split(_SEP)):
        out.append(torch.ops.fsdp.unshard(piece, shape, world_size, unit, name, ag_group, rs_group, replicate_group,
                                          replicate_size, reshard, param_dtype, reduce_dtype, None))
    return out


@unshard_flat.register_fake
def _unshard_flat_fake(flat: Tensor, shard_ranks: list[int], shard_dims: list[int], ranks: list[int],
                       dims: list[int], *args: object) -> list[Tensor]:
    param_dtype = args[-2]
    return [flat.new_empty(shape, dtype=param_dtype or flat.dtype) for shape in unflatten_shapes(ranks, dims)]  # type: ignore[arg-type]


def _pieces(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = _numel(shape)
        out.append(flat.narrow(0, offset, n).view(list(shape)))
        offset += n
    return out


def _setup_context(ctx: object, inputs: tuple, output: list[Tensor]) -> None:
    (flat, shard_ranks, shard_dims, ranks, dims, names, world_size, unit, ag_group, rs_group, replicate_group,
     replicate_size, _reshard, param_dtype, reduce_dtype) = inputs
    ctx.full = [(shape, param_dtype or flat.dtype) for shape in unflatten_shapes(ranks, dims)]  # type: ignore[attr-defined]
    ctx.device = flat.device  # type: ignore[attr-defined]
    ctx.args = (shard_ranks, shard_dims, names, world_size, unit, ag_group, rs_group, replicate_group,  # type: ignore[attr-defined]
                replicate_size, reduce_dtype, flat.dtype)


def _backward(ctx: object, grads: list[Tensor | None]) -> tuple:
    # A piece the call never read has no gradient: zeros, which reduce to its zero gradient.
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device)  # type: ignore[attr-defined]
            for g, (shape, dtype) in zip(grads, ctx.full)]  # type: ignore[attr-defined]
    return (torch.ops.fsdp.reduce_grad_flat(full, *ctx.args),) + (None,) * 14  # type: ignore[attr-defined]


unshard_flat.register_autograd(_backward, setup_context=_setup_context)


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
                      for g, shape, name in zip(grads, unflatten_shapes(shard_ranks, shard_dims), names.split(_SEP))])


@reduce_grad_flat.register_fake
def _reduce_grad_flat_fake(grads: list[Tensor], shard_ranks: list[int], shard_dims: list[int], *args: object) -> Tensor:
    out_dtype = args[-1]
    total = sum(_numel(s) for s in unflatten_shapes(shard_ranks, shard_dims))
    return grads[0].new_empty(total, dtype=out_dtype)  # type: ignore[arg-type]


def is_flat_unshard(node: fx.Node) -> bool:
    """``flat -> fsdp::unshard_flat -> getitem -> full params``"""
    return _schema_name(node) == "fsdp::unshard_flat"


def is_flat_reduce_grad(node: fx.Node) -> bool:
    """``[full grads] -> fsdp::reduce_grad_flat -> the flat's gradient``"""
    return _schema_name(node) == "fsdp::reduce_grad_flat"


# ---------------------------------------------------------------------------------------------
# Pieces of a flat
# ---------------------------------------------------------------------------------------------

_NARROW = {torch.ops.aten.narrow.default, torch.ops.aten.slice.Tensor}
_VIEW = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}


def flat_piece(node: object) -> tuple[fx.Node, int, int, list[fx.Node]] | None:
    """``base -> narrow(0, offset, n) [-> view(shape)] -> node``, as Dynamo records the read of a flat
    shard's piece (``Tensor.narrow`` / ``Tensor.view`` methods) or as ATen ops: ``(base, offset, n, the
    nodes from the narrow on)``, else ``None``. ``base`` is a 1-D graph input."""
    if not isinstance(node, fx.Node):
        return None
    chain = [node]
    if _is(node, "view", _VIEW):
        inner = node.args[0]
        if not isinstance(inner, fx.Node):
            return None
        chain.insert(0, inner)
        node = inner
    if not _is(node, "narrow", _NARROW) or len(node.args) < 4:
        return None
    base, dim, start, length = node.args[:4]
    if node.target is torch.ops.aten.slice.Tensor:
        length = length - start if isinstance(length, int) and isinstance(start, int) else None  # (start, end)
        if len(node.args) > 4 and node.args[4] != 1:
            return None
    if (not isinstance(base, fx.Node) or base.op not in ("placeholder", "get_attr") or dim != 0
            or not isinstance(start, int) or not isinstance(length, int)):
        return None
    val = base.meta.get("example_value", base.meta.get("val"))
    if not isinstance(val, Tensor) or val.dim() != 1:
        return None
    return base, start, length, chain


def _is(node: fx.Node, method: str, targets: set) -> bool:
    if node.op == "call_method":
        return node.target == method
    return node.op == "call_function" and node.target in targets


def group_flat(gm: fx.GraphModule, markers: Sequence[fx.Node], order: dict[fx.Node, int], shared: list[object]) -> bool:
    """NOTE [flat shards]: when ``markers`` (one outlined call's, of one unit, ``shared`` arguments alike)
    read pieces that tile one flat shard, replace them by one ``fsdp::unshard_flat`` of the flat; returns
    whether it did."""
    pieces = [flat_piece(UnshardArgs.of(m).shard) for m in markers]
    if any(p is None for p in pieces) or len({p[0] for p in pieces}) != 1:  # type: ignore[index]
        return False
    ordered = sorted(zip(pieces, markers), key=lambda pm: pm[0][1])  # type: ignore[index]
    base = pieces[0][0]  # type: ignore[index]
    offset = 0
    for (_, start, n, _), _ in ordered:  # type: ignore[misc]
        if start != offset:
            return False
        offset += n
    if offset != base.meta.get("example_value", base.meta.get("val")).numel():
        return False
    args = [UnshardArgs.of(m) for _, m in ordered]
    shard_ranks, shard_dims = flatten_shapes([list(a.shard.meta.get("example_value", a.shard.meta.get("val")).shape)
                                              for a in args])
    ranks, dims = flatten_shapes([a.full_shape for a in args])
    first = min(markers, key=lambda m: order[m])
    with gm.graph.inserting_before(first):
        flat = gm.graph.call_function(torch.ops.fsdp.unshard_flat.default,
                                      (base, shard_ranks, shard_dims, ranks, dims, _SEP.join(a.name for a in args),
                                       *shared))
    values = [m.meta.get("example_value") for _, m in ordered]
    if all(v is not None for v in values):
        flat.meta["example_value"] = list(values)
    flat.meta["stack_trace"] = first.meta.get("stack_trace")
    dead: list[fx.Node] = []
    for i, (piece, marker) in enumerate(ordered):
        with gm.graph.inserting_after(flat):
            item = gm.graph.call_function(operator.getitem, (flat, i))
        item.meta.update(marker.meta)
        marker.replace_all_uses_with(item)
        gm.graph.erase_node(marker)
        dead.extend(reversed(piece[3]))  # type: ignore[index]
    for node in dead:
        if not node.users:
            gm.graph.erase_node(node)
    return True


def expand_flat(gm: fx.GraphModule, node: fx.Node) -> None:
    """Split an ``fsdp::unshard_flat`` back into per-parameter ``fsdp::unshard`` markers on views of the flat,
    or an ``fsdp::reduce_grad_flat`` into per-parameter ``fsdp::reduce_grad`` markers and a ``cat``."""
    if is_flat_unshard(node):
        (flat, shard_ranks, shard_dims, ranks, dims, names, *rest) = node.args
        shard_shapes = unflatten_shapes(shard_ranks, shard_dims)  # type: ignore[arg-type]
        pieces = splice(gm.graph, lambda f: _pieces(f, shard_shapes), [flat], before=node)  # type: ignore[list-item]
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        assert len(items) == len(node.users), f"{node.name}: read other than by index"
        world, unit, *tail = rest
        for i, (piece, shape, name) in enumerate(zip(pieces, unflatten_shapes(ranks, dims), str(names).split(_SEP))):  # type: ignore[arg-type]
            item = items.get(i)
            if item is None:
                continue
            with gm.graph.inserting_before(node):
                single = gm.graph.call_function(torch.ops.fsdp.unshard.default,
                                                (piece, shape, world, unit, name, *tail, None))
            single.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            single.meta["val"] = item.meta["val"]
            item.replace_all_uses_with(single)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        stack = list(pieces)
        while stack:  # the pieces nothing reads, and their narrows
            piece = stack.pop()
            if not piece.users and piece.op == "call_function":
                stack.extend(i for i in piece.all_input_nodes if i is not flat)
                gm.graph.erase_node(piece)
        return
    (grads, shard_ranks, shard_dims, names, world, unit, *tail) = node.args
    singles = []
    for g, shape, name in zip(grads, unflatten_shapes(shard_ranks, shard_dims), str(names).split(_SEP)):  # type: ignore[arg-type]
        with gm.graph.inserting_before(node):
            single = gm.graph.call_function(torch.ops.fsdp.reduce_grad.default, (g, shape, world, unit, name, *tail))
        single.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        val = node.meta["val"]
        single.meta["val"] = val.new_empty(shape)
        singles.append(single)
    (cat,) = splice(gm.graph, lambda *gs: [torch.cat([g.reshape(-1) for g in gs])], singles, before=node)
    node.replace_all_uses_with(cat)
    gm.graph.erase_node(node)


def tag_pieces(gm: fx.GraphModule, launches: Sequence[fx.Node]) -> None:
    """Each piece of a flat shard that only a collective's packing reads (``narrow`` / ``slice`` and
    ``view`` of a graph input) gets that collective's annotations: it is part of the collective's prologue
    then, and moves with it (``prefetch.py``), as the packing of a shard read directly does."""
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
