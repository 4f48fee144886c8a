"""Inline ``invoke_subgraph`` calls where an outlined body cannot be kept (``outline=False``, a marker not
hoisted, a cost model estimating op by op)::

    before:  h1 = invoke_subgraph(body, 'id', x0, w0)[0]
    after:   h1 = <body ops>(x0, w0)
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch import fx

from ..subgraphs import hop_bodies, subgraph_calls

__all__ = ["inline_nested_pass", "inline_subgraphs_pass"]


def _inline_call(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule) -> None:
    env: dict[fx.Node, object] = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[2:], strict=True))
    results: tuple[object, ...] = ()
    for node in body.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            results = tuple(fx.node.map_arg(node.args[0], lambda n: env[n]))
            continue
        if node.op == "get_attr":  # a constant or nested body: carried over by name
            target = str(node.target)
            name = f"{call.name}_{target.replace('.', '_')}"
            setattr(gm, name, getattr(body, target))
            with gm.graph.inserting_before(call):
                env[node] = gm.graph.get_attr(name)
            env[node].meta.update(node.meta)  # type: ignore[union-attr]
            continue
        with gm.graph.inserting_before(call):
            env[node] = gm.graph.node_copy(node, lambda n: env[n])  # type: ignore[arg-type,return-value]
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])  # type: ignore[arg-type,index]
            gm.graph.erase_node(user)
    assert not call.users, call
    attr = call.args[0]
    gm.graph.erase_node(call)
    if isinstance(attr, fx.Node) and not attr.users:
        gm.graph.erase_node(attr)


def inline_subgraphs_pass(gm: fx.GraphModule, *, keep: Callable[[fx.GraphModule], bool] = lambda body: False,
                          min_calls: int = 1) -> fx.GraphModule:
    """Inline every ``invoke_subgraph`` call whose body ``keep`` does not accept (default: all), and the
    calls of bodies called fewer than ``min_calls`` times."""
    for name, calls in subgraph_calls(gm).items():
        body = getattr(gm, name)
        if len(calls) >= min_calls and keep(body):
            continue
        for call in calls:
            _inline_call(gm, call, body)
        if not gm.graph.find_nodes(op="get_attr", target=name):
            delattr(gm, name)  # (not delete_all_unused_submodules: it drops what nested bodies read)
    gm.graph.lint()
    gm.recompile()
    return gm


def inline_nested_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline every ``invoke_subgraph`` call inside the bodies of ``gm``'s higher-order ops (an outlined unit
    in an activation-checkpointed block), outermost first: collectives are scheduled in the outer graph only."""
    for body in hop_bodies(gm):
        inline_subgraphs_pass(body)
    return gm
