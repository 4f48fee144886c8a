"""Move the ``fsdp::unshard`` markers out of outlined bodies to every call of the body.

NOTE [hoisting markers]: an outlined body (NOTE [outlined units] in ``fsdp_compile/api/module.py``) gathers
the shards each call passes with markers of its own, but collectives are scheduled in the outer graph. So
each marker that reads only body inputs moves out to the calls; the body takes the gathered parameter::

    before:  body(x, s_a, s_b):  w_a = unshard(s_a, ...)[0]; w_b = unshard(s_b, ...)[0]; <block ops>(x, w_a, w_b)
             h1 = invoke_subgraph(body, x0, s0_a, s0_b)[0]; h2 = invoke_subgraph(body, h1, s1_a, s1_b)[0]
    after:   body(x, w_a, w_b):  <block ops>(x, w_a, w_b)
             h1 = invoke_subgraph(body, x0, unshard(s0_a)[0], unshard(s0_b)[0])[0]; h2 = ...

A marker reading a piece (``narrow`` and ``view``) of a body input moves with them. A marker reading a
value computed in the body stays (the backend then inlines that body).
"""

from __future__ import annotations

import operator

from torch import fx

from ..predicates import flat_piece, is_unshard
from ..subgraphs import fresh_value, subgraph_calls

__all__ = ["hoist_unshards_pass"]


def _hoistable(marker: fx.Node, placeholders: set[fx.Node]) -> list[fx.Node] | None:
    """``placeholder(s) [-> narrow -> view] -> unshard -> getitem``: the nodes that move out with the marker
    (the pieces', then the marker), else ``None``."""
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
    if not moving:
        return
    moved = {n for nodes in moving.values() for n in nodes}
    # Each call gets the markers, on its own operands, while they still read the body's inputs.
    unread = {p for p in placeholders if all(u in moved for u in p.users)}
    kept = [p for p in placeholders if p not in unread]
    for call in calls:
        env = dict(zip(placeholders, call.args[2:]))
        gathered = []
        for marker in moving:
            for node in [*moving[marker], *marker.users]:
                with gm.graph.inserting_before(call):
                    outer = gm.graph.node_copy(node, lambda n: env[n])
                for key in ("example_value", "val"):
                    if key in node.meta:
                        # (keeping requires_grad: NOTE [grad mode of a flat marker])
                        outer.meta[key] = fresh_value(node.meta[key], requires_grad=True)
                env[node] = outer
            gathered.extend(env[item] for item in marker.users)
        call.args = (call.args[0], call.args[1], *[env[p] for p in kept], *gathered)
    # The body: each gathered parameter becomes a new input; inputs only the markers read go.
    last = placeholders[-1]
    for marker in moving:
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
