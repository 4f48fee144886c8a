"""Outline repeated blocks whose traced graphs are identical: one ``invoke_subgraph`` body, a call per block.

NOTE [outlining by proof]: Dynamo traces every block inline (its guards cover every block as plain
``torch.compile``'s do). This pass finds the run of nodes each block unit produced (``is_block`` picks
them by ``nn_module_stack``) and compares them: runs with the same ops in the same order, the same
constants (``-0.0`` is not ``0.0``), the same pattern of input reads, inputs of the same shape, stride,
dtype, device and ``requires_grad`` compute the same function. Two or more such runs share a body::

    before:  a0 = linear(x, w0); h0 = tanh(a0)    a1 = linear(h0, w1); h1 = tanh(a1)
    after:   body(x, w): a = linear(x, w); return (tanh(a),)
             h0 = invoke_subgraph(body, 'fsdp_block_0', x, w0)[0];  h1 = invoke_subgraph(body, ..., h0, w1)[0]

Nothing is assumed from a block's class. A run stays inline when a body could not reproduce it exactly:
it writes in place to an outside value, outputs a value aliasing an input or another output, outputs a
non-tensor, switches grad mode or autocast, or calls a module or another higher-order op.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..predicates import example_value

__all__ = ["BLOCK_BODY_PREFIX", "block_runs", "outline_blocks_pass"]

invoke_subgraph = torch.ops.higher_order.invoke_subgraph
BLOCK_BODY_PREFIX = "fsdp_block_"

# Calls that change global state (grad mode, autocast) for the nodes after them.
_STATEFUL = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast"}


def _block_of(node: fx.Node, is_block: Callable[[type], bool]) -> str | None:
    """The ``nn_module_stack`` key of the outermost block unit ``node`` was traced in, if any."""
    for key, entry in (node.meta.get("nn_module_stack") or {}).items():
        cls = entry[1] if isinstance(entry, tuple) and len(entry) > 1 else None
        if isinstance(cls, type) and is_block(cls):
            return str(key)
    return None


def block_runs(gm: fx.GraphModule, is_block: Callable[[type], bool]) -> list[list[fx.Node]]:
    """The maximal runs of consecutive computing nodes traced in one block unit (``get_attr`` nodes neither
    join nor break a run)."""
    runs: list[list[fx.Node]] = []
    current: str | None = None
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        block = _block_of(node, is_block) if node.op in ("call_function", "call_method", "call_module") else None
        if block is not None and block == current:
            runs[-1].append(node)
        elif block is not None:
            runs.append([node])
        current = block
    return runs


def _constant(value: object) -> Hashable:
    """A key equal for two arguments exactly when they are the same constant, by type and value."""
    if isinstance(value, float):
        return ("float", math.copysign(1.0, value), value if not math.isnan(value) else "nan")
    if isinstance(value, (bool, int, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    if isinstance(value, slice):
        return ("slice", _constant(value.start), _constant(value.stop), _constant(value.step))
    if isinstance(value, (list, tuple)):  # torch.Size too
        return (type(value).__name__, tuple(_constant(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_constant(k), _constant(v)) for k, v in value.items()))
    return ("object", id(value))  # anything else: alike only if the very same object


def _value_key(value: object) -> Hashable | None:
    """What a body input must agree on between runs; ``None`` where it cannot be a body input."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()),
                str(value.storage_offset()), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return ("int", str(value))
    return None


