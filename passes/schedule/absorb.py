"""Move a unit's bucket copies into the outlined body that uses them.

NOTE [copies inside bodies]: after scheduling, an outlined call reads each parameter out of the gathered
bucket and its backward's gradients go one by one into the reduce-scatter bucket: a dozen more values per
unit for the outer graph to lower and pass around. The copies move into the shared body instead, which
then takes the gathered bucket and returns the packed gradients::

    before:  w = wait(all_gather); p = copy_out_rows(w); out = invoke_subgraph(body, x, p[0], .., p[8])
             g = out[1..9]; rs = reduce_scatter(pack_rows([g...]))
    after:   w = wait(all_gather); out = invoke_subgraph(body', x, w)
             rs = reduce_scatter(out[1])       body'(x, w): p = copy_out_rows(w); ...; return pack_rows([g...])

Only where every call of the body has the copies alike (ops, constants, operand positions) and nothing
else reads what they produce. Collectives and their order do not change.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from ..order import positions
from ..predicates import is_wait
from ..subgraphs import subgraph_calls

__all__ = ["absorb_copies_pass"]


@dataclass
class _Inputs:
    """One gathered bucket's copies feeding one call."""
    wait: fx.Node
    nodes: list[fx.Node]  # outer graph order
    positions: dict[int, fx.Node]  # operand position -> the copy node it reads


@dataclass
class _Pack:
    """One pack of the call's outputs for a reduce-scatter."""
    node: fx.Node
    indices: list[int]  # the call's output indices, in the pack's input order


def _copies(node: fx.Node) -> set[fx.Node]:
    """``wait -> tagged copies -> node``: the copies, ``node`` included (none if it reads anything else)."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        if n.op != "call_function" or is_wait(n) or not n.meta.get("fsdp"):
            return set()
        found.add(n)
        stack.extend(i for i in n.all_input_nodes if not is_wait(i))
    return found


def _inputs(call: fx.Node, order: dict[fx.Node, int]) -> list[_Inputs]:
    groups: dict[fx.Node, _Inputs] = {}
    for k, operand in enumerate(call.args[2:]):
        if not isinstance(operand, fx.Node):
            continue
        nodes = _copies(operand)
        waits = {i for n in nodes for i in n.all_input_nodes if is_wait(i)}
        if not nodes or len(waits) != 1:
            continue
        (wait,) = waits
        group = groups.setdefault(wait, _Inputs(wait, [], {}))
        group.nodes.extend(n for n in nodes if n not in group.nodes)
        group.positions[k] = operand
    kept = []
    for g in groups.values():
        inside = set(g.nodes)
        readers_ok = all(u in inside or u is call for n in g.nodes for u in n.users)
        if readers_ok and all(u in inside for u in g.wait.users):
            g.nodes.sort(key=order.__getitem__)
            kept.append(g)
    return kept


def _packs(call: fx.Node) -> list[_Pack]:
    """``call -> getitem* -> pack_rows``: packs of outputs of ``call`` that only the pack reads."""
    packs: dict[fx.Node, None] = {}
    for item in call.users:
        for user in item.users:
            if user.target is torch.ops.fsdp.pack_rows.default:
                packs.setdefault(user, None)
    out = []
    for pack in packs:
        grads = pack.args[0]
        if not isinstance(grads, (list, tuple)) or not pack.meta.get("fsdp"):
            continue
        if all(isinstance(g, fx.Node) and g.target is operator.getitem and g.args[0] is call
               and list(g.users) == [pack] for g in grads):
            out.append(_Pack(pack, [int(g.args[1]) for g in grads]))  # type: ignore[union-attr]
    return out


def _signature(inputs: Sequence[_Inputs], packs: Sequence[_Pack]) -> object:
    """What must agree across the calls of one body for them to share the rewritten body."""

    def shape(group: _Inputs) -> object:
        local = {n: i for i, n in enumerate(group.nodes)}

        def ref(a: object) -> object:
            if isinstance(a, fx.Node):
                return ("wait",) if a is group.wait else ("copy", local.get(a))
            return repr(a)

        ops = tuple((n.target, repr(fx.node.map_aggregate(n.args, ref)), repr(fx.node.map_aggregate(n.kwargs, ref)))
                    for n in group.nodes)
        return ops, tuple(sorted((k, local[v]) for k, v in group.positions.items()))

    return (tuple(shape(g) for g in inputs),
            tuple((tuple(p.indices), repr(p.node.args[1:]), repr(p.node.kwargs)) for p in packs))


def _new_body(body: fx.GraphModule, inputs: Sequence[_Inputs], packs: Sequence[_Pack]
              ) -> tuple[fx.GraphModule, list[int]]:
    """``body`` with the copies inside, and each new output's old index (``-1 - p`` for pack ``p``)."""
    graph = fx.Graph()
    old_inputs = list(body.graph.find_nodes(op="placeholder"))
    absorbed = {k for g in inputs for k in g.positions}
    env: dict[fx.Node, fx.Node] = {}
    for k, p in enumerate(old_inputs):
        if k not in absorbed:
            env[p] = graph.placeholder(p.name)
            env[p].meta.update(p.meta)
    for i, g in enumerate(inputs):
        bucket = graph.placeholder(f"gathered_bucket_{i}")
        bucket.meta.update(g.wait.meta)
        copied: dict[fx.Node, fx.Node] = {g.wait: bucket}
        for n in g.nodes:
            copied[n] = graph.node_copy(n, lambda a, copied=copied: copied[a])
        for k, operand in g.positions.items():
            env[old_inputs[k]] = copied[operand]
    results: tuple = ()
    for n in body.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            results = tuple(n.args[0])
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    packed_outputs = {i for p in packs for i in p.indices}
    order = [i for i in range(len(results)) if i not in packed_outputs]
    outs = [env[results[i]] if isinstance(results[i], fx.Node) else results[i] for i in order]
    for j, p in enumerate(packs):
        grads = [env[results[i]] for i in p.indices]
        node = graph.call_function(p.node.target, (grads, *p.node.args[1:]), dict(p.node.kwargs))
        node.meta.update(p.node.meta)
        outs.append(node)
        order.append(-1 - j)
    graph.output(tuple(outs))
    graph.lint()
    return fx.GraphModule(body, graph), order


