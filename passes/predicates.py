"""Small predicates over FX nodes; each docstring draws the shape it matches. Markers are matched by
qualified name (``fsdp::unshard``), so nothing of ``fsdp_compile`` is needed."""

from __future__ import annotations

import operator
from types import SimpleNamespace

import torch
from torch import Tensor, fx

from ._compat import OpOverloadPacket

__all__ = ["VIEW_OPS", "collective_kind", "example_value", "flat_piece", "fsdp_meta", "gathers_needed",
           "is_all_gather", "is_all_reduce", "is_collective", "is_reduce_grad", "is_reduce_scatter", "is_unshard",
           "is_wait", "marker_args", "needs_grad", "op_name", "schema_args", "tensor_bytes", "wait_of",
           "waited_collective"]

c10d = torch.ops._c10d_functional


def _schema(node: fx.Node) -> torch.FunctionSchema | None:
    """The schema of an op call: an overload (AOTAutograd's graphs) or a packet (Dynamo's graphs)."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, OpOverloadPacket):
        target = getattr(target, "default", None)
    return getattr(target, "_schema", None)


def is_unshard(node: fx.Node) -> bool:
    """``shard -> fsdp::unshard -> getitem -> full params`` (NOTE [one marker spec])"""
    return getattr(_schema(node), "name", None) == "fsdp::unshard"


def is_reduce_grad(node: fx.Node) -> bool:
    """``[full grads] -> fsdp::reduce_grad -> the shard's gradient``"""
    return getattr(_schema(node), "name", None) == "fsdp::reduce_grad"


def is_all_gather(node: fx.Node) -> bool:
    """``flat shard -> all_gather_into_tensor`` or ``slice of out -> all_gather_into_tensor_out(out=out)``"""
    return node.op == "call_function" and node.target in (c10d.all_gather_into_tensor.default,
                                                          c10d.all_gather_into_tensor_out.default)


def is_reduce_scatter(node: fx.Node) -> bool:
    """``flat grad -> reduce_scatter_tensor(op, n, group)``"""
    return node.op == "call_function" and node.target is c10d.reduce_scatter_tensor.default


def is_all_reduce(node: fx.Node) -> bool:
    """``grad shard -> all_reduce(op, group)`` (the replicate dimension of HSDP)"""
    return node.op == "call_function" and node.target is c10d.all_reduce.default


def is_collective(node: fx.Node) -> bool:
    """Any collective launch this package emits."""
    return is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node)


def collective_kind(launch: fx.Node) -> str:
    """``all_gather``, ``reduce_scatter`` or ``all_reduce`` for a collective launch."""
    if is_all_gather(launch):
        return "all_gather"
    if is_reduce_scatter(launch):
        return "reduce_scatter"
    if is_all_reduce(launch):
        return "all_reduce"
    raise ValueError(f"{launch.name} is not a collective launch")


def op_name(node: fx.Node) -> str:
    """The overload packet name of a call (``mm``, ``addmm``...), ``getitem``, or the callable's name."""
    if node.target is operator.getitem:
        return "getitem"
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(node.target, "__name__", str(node.target))


def is_wait(node: fx.Node) -> bool:
    """``collective -> wait_tensor``"""
    return node.op == "call_function" and node.target is c10d.wait_tensor.default


def waited_collective(wait: fx.Node) -> fx.Node:
    """``collective -> wait``: the collective a wait waits for."""
    assert is_wait(wait), wait
    launch = wait.args[0]
    assert isinstance(launch, fx.Node) and is_collective(launch), launch
    return launch


def wait_of(collective: fx.Node) -> fx.Node:
    """``collective -> wait``: the (single) wait of a collective."""
    waits = [u for u in collective.users if is_wait(u)]
    assert len(waits) == 1, (collective, waits)
    return waits[0]


def fsdp_meta(node: fx.Node) -> dict[str, object]:
    """The annotations passes leave on nodes (unit, kind, group, stream...)."""
    return node.meta.setdefault("fsdp", {})


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces, from its fake value (0 when unknown)."""
    val = node.meta.get("val")
    return int(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


def example_value(node: fx.Node) -> object:
    """A node's traced value: Dynamo's ``example_value`` or AOTAutograd's ``val``."""
    return node.meta.get("example_value", node.meta.get("val"))


def needs_grad(marker: fx.Node) -> bool:
    """Whether ``marker``'s parameters were traced as needing a gradient (``True`` if the graph does not say)."""
    value = example_value(marker)
    first = value[0] if isinstance(value, (list, tuple)) and value else value
    return bool(getattr(first, "requires_grad", True))


def marker_args(node: fx.Node) -> SimpleNamespace:
    """A marker's arguments as attributes named as in its schema: ``marker_args(node).unit``."""
    assert is_unshard(node) or is_reduce_grad(node), node
    return SimpleNamespace(**schema_args(node))


def schema_args(node: fx.Node) -> dict[str, object]:
    """A marker's arguments by schema name, whether the call passed them by position or keyword."""
    schema = _schema(node)
    assert schema is not None, node
    return {arg.name: node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            for i, arg in enumerate(schema.arguments)}


aten = torch.ops.aten
_NARROW = {aten.narrow.default, aten.slice.Tensor}
_VIEW = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Ops that return a view of their one tensor input and compute nothing.
VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.as_strided.default, aten.permute.default,
                      aten.t.default, aten.transpose.int, aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim})


def flat_piece(node: object) -> tuple[fx.Node, int, int, list[fx.Node]] | None:
    """``base (1-D input) -> narrow(0, offset, n) [-> view(shape)] -> node``, as methods or ATen ops:
    ``(base, offset, n, the nodes from the narrow on)``, else ``None``."""
    if not isinstance(node, fx.Node):
        return None
    chain = [node]
    if _is(node, "view", _VIEW):
        inner = node.args[0]
        if not isinstance(inner, fx.Node):
            return None
        chain.insert(0, inner)
        node = inner
    if not _is(node, "narrow", _NARROW) or len(node.args) < 4:
        return None
    base, dim, start, length = node.args[:4]
    if node.target is aten.slice.Tensor:
        length = length - start if isinstance(length, int) and isinstance(start, int) else None  # (start, end)
        if len(node.args) > 4 and node.args[4] != 1:
            return None
    if (not isinstance(base, fx.Node) or base.op not in ("placeholder", "get_attr") or dim != 0
            or not isinstance(start, int) or not isinstance(length, int)):
        return None
    val = example_value(base)
    if not isinstance(val, Tensor) or val.dim() != 1:
        return None
    return base, start, length, chain


def _is(node: fx.Node, method: str, targets: set) -> bool:
    if node.op == "call_method":
        return node.target == method
    return node.op == "call_function" and node.target in targets


def gathers_needed(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each node's all-gather waits, needed directly or through its inputs, as a bit set (bit ``i``: the
    ``i``-th found). The graph need not be in topological order."""
    needed: dict[fx.Node, int] = {}
    bits: dict[fx.Node, int] = {}
    for start in gm.graph.nodes:
        stack = [start]
        while stack:
            node = stack[-1]
            if node in needed:
                stack.pop()
                continue
            pending = [i for i in node.all_input_nodes if i not in needed]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            mask = 0
            for i in node.all_input_nodes:
                mask |= needed[i]
            if is_wait(node) and is_all_gather(node.args[0]):  # type: ignore[arg-type]
                mask |= 1 << bits.setdefault(node, len(bits))
            needed[node] = mask
    return needed
