"""Unroll a ``scan`` that reads sharded parameters into one ``invoke_subgraph`` call of its body per iteration.

NOTE [unrolled stacks]: a ``BlockStack`` (``fsdp_compile/api/stack.py``) reaches the backend as one ``scan``
over every block's parameters, stacked per role. As a loop, no collective could be in flight across
iterations (no prefetch, no overlapped reduce-scatter). Unrolled, it is what an outlined model is made of
(NOTE [outlined units] in ``fsdp_compile/api/module.py``): one call of one body per block::

    before:  W_a = stack([a0, a1]); W_b = stack([b0, b1])
             h2 = scan(body, [h0], [W_a, W_b], [c])[0]
    after:   h1 = invoke_subgraph(body, 'id', h0, a0, b0, c)[0]
             h2 = invoke_subgraph(body, 'id', h1, a1, b1, c)[0]

A row of a stack built in the graph is the tensor it was built from; a row of any other tensor is its
``unbind``. Per-iteration outputs are stacked again. A scan reading no sharded parameter over a tensor the
graph did not stack (a user's loop over time steps) stays a loop.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from .._compat import FakeTensor
from ..predicates import example_value, is_unshard
from ..subgraphs import fresh_value, holds

__all__ = ["unroll_scans_pass"]

_scan = torch.ops.higher_order.scan
_invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def _with_example(node: fx.Node, value: Any) -> fx.Node:
    if value is not None:
        node.meta["example_value"] = value
    return node


def _fake(fn: Callable[..., Any], value: Any) -> Any:
    """``fn(value)`` under ``value``'s fake mode, or ``None`` where ``value`` is no fake tensor."""
    if not isinstance(value, FakeTensor):
        return None
    with value.fake_mode:
        return fn(value)


def _stacked_from(node: fx.Node) -> list[fx.Node] | None:
    """``[t0, t1, ...] -> torch.stack(dim=0)``: the tensors a stack was built from."""
    if node.op != "call_function" or node.target is not torch.stack:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    items = node.args[0]
    if dim != 0 or not isinstance(items, (list, tuple)) or not all(isinstance(t, fx.Node) for t in items):
        return None
    return list(items)  # type: ignore[arg-type]


def _rows(graph: fx.Graph, x: fx.Node, length: int) -> list[fx.Node]:
    """The ``length`` rows of ``x`` along dim 0: what it was stacked from, or its ``unbind``."""
    stacked = _stacked_from(x)
    if stacked is not None and len(stacked) == length:
        return stacked
    unbound = _with_example(graph.call_function(torch.unbind, (x, 0)),
                            _fake(lambda t: torch.unbind(t, 0), example_value(x)))
    values = unbound.meta.get("example_value")
    return [_with_example(graph.call_function(operator.getitem, (unbound, i)), values[i] if values else None)
            for i in range(length)]


def _unroll(gm: fx.GraphModule, scan: fx.Node, identifier: str) -> None:
    attr, init, xs, additional = scan.args
    assert isinstance(attr, fx.Node) and isinstance(init, (list, tuple)) and isinstance(xs, (list, tuple))
    graph = gm.graph
    length = example_value(xs[0]).shape[0]  # type: ignore[arg-type]
    out_values = list(example_value(scan))
    n_carry = len(init)
    carry_values, ys_values = out_values[:n_carry], out_values[n_carry:]
    y_values = [_fake(lambda t: t[0], y) for y in ys_values]
    with graph.inserting_before(scan):
        rows = [_rows(graph, x, length) for x in xs]  # type: ignore[arg-type]
        carry, ys = list(init), []
        for i in range(length):
            body = graph.get_attr(str(attr.target))
            call = graph.call_function(_invoke_subgraph, (body, identifier, *carry, *[r[i] for r in rows], *additional))
            call.meta["example_value"] = tuple(fresh_value(v) for v in (*carry_values, *y_values))  # each its own
            outs = [_with_example(graph.call_function(operator.getitem, (call, k)), v)
                    for k, v in enumerate(call.meta["example_value"])]
            carry = outs[:n_carry]
            ys.append(outs[n_carry:])
        results = carry + [_with_example(graph.call_function(torch.stack, ([y[k] for y in ys], 0)), value)
                           for k, value in enumerate(ys_values)]
    for user in list(scan.users):
        assert user.op == "call_function" and user.target is operator.getitem, user
        user.replace_all_uses_with(results[user.args[1]])  # type: ignore[index]
        graph.erase_node(user)
    graph.erase_node(scan)
    for node in [attr, *xs]:  # the body's attribute, and the stacks only the loop read
        if isinstance(node, fx.Node) and node.op in ("get_attr", "call_function") and not node.users:
            graph.erase_node(node)
    module = getattr(gm, str(attr.target))
    (output,) = module.graph.find_nodes(op="output")
    if isinstance(output.args[0], list):  # a scan's body returns a list, a called body a tuple
        output.args = (tuple(output.args[0]),)
        module.recompile()


def unroll_scans_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [unrolled stacks]) Each ``scan`` whose body reads a sharded parameter, or whose inputs the graph
    stacked, becomes one ``invoke_subgraph`` call per iteration, all with one identifier."""
    for scan in list(gm.graph.find_nodes(op="call_function", target=_scan)):
        attr = scan.args[0]
        if scan.kwargs or not isinstance(attr, fx.Node) or attr.op != "get_attr":
            continue  # (Dynamo passes operands positionally, the body as an attribute)
        stacked = (isinstance(x, fx.Node) and _stacked_from(x) for x in scan.args[2])  # type: ignore[union-attr]
        if holds(getattr(gm, str(attr.target)), is_unshard) or all(stacked):
            _unroll(gm, scan, f"unrolled_{attr.target}")
    gm.graph.lint()
    gm.recompile()
    return gm