def _rewrite(gm: fx.GraphModule, call: fx.Node, attr: str, inputs: Sequence[_Inputs], packs: Sequence[_Pack],
             order: list[int]) -> None:
    graph = gm.graph
    absorbed = {k for g in inputs for k in g.positions}
    operands = [a for k, a in enumerate(call.args[2:]) if k not in absorbed] + [g.wait for g in inputs]
    with graph.inserting_before(call):
        getter = graph.get_attr(attr)
    old_attr = call.args[0]
    call.args = (getter, call.args[1], *operands)
    call.meta.pop("eager_input_vals", None)  # the old operands' values, which Inductor would read
    if isinstance(old_attr, fx.Node) and not old_attr.users:
        graph.erase_node(old_attr)
    new_index = {old: new for new, old in enumerate(order)}
    old_vals = call.meta.get("val")
    if isinstance(old_vals, (tuple, list)):
        call.meta["val"] = tuple(old_vals[i] if i >= 0 else packs[-1 - i].node.meta.get("val") for i in order)
    for item in list(call.users):
        if item.target is operator.getitem and int(item.args[1]) in new_index:  # type: ignore[arg-type]
            item.update_arg(1, new_index[int(item.args[1])])  # type: ignore[arg-type]
    for j, p in enumerate(packs):
        with graph.inserting_after(call):
            item = graph.call_function(operator.getitem, (call, new_index[-1 - j]))
        item.meta["val"] = p.node.meta.get("val")
        grads = list(p.node.args[0])  # type: ignore[arg-type]
        p.node.replace_all_uses_with(item)
        graph.erase_node(p.node)
        for g in grads:
            graph.erase_node(g)  # type: ignore[arg-type]
    for g in inputs:
        for n in reversed(g.nodes):
            if not n.users:
                graph.erase_node(n)


def absorb_copies_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [copies inside bodies]) Move each outlined unit's bucket copies into its body where every call
    allows it."""
    order = positions(gm.graph)
    for name, calls in subgraph_calls(gm).items():
        plans = [(_inputs(c, order), _packs(c)) for c in calls]
        if not any(i or p for i, p in plans) or len({repr(_signature(i, p)) for i, p in plans}) != 1:
            continue  # nothing to move, or the calls differ
        body, kept = _new_body(getattr(gm, name), *plans[0])
        staged = f"{name}_with_copies"
        gm.add_submodule(staged, body)
        for call, (inputs, packs) in zip(calls, plans):
            _rewrite(gm, call, staged, inputs, packs, kept)
        if not gm.graph.find_nodes(op="get_attr", target=name):  # the body keeps its name
            delattr(gm, name)
            gm.add_submodule(name, body)
            for getter in gm.graph.find_nodes(op="get_attr", target=staged):
                getter.target = name
            delattr(gm, staged)
    gm.graph.lint()
    return gm
