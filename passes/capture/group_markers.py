"""One marker per flat unit: per outlined call, and for the unit's inline reads.

NOTE [flat markers]: every parameter read in compiled code is gathered by one marker op,
``fsdp::unshard``, whose backward is ``fsdp::reduce_grad`` (``fsdp_compile/api/markers.py``). A marker
reads *pieces* (NOTE [one marker spec] in ``graph_ops.py``): a traced read is one piece, its shard; a
unit's flat marker, made here, is every piece of the unit's flat shard.

AOTAutograd's trace costs about the same per op whatever the op does, and once blocks are outlined (NOTE
[outlined units] in ``fsdp_compile/api/module.py``) the traced reads are most of what it traces per block:
nine ``fsdp::unshard`` before each call of a Llama block and nine ``fsdp::reduce_grad`` after its
backward, against one call each way. ``fully_shard`` lays a unit's shards out as one flat tensor per
dtype and rank (every shard a view of it, in the unit's order; NOTE [flat shards] in
``fsdp_compile/api/flat_shard.py``) and a compiled read of parameter ``i`` is the marker of one piece of
it. When the markers one outlined call reads, or the markers read outside any call, read every piece of
a flat once, they become one marker of the flat itself (:func:`group_flat`), before the first of them,
whose backward is one ``fsdp::reduce_grad`` returning the flat's gradient::

    before: w_a = unshard(view(narrow(flat, 0, 0, n_a), s_a), [s_a], [full_a], "a", ...)[0]
            w_b = unshard(view(narrow(flat, 0, n_a, n_b), s_b), [s_b], [full_b], "b", ...)[0]
            invoke_subgraph(body, x, w_a, w_b)
    after:  ws = unshard(flat, [s_a, s_b], [full_a, full_b], "a\\nb", ...); w_a = ws[0]; w_b = ws[1]
            invoke_subgraph(body, x, w_a, w_b)

So AOTAutograd traces one op each way per unit and call, the all-gather sends the flat as it is, and the
reduce-scatter's output *is* the flat's gradient, where AOTAutograd would otherwise build it from the
pieces' gradients (a zero tensor, and a ``slice_scatter`` and an add per piece). ``lower/markers.py``
lowers every marker (NOTE [one lowering]).

The trace cannot make the flat marker itself: a read does not know whether an earlier read in the same
forward already gathered its flat. Keeping that in Python state between reads (set when the unit's
forward starts, cleared when it ends) is a side effect, and Dynamo refuses side effects inside a
higher-order op's body. An activation-checkpointed block, say, would then fall out of the graph and run
uncompiled. So a traced read is one piece, and this pass groups them.

A parameter not in a flat (a ``BlockStack``'s, one unfrozen since its flat was
laid out: ``flatten_unit`` in ``fsdp_compile/api/flat_shard.py``) keeps its marker of one piece: the same
buckets in the end, more ops to trace. So does a flat read other than once per piece (a block called
twice inline), whose gradient AOTAutograd then sums from its pieces'.

A marker's pieces are described by flattened shapes (``flatten_shapes``) and names joined by
``NAMES_SEP`` (an op's schema takes no nested int lists and no string lists); every other argument is
its unit's, and the accumulation leaves are a list, one per piece, where a unit accumulates without
sync (NOTE [no-sync] in ``fsdp_compile/api/accumulate.py``): the backward then gives each leaf its full
gradient and the shard none.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx

from ..graph_ops import NAMES_SEP, PIECE_ARGS, UNSHARD_ARGS, arg_names, in_order
from ..predicates import flat_piece, is_unshard, marker_args, needs_grad

__all__ = ["group_markers_pass"]

_SHARED = tuple(n for n in arg_names(UNSHARD_ARGS) if n not in PIECE_ARGS)  # alike in a unit's markers


def _groupable(marker: fx.Node, reader: Callable[[fx.Node], bool]) -> bool:
    """A named marker of one piece of a flat shard with a value, whose parameter is read only by readers
    ``reader`` accepts."""
    a = marker_args(marker)
    return (len(a.ranks) == 1 and flat_piece(a.shard) is not None and isinstance(_value(a.shard), Tensor)
            and all(u.target is operator.getitem and all(reader(r) for r in u.users) for u in marker.users))


def _value(node: fx.Node) -> object:
    return node.meta.get("example_value", node.meta.get("val"))


def _marker_of(arg: object) -> fx.Node | None:
    """``marker -> getitem -> arg``: the marker whose parameter ``arg`` is."""
    if isinstance(arg, fx.Node) and arg.target is operator.getitem and isinstance(arg.args[0], fx.Node):
        return arg.args[0] if is_unshard(arg.args[0]) else None
    return None


def group_markers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [flat markers]) The markers each ``invoke_subgraph`` call reads, and those no call reads,
    (of one unit, with every argument but their pieces' alike, and alike in needing a gradient) become
    one marker of the whole flat shard when they read every piece of it once; any other marker is left as
    it is.

    NOTE [grad mode of a flat marker]: the flat marker goes where the first of its markers was, so it
    runs in that marker's grad mode: one read under ``torch.no_grad()`` grouped with the rest would take
    every parameter of the flat out of autograd."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    calls = list(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))
    sets = [[m for m in dict.fromkeys(map(_marker_of, call.args[2:]))
             if m is not None and _groupable(m, lambda u, call=call: u is call)] for call in calls]
    called = set(calls)
    sets.append([n for n in gm.graph.nodes if is_unshard(n) and _groupable(n, lambda u: u not in called)])
    changed = False
    for markers in sets:
        groups: dict[tuple, list[fx.Node]] = {}
        for marker in markers:
            a = marker_args(marker)
            kind = (flat_piece(a.shard)[0], a.accumulate is None,  # type: ignore[index]
                    _value(a.shard).dtype, needs_grad(marker))  # type: ignore[union-attr]
            groups.setdefault((kind, tuple(getattr(a, k) for k in _SHARED)), []).append(marker)
        for group in groups.values():
            if group_flat(gm, group, order):
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def group_flat(gm: fx.GraphModule, markers: Sequence[fx.Node], order: dict[fx.Node, int]) -> bool:
    """(NOTE [flat markers]) When ``markers`` (of one piece each, one unit's, their other arguments alike)
    read pieces that tile one flat shard, replace them by one marker of the flat; returns whether it did."""
    pieces = [flat_piece(marker_args(m).shard) for m in markers]
    if any(p is None for p in pieces) or len({p[0] for p in pieces}) != 1:  # type: ignore[index]
        return False
    ordered = sorted(zip(pieces, markers), key=lambda pm: pm[0][1])  # type: ignore[index]
    base = pieces[0][0]  # type: ignore[index]
    offset = 0
    for (_, start, n, _), _ in ordered:  # type: ignore[misc]
        if start != offset:
            return False
        offset += n
    if offset != _value(base).numel():  # type: ignore[union-attr]
        return False
    args = [marker_args(m) for _, m in ordered]
    first = min(markers, key=lambda m: order[m])
    values = {k: getattr(args[0], k) for k in _SHARED}
    values.update(shard=base, names=NAMES_SEP.join(a.names for a in args),
                  accumulate=[x for a in args for x in a.accumulate] if args[0].accumulate is not None else None,
                  **{k: [x for a in args for x in getattr(a, k)] for k in ("shard_ranks", "shard_dims", "ranks", "dims")})
    with gm.graph.inserting_before(first):
        flat = gm.graph.call_function(torch.ops.fsdp.unshard.default, in_order(UNSHARD_ARGS, **values))
    items = [_value(m) for _, m in ordered]
    if all(isinstance(v, (list, tuple)) and len(v) == 1 for v in items):
        flat.meta["example_value"] = [v[0] for v in items]  # type: ignore[index]
    flat.meta["stack_trace"] = first.meta.get("stack_trace")
    dead: list[fx.Node] = []
    for i, (piece, marker) in enumerate(ordered):
        for old in list(marker.users):
            with gm.graph.inserting_after(flat):
                item = gm.graph.call_function(operator.getitem, (flat, i))
            item.meta.update(old.meta)
            old.replace_all_uses_with(item)
            gm.graph.erase_node(old)
        gm.graph.erase_node(marker)
        dead.extend(reversed(piece[3]))  # type: ignore[index]
    for node in dead:
        if not node.users:
            gm.graph.erase_node(node)
    return True
