"""Reorder a graph by sort keys, keeping it topologically valid (Kahn's algorithm, smallest key first)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from torch import fx

__all__ = ["place", "positions", "reorder"]


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's current index in ``graph``."""
    return {n: i for i, n in enumerate(graph.nodes)}


def place(keys: dict[fx.Node, float], nodes: list[fx.Node], key: float) -> None:
    """Key ``nodes`` at ``key``, in their order."""
    for j, n in enumerate(nodes):
        keys[n] = key + j * 1e-6


def reorder(graph: fx.Graph, keys: Mapping[fx.Node, float] | None = None, *,
            before: Mapping[fx.Node, fx.Node] | None = None) -> None:
    """Stable-topologically sort ``graph`` in place by ``keys`` (default: current index).

    ``before`` puts nodes just before others (``{node: anchor}``), in the mapping's order. Placeholders
    stay first, the output last, ties keep the current order.
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
    cursor: fx.Node | None = placeholders[-1] if placeholders else None
    for n in order:
        if cursor is None:
            next(iter(graph.nodes)).prepend(n)
        else:
            cursor.append(n)
        cursor = n
