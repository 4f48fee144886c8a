"""Move the ``fsdp::unshard`` markers out of outlined bodies to every call of the body.

NOTE [hoisting markers]: an outlined unit's forward reaches the backend as one ``invoke_subgraph`` body
called once per unit (NOTE [outlined units] in fsdp_compile/api/module.py); each call passes the unit's
shards, and the body gathers them with markers of its own. The passes schedule collectives in the
outer graph, so this pass moves each marker that reads only body inputs out to the calls: the body
takes the gathered parameter instead of the shard, and each call gathers its own unit's shard::

    before:  body(x, s_a, s_b):  w_a = unshard(s_a, ...)[0]; w_b = unshard(s_b, ...)[0]; <block ops>(x, w_a, w_b)
             h1 = invoke_subgraph(body, x0, s0_a, s0_b)[0]; h2 = invoke_subgraph(body, h1, s1_a, s1_b)[0]
    after:   body(x, w_a, w_b):  <block ops>(x, w_a, w_b)
             h1 = invoke_subgraph(body, x0, unshard(s0_a)[0], unshard(s0_b)[0])[0]; h2 = ...

The markers keep their arguments (the backend names their unit afterwards, from the shard). A marker
reading a piece of a flat shard that is a body input (``narrow`` and ``view`` of it, NOTE [flat markers]
in ``group_markers.py``) moves with the piece's ``narrow`` and ``view``. A marker reading a value computed in the
body otherwise stays where it is (the backend then inlines that body).
"""

from __future__ import annotations

import operator

from torch import fx

from ..predicates import flat_piece, is_unshard
from ..subgraphs import fresh_value, subgraph_calls

__all__ = ["hoist_unshards_pass"]


def _hoistable(marker: fx.Node, placeholders: set[fx.Node]) -> list[fx.Node] | None:
    """``placeholder (shard) [, placeholder (accumulator)] -> unshard -> getitem``: reads body inputs only,
    or a piece of one (``placeholder (flat) -> narrow -> view -> unshard``), and is read by index; the
    nodes that move with it (the piece's, then the marker; its getitems follow), else ``None``."""
    moved: list[fx.Node] = []
    for i in marker.all_input_nodes:
        if i in placeholders:
            continue
        piece = flat_piece(i)
        if piece is None or piece[0] not in placeholders or any(len(n.users) != 1 for n in piece[3]):
            return None
        moved.extend(piece[3])
    if not all(u.target is operator.getitem for u in marker.users):
        return None
    return [*moved, marker]


def _hoist_body(gm: fx.GraphModule, name: str, calls: list[fx.Node]) -> None:
    body: fx.GraphModule = getattr(gm, name)
    graph = body.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    inputs = set(placeholders)
    moving = {n: m for n in graph.nodes if is_unshard(n) and (m := _hoistable(n, inputs)) is not None}
    markers = list(moving)
    if not markers:
        return
    moved = {n for nodes in moving.values() for n in nodes}
    # Each call: the same markers, on its own operands, before it (first, while the markers still
    # read the body's inputs).
    position = {p: i for i, p in enumerate(placeholders)}
    unread = {p for p in placeholders if all(u in moved for u in p.users)}
    kept = [p for p in placeholders if p not in unread]
    for call in calls:
        operands = list(call.args[2:])
        env = {p: operands[position[p]] for p in placeholders}
        gathered = []
        for marker in markers:
            for node in [*moving[marker], *marker.users]:
                with gm.graph.inserting_before(call):
                    outer = gm.graph.node_copy(node, lambda n: env[n])
                for key in ("example_value", "val"):
                    if key in node.meta:
                        # (keeping its requires_grad: NOTE [grad mode of a flat marker] in group_markers.py)
                        outer.meta[key] = fresh_value(node.meta[key], requires_grad=True)
                env[node] = outer
            gathered.extend(env[item] for item in marker.users)
        call.args = (call.args[0], call.args[1], *[env[p] for p in kept], *gathered)
    # The body: each parameter a marker gathers becomes a new input after the existing ones; inputs only
    # the markers read go.
    last = placeholders[-1]
    for marker in markers:
        for item in list(marker.users):
            with graph.inserting_after(last):
                p = graph.placeholder(f"{item.name}_gathered")
            p.meta.update(item.meta)
            item.replace_all_uses_with(p)
            graph.erase_node(item)
            last = p
        for node in reversed(moving[marker]):
            graph.erase_node(node)
    for p in unread:
        graph.erase_node(p)
    graph.lint()
    body.recompile()


def hoist_unshards_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [hoisting markers]) Markers that read only body inputs move from each outlined body to its
    calls; the body takes the gathered parameters as inputs."""
    for name, calls in subgraph_calls(gm).items():
        _hoist_body(gm, name, calls)
    gm.graph.lint()
    gm.recompile()
    return gm
