"""Run passes inside loop bodies: the markers of a stack of blocks live in a ``scan``'s body.

Before (a forward graph; its backward holds a ``scan`` whose body reduces each block's gradients)::

    scan(body, [h], [shard stacks], consts)        body: slice -> fsdp::unshard -> block -> h

After ``loop_bodies_pass(gm, passes=[lower, bucket])``, each body as those passes leave it::

    scan(body, [h], [shard stacks], consts)        body: slice -> all_gather -> wait -> block -> h

A body's collectives run once per iteration, on every rank alike (NOTE [stacked blocks] in
``fsdp_compile/stack.py``); the graph around the loop keeps its own markers for the other passes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import fx

from .runner import GraphPass

__all__ = ["loop_bodies", "loop_bodies_pass"]

_LOOPS = (torch.ops.higher_order.scan, torch.ops.higher_order.while_loop)


def loop_bodies(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Each distinct graph module a loop of ``gm`` runs (``scan``'s body, ``while_loop``'s condition and
    body), and the loops' bodies inside those, outermost first."""
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _LOOPS:
            continue
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                body = getattr(gm, str(arg.target))
                if isinstance(body, fx.GraphModule) and id(body) not in seen:
                    seen.add(id(body))
                    yield body
                    yield from loop_bodies(body)


def loop_bodies_pass(gm: fx.GraphModule, *, passes: Sequence[GraphPass]) -> fx.GraphModule:
    """Run ``passes``, in order, on every loop body of ``gm`` (:func:`loop_bodies`); ``gm`` itself as is."""
    for body in list(loop_bodies(gm)):
        for p in passes:
            body = p(body)
        body.graph.lint()
        body.recompile()
    return gm
