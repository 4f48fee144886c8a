"""Outline repeated units: the ops of identical blocks become calls of one shared subgraph.

NOTE [outlining]: a whole-model graph hands Inductor (and AOTAutograd before it) one copy of a block's
ops per block, so compile time grows with depth. This pass runs on Dynamo's graph, before AOTAutograd.
Each unit's *body* (the ops traced inside the module that owns its parameters, the ``fsdp::unshard``
markers excepted) becomes a call of ``invoke_subgraph``; bodies with the same ops, constants and
input/output metadata call the same subgraph, which AOTAutograd traces and partitions once and
Inductor compiles once. The markers stay in the outer graph, as the bodies' inputs, so the passes
still see every unit's all-gather and reduce-scatter and place them across unit boundaries::

    before:  w0 = unshard(s0, unit 0); h1 = <block ops>(h0, w0); w1 = unshard(s1, unit 1); h2 = <block ops>(h1, w1)
    after:   w0 = unshard(s0, unit 0); h1 = invoke_subgraph(body_0, h0, w0)[0]
             w1 = unshard(s1, unit 1); h2 = invoke_subgraph(body_0, h1, w1)[0]

A unit's module is the longest common prefix of its markers' ``nn_module_stack`` (the unit with no
common module, usually the root, is never outlined). A unit is left as it is when its body is not one
contiguous stretch of the graph (markers aside), holds another unit's markers, reads or returns a value
that is not a tensor, mutates anything, draws random numbers, or calls a submodule or attribute: the
pass only outlines what it can prove is a pure function of its inputs. Fewer than ``min_copies``
identical bodies, or bodies of fewer than ``min_ops`` ops, are not worth a call (it costs Inductor the
fusion of the body's first and last ops with their neighbours) and stay inline.

NOTE [outlining: what was tried] (torch 2.13 CPU, 2.11 H200)

* ``torch.compiler.nested_compile_region`` on each unit's forward: Dynamo reuses a traced region only
  when every guard of the first trace holds for the next call, and the markers read per-unit constants
  (unit index, parameter name), so every block after the first is traced again, and past
  ``max_reuse_entries`` (8) Dynamo raises. It would need markers whose traced arguments are the same for
  identical blocks, the per-unit constants filled in by the backend from the shards it is handed.
* ``torch._dynamo.config.use_graph_deduplication``: Dynamo's own outlining leaves the markers outside
  the regions, as this pass does, and the whole pipeline ran with it; but it is a global Dynamo setting
  read while tracing, before any backend is called, so a backend cannot switch it on for its model.
* After AOTAutograd, a forward call returned the gathered parameters for its backward call, which kept
  them alive from forward to backward (no reshard): see NOTE [reshard through outlined bodies] in
  fsdp_compile/backend.py. And Inductor lowers a subgraph once per attribute *name* while AOTAutograd
  installs one per call: :func:`share_subgraphs_pass`.
* A body's forward saves what its backward needs; for a linear layer that is the transposed weight,
  a view of the gathered param, which keeps the param alive from forward to backward (reshard is lost
  for outlined units: the memory of ``reshard_after_forward=False``). Tagging views of a body's inputs
  must-recompute in its partition fixes that (backward then gathers again and reads the param itself),
  and the graphs look right, but the losses then drifted from the reference at 2 gloo ranks (relative
  1e-3 within 10 steps; exact at 1 rank with the collectives kept); so did outlined units with
  ``reshard_after_forward=False`` (which now stay inline). The cause was not found in the time this
  had; a suspect is Inductor's handling of a subgraph input that is also read after the call.
  This is why ``outline`` is off by default.
* What still grows with depth: Dynamo traces every block (with parametrized reads, about twice plain
  Dynamo's time per block); AOTAutograd derives each call's schema by tracing the subgraph again
  (``maybe_run_autograd -> gen_schema`` in torch/_ops.py, torch 2.13); and the outer graph keeps each
  unit's collectives with their pack/unpack copies, which Inductor lowers one by one.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from .predicates import UnshardArgs, is_unshard

__all__ = ["outline_units_pass", "share_subgraphs_pass"]

_CALLS = ("call_function", "call_method")
_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem, operator.delitem}
_RANDOM_NAMES = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "random", "poisson",
                 "exponential", "geometric", "cauchy", "log_normal", "rrelu")


@dataclass
class _Body:
    unit: int
    nodes: list[fx.Node]  # graph order
    inputs: list[fx.Node]  # outer nodes the body reads, in order of first use
    outputs: list[fx.Node]  # body nodes read outside it, in graph order


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """``(key, path)`` of each module ``node`` was traced inside, outermost first, parametrizations left out."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path = str(value[0] if isinstance(value, tuple) else value)
        if "parametrizations" in path.replace("[", ".").replace("]", ".").split("."):
            break
        out.append((str(key), path))
    return out


