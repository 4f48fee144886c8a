"""One marker per flat unit: per outlined call, and for the unit's inline reads.

NOTE [flat markers]: every compiled parameter read is one ``fsdp::unshard`` marker of one piece (NOTE [one
marker spec] in ``graph_ops.py``), a ``narrow``/``view`` of its unit's flat shard (NOTE [flat shards] in
``fsdp_compile/api/flat_shard.py``). The markers that one outlined call reads, or that no call reads,
become one marker of the whole flat when they read every piece of it once, before the first of them::

    before: w_a = unshard(view(narrow(flat, 0, 0, n_a), s_a), [s_a], [full_a], "a", ...)[0]
            w_b = unshard(view(narrow(flat, 0, n_a, n_b), s_b), [s_b], [full_b], "b", ...)[0]
            invoke_subgraph(body, x, w_a, w_b)
    after:  ws = unshard(flat, [s_a, s_b], [full_a, full_b], "a\\nb", ...); w_a = ws[0]; w_b = ws[1]
            invoke_subgraph(body, x, w_a, w_b)

So AOTAutograd traces one op each way per unit and call, the all-gather sends the flat as it is, and the
reduce-scatter's output is the flat's gradient (else built from the pieces' gradients). The trace cannot
emit the flat marker itself: knowing whether an earlier read already gathered the flat is Python state,
a side effect Dynamo refuses inside a higher-order op's body (e.g. an activation-checkpointed block).

A parameter not in a flat (a ``BlockStack``'s, one unfrozen since its flat was laid out) keeps its
one-piece marker, as does a flat read other than once per piece (a block called twice inline). Every
argument but the pieces' is the unit's; ``accumulate`` holds one leaf per piece where the unit
accumulates without sync (NOTE [no-sync] in ``fsdp_compile/api/accumulate.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx

from ..graph_ops import NAMES_SEP, PIECE_ARGS, UNSHARD_ARGS, arg_names, in_order
from ..order import positions
from ..predicates import example_value, flat_piece, is_unshard, marker_args, needs_grad

__all__ = ["group_markers_pass"]

_SHARED = tuple(n for n in arg_names(UNSHARD_ARGS) if n not in PIECE_ARGS)  # alike in a unit's markers


def _groupable(marker: fx.Node, reader: Callable[[fx.Node], bool]) -> bool:
    """``flat -> narrow -> view -> unshard (one piece) -> getitem -> reader`` for readers ``reader`` accepts."""
    a = marker_args(marker)
    return (len(a.ranks) == 1 and flat_piece(a.shard) is not None and isinstance(example_value(a.shard), Tensor)
            and all(u.target is operator.getitem and all(reader(r) for r in u.users) for u in marker.users))


def _marker_of(arg: object) -> fx.Node | None:
    """``marker -> getitem -> arg``: the marker whose parameter ``arg`` is."""
    if isinstance(arg, fx.Node) and arg.target is operator.getitem and isinstance(arg.args[0], fx.Node):
        return arg.args[0] if is_unshard(arg.args[0]) else None
    return None


def group_markers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [flat markers]) The markers each ``invoke_subgraph`` call reads, and those no call reads, alike
    but for their pieces and in needing a gradient, become one marker of the flat if they read all of it.

    NOTE [grad mode of a flat marker]: the flat marker runs where its first marker was, in that grad mode;
    so only markers alike in needing a gradient group (a ``no_grad`` read would take the rest out of autograd)."""
    order = positions(gm.graph)
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
                    example_value(a.shard).dtype, needs_grad(marker))  # type: ignore[union-attr]
            groups.setdefault((kind, tuple(getattr(a, k) for k in _SHARED)), []).append(marker)
        for group in groups.values():
            if group_flat(gm, group, order):
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def group_flat(gm: fx.GraphModule, markers: Sequence[fx.Node], order: dict[fx.Node, int]) -> bool:
    """(NOTE [flat markers]) Replace ``markers`` (one piece each, alike otherwise) by one marker of the flat
    if their pieces tile it; returns whether it did."""
    pieces = [flat_piece(marker_args(m).shard) for m in markers]  # (of one flat: the caller groups by it)
    ordered = sorted(zip(pieces, markers), key=lambda pm: pm[0][1])  # type: ignore[index]
    base = pieces[0][0]  # type: ignore[index]
    offset = 0
    for (_, start, n, _), _ in ordered:  # type: ignore[misc]
        if start != offset:
            return False
        offset += n
    if offset != example_value(base).numel():  # type: ignore[union-attr]
        return False
    args = [marker_args(m) for _, m in ordered]
    first = min(markers, key=lambda m: order[m])
    values = {k: getattr(args[0], k) for k in _SHARED}
    values.update(shard=base, names=NAMES_SEP.join(a.names for a in args),
                  accumulate=[x for a in args for x in a.accumulate] if args[0].accumulate is not None else None,
                  **{k: [x for a in args for x in getattr(a, k)]
                     for k in ("shard_ranks", "shard_dims", "ranks", "dims")})
    with gm.graph.inserting_before(first):
        flat = gm.graph.call_function(torch.ops.fsdp.unshard.default, in_order(UNSHARD_ARGS, **values))
    items = [example_value(m) for _, m in ordered]
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
