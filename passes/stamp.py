"""Turn each stamped block's call into a call of its template's body, reading the block's own tensors.

NOTE [stamped calls]: where Dynamo would trace every outlined block again (torch 2.11), the first call of
a block's region is traced (the *template*) and each later call of an alike block is one
``fsdp::stamped(key, args, own, places)`` op (NOTE [stamped blocks] in ``fsdp_compile/stamp.py``):
``args`` are the call's tensor arguments, ``own`` the block's tensors (its shards, then any other
buffer or parameter the template's body reads), ``places[j]`` where the body's j-th own tensor is in
``own``. The template's ``invoke_subgraph`` node carries, in ``node.meta[STAMP_TEMPLATE]``, its key, a
plan of its operands (``("arg", i)``: the call's i-th tensor argument; ``("own", j)``: the block's j-th
own tensor; ``("same",)``: the same node for every call, a tensor that is no block's) and which of its
outputs the call's result holds. This pass, run on Dynamo's graph before anything else, gives each
stamped op the template's call with its own operands in the template's places::

    before:  y0 = invoke_subgraph(body, 'id', x0, w0_a, w0_b, rope)[0]     # meta: (1, arg 0, own 0, own 1, same)
             y1 = fsdp.stamped(1, [y0], [w1_b, w1_a], [1, 0])[0]
    after:   y1 = invoke_subgraph(body, 'id', y0, w1_a, w1_b, rope)[0]

which is the graph Dynamo gives when it traces every block (and finds their bodies equal).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .hoist import fresh_value

__all__ = ["STAMP_TEMPLATE", "stamp_out_pass"]

# Meta key of a template's invoke_subgraph node: (key, operand plan, output index of each result tensor).
STAMP_TEMPLATE = "fsdp_stamp_template"

_invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def _is_stamped(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "name", lambda: "")() == "fsdp::stamped"


def _stamp_out(graph: fx.Graph, node: fx.Node, template: fx.Node) -> None:
    key, args, own, places = node.args
    _, plan, out_index = template.meta[STAMP_TEMPLATE]
    operands = []
    for entry, operand in zip(plan, template.args[2:]):
        kind = entry[0]
        if kind == "arg":
            operand = args[entry[1]]  # type: ignore[index]
        elif kind == "own":
            operand = own[places[entry[1]]]  # type: ignore[index]
        operands.append(operand)
    with graph.inserting_before(node):
        call = graph.call_function(_invoke_subgraph, (template.args[0], template.args[1], *operands))
    values = template.meta.get("example_value")
    if values is not None:
        call.meta["example_value"] = tuple(fresh_value(v, requires_grad=True) for v in values)
    for user in list(node.users):
        assert user.op == "call_function" and user.target is operator.getitem, user
        with graph.inserting_before(user):
            out = graph.call_function(operator.getitem, (call, out_index[user.args[1]]))  # type: ignore[index]
        out.meta.update(user.meta)
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)


def stamp_out_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [stamped calls]: each ``fsdp::stamped`` op of ``gm`` becomes a call of its template's body on
    its own operands."""
    stamped = [n for n in gm.graph.nodes if _is_stamped(n)]
    if not stamped:
        return gm
    templates = {n.meta[STAMP_TEMPLATE][0]: n for n in gm.graph.nodes if STAMP_TEMPLATE in n.meta}
    for node in stamped:
        template = templates.get(node.args[0])
        if template is None:
            raise RuntimeError(
                "fsdp_compile: a stamped block's call has no traced template left in the graph (Dynamo dropped "
                "the first block's call, whose result went unused?). Shard the blocks with "
                "fully_shard(..., outline=False) and report the model.")
        _stamp_out(gm.graph, node, template)
    gm.graph.lint()
    gm.recompile()
    return gm