def _common_prefix(stacks: Iterable[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    stacks = list(stacks)
    prefix = stacks[0] if stacks else []
    for s in stacks[1:]:
        n = 0
        while n < min(len(prefix), len(s)) and prefix[n] == s[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _val(node: fx.Node) -> object:
    return node.meta.get("example_value", node.meta.get("val"))


def _is_pure(node: fx.Node) -> bool:
    """No mutation, no randomness: safe to move into a subgraph and share."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target in _INPLACE_FUNCTIONS or node.kwargs.get("inplace") is True:
        return False
    if name.endswith("_") and not name.endswith("__"):
        return False
    if any(word in name.lower() for word in _RANDOM_NAMES):
        return False
    schema = getattr(target, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def _body(unit: int, scope: list[tuple[str, str]], graph_nodes: list[fx.Node], index: dict[fx.Node, int],
          marker_units: dict[fx.Node, int]) -> _Body | None:
    """Unit ``unit``'s body, or ``None`` when it cannot be outlined (see the module doc)."""
    depth = len(scope)
    inside = [n for n in graph_nodes if n.op not in ("placeholder", "output") and _stack(n)[:depth] == scope]
    nodes = [n for n in inside if n not in marker_units]
    if not nodes or any(marker_units[n] != unit for n in inside if n in marker_units):
        return None  # empty, or it holds another unit's markers (nested units)
    members = set(nodes)
    first, last = index[nodes[0]], index[nodes[-1]]
    if any(n not in members and n not in marker_units for n in graph_nodes[first:last + 1]):
        return None  # not contiguous
    if any(n.op not in _CALLS or not _is_pure(n) for n in nodes):
        return None
    inputs: dict[fx.Node, None] = {}
    for n in nodes:
        for i in n.all_input_nodes:
            if i not in members:
                inputs.setdefault(i, None)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    if not all(isinstance(_val(n), torch.Tensor) for n in [*inputs, *outputs]):
        return None
    return _Body(unit, nodes, list(inputs), outputs)


def _tensor_sig(val: object) -> object:
    if isinstance(val, torch.Tensor):
        return ("T", tuple(val.shape), tuple(val.stride()), val.dtype, str(val.device), val.requires_grad)
    return type(val).__name__


def _signature(body: _Body) -> object:
    """Equal signatures: the same ops on inputs of the same metadata, the same outputs read outside."""
    local = {n: i for i, n in enumerate(body.nodes)}
    outer = {n: i for i, n in enumerate(body.inputs)}

    def ref(a: object) -> object:
        if isinstance(a, fx.Node):
            return ("body", local[a]) if a in local else ("in", outer[a])
        return a

    ops = tuple(
        (n.op, n.target, repr(fx.node.map_aggregate(n.args, ref)), repr(fx.node.map_aggregate(n.kwargs, ref)),
         _tensor_sig(_val(n)))
        for n in body.nodes
    )
    return (ops, tuple(_tensor_sig(_val(i)) for i in body.inputs), tuple(local[o] for o in body.outputs))


def _subgraph(gm: fx.GraphModule, body: _Body) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, x in enumerate(body.inputs):
        p = graph.placeholder(f"input_{i}")
        p.meta["example_value"] = _val(x)
        env[x] = p
    for n in body.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in body.outputs))
    return fx.GraphModule(gm, graph)


def _replace(gm: fx.GraphModule, body: _Body, name: str, replaced: dict[fx.Node, fx.Node]) -> None:
    """Call subgraph ``name`` instead of ``body``; ``replaced`` maps outlined outputs to their getitems."""
    graph = gm.graph
    members = set(body.nodes)
    inputs = [replaced.get(i, i) for i in body.inputs]  # an earlier body's output is read through its getitem
    with graph.inserting_after(body.nodes[-1]):
        attr = graph.get_attr(name)
    with graph.inserting_after(attr):
        call = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, name, *inputs))
    call.meta["example_value"] = tuple(_val(o) for o in body.outputs)
    cursor = call
    for i, out in enumerate(body.outputs):
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta.update({k: v for k, v in out.meta.items() if k in ("example_value", "val", "nn_module_stack",
                                                                         "stack_trace", "source_fn_stack")})
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        replaced[out] = item
        cursor = item
    for n in reversed(body.nodes):
        graph.erase_node(n)


