"""Reorder a graph by a priority, keeping it topologically valid.

Every scheduling pass in this package says *where it would like* each node (a sort key) and leaves
legality to :func:`reorder`: a topological sort (Kahn's algorithm) that, among the nodes whose inputs
are all placed, always places the one with the smallest key next. Nodes a pass did not touch keep their
current index as key, so the rest of the graph stays in the order it had. A node wanted before one of
its inputs is placed right after that input; nothing can be placed before what it reads.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from torch import fx

__all__ = ["positions", "reorder"]


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's current index in ``graph``."""
    return {n: i for i, n in enumerate(graph.nodes)}


def reorder(
    graph: fx.Graph,
    keys: Mapping[fx.Node, float] | None = None,
    *,
    before: Mapping[fx.Node, fx.Node] | None = None,
) -> None:
    """Stable-topologically sort ``graph`` in place by ``keys`` (default: current index).

    ``before`` asks for nodes to go just before other nodes (``{node: anchor}``), in the order the
    mapping lists them. Placeholders stay first and the output stays last. Ties keep the current order.
    """
    index = positions(graph)
    key = {n: float(index[n]) for n in graph.nodes}
    if keys:
        key.update({n: float(k) for n, k in keys.items()})
    if before:
        step = 0.5 / (len(before) + 1)
        for i, (n, anchor) in enumerate(before.items()):
            key[n] = key[anchor] - 0.5 + step * i
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    in_body = set(body)
    waiting = {n: sum(1 for i in set(n.all_input_nodes) if i in in_body) for n in body}
    ready = [(key[n], index[n], n) for n in body if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for user in n.users:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (key[user], index[user], user))
    assert len(order) == len(body), "the graph has a cycle"
    # Moving each node right after the previous one leaves the output last, where it was.
    cursor: fx.Node | None = placeholders[-1] if placeholders else None
    for n in order:
        if cursor is None:
            next(iter(graph.nodes)).prepend(n)
        else:
            cursor.append(n)
        cursor = n