class _Run:
    """One block's run of nodes: its inputs (in order of first use), its outputs (values read after it) and
    the key that decides which runs share a body."""

    def __init__(self, gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
        self.nodes = nodes
        inside = set(nodes)
        self.inputs: list[fx.Node] = []
        local: dict[fx.Node, Hashable] = {}
        steps: list[Hashable] = []
        refused = False

        def arg(value: object) -> Hashable:
            nonlocal refused
            if isinstance(value, fx.Node):
                if value not in local:
                    if value.op == "get_attr" and not isinstance(_example(gm, value), torch.Tensor):
                        refused = True  # a nested body or a module: not a body input
                    local[value] = ("in", len(self.inputs))
                    self.inputs.append(value)
                return local[value]
            if isinstance(value, (list, tuple)):
                return (type(value).__name__, tuple(arg(v) for v in value))
            if isinstance(value, dict):
                return ("dict", tuple((_constant(k), arg(v)) for k, v in value.items()))
            if isinstance(value, slice):
                return ("slice", arg(value.start), arg(value.stop), arg(value.step))
            return _constant(value)

        for i, node in enumerate(nodes):
            if node.op == "call_module" or getattr(node.target, "__name__", None) in _STATEFUL or \
                    getattr(node.target, "namespace", None) == "higher_order":
                refused = True
            steps.append((node.op, _constant(node.target) if isinstance(node.target, str) else ("t", node.target),
                          arg(node.args), arg(node.kwargs)))
            local[node] = ("n", i)
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        inputs = tuple(_value_key(_example(gm, n)) for n in self.inputs)
        refused = refused or None in inputs or not self._exact(gm)
        self.key: Hashable | None = None if refused else (tuple(steps), inputs,
                                                           tuple(local[n] for n in self.outputs))

    def _exact(self, gm: fx.GraphModule) -> bool:
        """Whether a body reproduces the run: tensor outputs aliasing no input or other output, and no
        in-place write to an input."""
        taken = {s for n in self.inputs for s in _storages(_example(gm, n))}
        for node in self.nodes:
            if _mutates(node) and any(s in taken for s in _storages(_example(gm, node.args[0]))):
                return False
        for node in self.outputs:
            value = _example(gm, node)
            if not isinstance(value, torch.Tensor):
                return False
            storages = _storages(value)
            if not storages or storages & taken:
                return False
            taken |= storages
        return True


def _example(gm: fx.GraphModule, node: object) -> object:
    """The value of an argument: a constant's own, an attribute's, a node's traced value."""
    if not isinstance(node, fx.Node):
        return node
    if node.op != "get_attr":
        return example_value(node)
    value: object = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def _storages(value: object) -> set[StorageWeakRef]:
    if not isinstance(value, torch.Tensor):
        return set()
    try:
        return {StorageWeakRef(value.untyped_storage())}
    except (RuntimeError, NotImplementedError):
        return set()


def _mutates(node: fx.Node) -> bool:
    """An in-place op (``x.add_(...)``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)``, ``x[i] = v``)."""
    if node.target is operator.setitem or node.kwargs.get("inplace") is True:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _body(gm: fx.GraphModule, run: _Run, renamed: dict[fx.Node, fx.Node]) -> fx.GraphModule:
    """The body: ``run``'s nodes reading placeholders."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(run.inputs):
        placeholder = env[renamed.get(node, node)] = graph.placeholder(f"input_{i}")
        placeholder.meta["example_value"] = _example(gm, node)
    for node in run.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in run.outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _call(gm: fx.GraphModule, run: _Run, name: str, renamed: dict[fx.Node, fx.Node]) -> None:
    """Replace ``run``'s nodes by a call of body ``name`` and a ``getitem`` per output; ``renamed``: the
    ``getitem`` standing for each output of the runs replaced so far."""
    first = run.nodes[0]
    inputs = [renamed.get(n, n) for n in run.inputs]
    for node in inputs:
        if node.op == "get_attr":  # a constant fetched between the run's nodes: before the call
            first.prepend(node)
    with gm.graph.inserting_before(first):
        attr = gm.graph.get_attr(name)
        call = gm.graph.call_function(invoke_subgraph, (attr, name, *inputs))
    call.meta["example_value"] = tuple(_example(gm, n) for n in run.outputs)
    call.meta["nn_module_stack"] = dict(first.meta.get("nn_module_stack") or {})
    for i, node in enumerate(run.outputs):
        with gm.graph.inserting_before(first):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta.update(node.meta)
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in run.nodes)
        renamed[node] = item
    for node in reversed(run.nodes):
        gm.graph.erase_node(node)


def outline_blocks_pass(gm: fx.GraphModule, *, is_block: Callable[[type], bool]) -> fx.GraphModule:
    """(NOTE [outlining by proof]) The block runs of ``gm`` that are the same program share one
    ``invoke_subgraph`` body; every other run stays inline."""
    by_key: dict[Hashable, list[_Run]] = {}
    for run in [_Run(gm, nodes) for nodes in block_runs(gm, is_block)]:
        if run.key is not None:
            by_key.setdefault(run.key, []).append(run)
    renamed: dict[fx.Node, fx.Node] = {}
    for index, same in enumerate(same for same in by_key.values() if len(same) >= 2):
        name = f"{BLOCK_BODY_PREFIX}{index}"
        setattr(gm, name, _body(gm, same[0], renamed))
        for run in same:
            _call(gm, run, name, renamed)
    gm.graph.lint()
    gm.recompile()
    return gm