def outline_units_pass(gm: fx.GraphModule, *, min_copies: int = 2, min_ops: int = 8) -> fx.GraphModule:
    """Replace the bodies of identical units with calls of one shared subgraph each (see module doc)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    marker_units = {n: UnshardArgs.of(n).unit for n in nodes if is_unshard(n)}
    by_unit: dict[int, list[fx.Node]] = {}
    for n, unit in marker_units.items():
        by_unit.setdefault(unit, []).append(n)
    groups: dict[object, list[_Body]] = {}
    for unit, markers in by_unit.items():
        scope = _common_prefix(_stack(m) for m in markers)
        if not scope or not all(UnshardArgs.of(m).reshard for m in markers):
            continue  # no module of its own; or kept gathered to backward (see the NOTE below)
        body = _body(unit, scope, nodes, index, marker_units)
        if body is not None and len(body.nodes) >= min_ops:
            groups.setdefault(_signature(body), []).append(body)
    taken = {name for name, _ in gm.named_children()}
    k = 0
    replaced: dict[fx.Node, fx.Node] = {}
    for bodies in groups.values():
        if len(bodies) < min_copies:
            continue
        while f"fsdp_unit_body_{k}" in taken:
            k += 1
        name = f"fsdp_unit_body_{k}"
        taken.add(name)
        gm.add_submodule(name, _subgraph(gm, bodies[0]))
        for body in bodies:
            _replace(gm, body, name, replaced)
    gm.graph.lint()
    gm.recompile()
    return gm


def share_subgraphs_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Make every ``invoke_subgraph`` call of one subgraph read it through one attribute.

    AOTAutograd installs the partitioned forward (or backward) of an outlined body once per call, each
    under a name of its own, while Inductor lowers a subgraph once per *name*: without this pass it
    would lower and generate code for the same block once per call again. Calls with the same
    identifier and the same subgraph module (or one with the same code) read the first one's name.
    """
    first: dict[str, tuple[str, fx.GraphModule]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        attr, identifier = node.args[0], node.args[1]
        if not isinstance(attr, fx.Node) or attr.op != "get_attr":
            continue
        module = getattr(gm, str(attr.target))
        if str(identifier) not in first:
            first[str(identifier)] = (str(attr.target), module)
            continue
        name, shared = first[str(identifier)]
        if name != attr.target and (module is shared or module.code == shared.code):
            with gm.graph.inserting_before(attr):
                node.update_arg(0, gm.graph.get_attr(name))
            if not attr.users:
                gm.graph.erase_node(attr)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm
