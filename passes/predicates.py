"""Small predicates over FX nodes; each docstring draws the shape it matches.

The marker ops are matched by their qualified names (``fsdp::unshard``, ``fsdp::reduce_grad``), so this
package needs nothing from ``fsdp_compile``: graphs are read through their op arguments alone.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import torch
from torch import Tensor, fx

from ._compat import OpOverloadPacket

__all__ = [
    "marker_args",
    "needs_grad",
    "is_unshard",
    "is_reduce_grad",
    "flat_piece",
    "is_all_gather",
    "is_reduce_scatter",
    "is_all_reduce",
    "gathers_needed",
    "VIEW_OPS",
    "is_collective",
    "collective_kind",
    "op_name",
    "is_wait",
    "waited_collective",
    "wait_of",
    "fsdp_meta",
    "tensor_bytes",
    "schema_args",
]

c10d = torch.ops._c10d_functional


def _schema(node: fx.Node) -> torch.FunctionSchema | None:
    """The schema of an op call: an overload (AOTAutograd's graphs) or a packet (Dynamo's graphs)."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, OpOverloadPacket):
        target = getattr(target, "default", None)
    return getattr(target, "_schema", None)


def _schema_name(node: fx.Node) -> str | None:
    schema = _schema(node)
    return schema.name if schema is not None else None


def is_unshard(node: fx.Node) -> bool:
    """``shard -> fsdp::unshard -> getitem -> full params``: a marker before lowering (NOTE [one marker
    spec] in ``graph_ops.py``)."""
    return _schema_name(node) == "fsdp::unshard"


def is_reduce_grad(node: fx.Node) -> bool:
    """``[full grads] -> fsdp::reduce_grad -> the shard's gradient``: a marker before lowering."""
    return _schema_name(node) == "fsdp::reduce_grad"


def is_all_gather(node: fx.Node) -> bool:
    """``flat shard -> all_gather_into_tensor(n, group)``, or the in-place form a bucket uses:
    ``slice of out -> all_gather_into_tensor_out(n, group, out=out)``"""
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


def collective_group(node: fx.Node) -> str:
    """The group name argument of a collective launch."""
    group = node.args[-1]
    assert isinstance(group, str), node
    return group


def fsdp_meta(node: fx.Node) -> dict[str, object]:
    """The annotations passes leave on nodes they create (unit, kind, group, stream, bytes...)."""
    return node.meta.setdefault("fsdp", {})


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces, from its fake value (0 when unknown)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    return 0


def needs_grad(marker: fx.Node) -> bool:
    """Whether the parameters ``marker`` gathers were traced as needing a gradient (not read under
    ``torch.no_grad()``, the shard not frozen); ``True`` where the graph does not say."""
    value = marker.meta.get("example_value", marker.meta.get("val"))
    first = value[0] if isinstance(value, (list, tuple)) and value else value
    return bool(getattr(first, "requires_grad", True))


def marker_args(node: fx.Node) -> SimpleNamespace:
    """A marker's arguments (``fsdp::unshard`` or ``fsdp::reduce_grad``) as attributes named as in its
    schema, which ``graph_ops`` builds from the one marker spec (NOTE [one marker spec]):
    ``marker_args(node).unit``."""
    assert is_unshard(node) or is_reduce_grad(node), node
    return SimpleNamespace(**schema_args(node))


def schema_args(node: fx.Node) -> dict[str, object]:
    """A marker's arguments by schema name, whether the call passed them by position or keyword."""
    schema = _schema(node)
    assert schema is not None, node
    out: dict[str, object] = {}
    for i, arg in enumerate(schema.arguments):
        out[arg.name] = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
    return out


_NARROW = {torch.ops.aten.narrow.default, torch.ops.aten.slice.Tensor}

_VIEW = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}

# Ops that return a view of their one tensor input and compute nothing.
VIEW_OPS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default,
                      torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
                      torch.ops.aten.alias.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim})


def flat_piece(node: object) -> tuple[fx.Node, int, int, list[fx.Node]] | None:
    """``base -> narrow(0, offset, n) [-> view(shape)] -> node``, as Dynamo records the read of a flat
    shard's piece (``Tensor.narrow`` / ``Tensor.view`` methods) or as ATen ops: ``(base, offset, n, the
    nodes from the narrow on)``, else ``None``. ``base`` is a 1-D graph input."""
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
    if node.target is torch.ops.aten.slice.Tensor:
        length = length - start if isinstance(length, int) and isinstance(start, int) else None  # (start, end)
        if len(node.args) > 4 and node.args[4] != 1:
            return None
    if (not isinstance(base, fx.Node) or base.op not in ("placeholder", "get_attr") or dim != 0
            or not isinstance(start, int) or not isinstance(length, int)):
        return None
    val = base.meta.get("example_value", base.meta.get("val"))
    if not isinstance(val, Tensor) or val.dim() != 1:
        return None
    return base, start, length, chain


def _is(node: fx.Node, method: str, targets: set) -> bool:
    if node.op == "call_method":
        return node.target == method
    return node.op == "call_function" and node.target in targets


def gathers_needed(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each node's all-gathers, as a bit set (bit ``i``: the ``i``-th all-gather wait found), that it
    needs directly or through its inputs. The graph need not be in topological order (a pass that
    splices before reordering leaves it so)."""
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
