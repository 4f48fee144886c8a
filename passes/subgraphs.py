"""Reading higher-order op calls (``invoke_subgraph`` and others) and their bodies."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import fx

from ._compat import FakeTensor

__all__ = ["fresh_value", "holds", "hop_bodies", "hop_calls", "invoke_subgraph", "subgraph_calls"]

invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def subgraph_calls(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """``invoke_subgraph`` calls of ``gm`` by the attribute that holds their body, in graph order."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=invoke_subgraph):
        attr = node.args[0]
        if isinstance(attr, fx.Node) and attr.op == "get_attr":
            out.setdefault(str(attr.target), []).append(node)
    return out


# Higher-order ops -> the argument their body's operands start at.
_HOP_OPERANDS = {invoke_subgraph: 2, torch.ops.higher_order.tag_activation_checkpoint: 1}


def hop_calls(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.GraphModule, int]]:
    """Each higher-order op call in ``gm``: the call, its body, where its operands start."""
    for node in list(gm.graph.nodes):
        start = _HOP_OPERANDS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
        attr = node.args[0] if start is not None else None
        if isinstance(attr, fx.Node) and attr.op == "get_attr":
            body: object = gm
            for part in str(attr.target).split("."):
                body = getattr(body, part)
            if isinstance(body, fx.GraphModule):
                yield node, body, start  # type: ignore[misc]


def hop_bodies(gm: fx.GraphModule, seen: set[int] | None = None) -> Iterator[fx.GraphModule]:
    """Each body of a higher-order op in ``gm`` and, recursively, in those bodies, outermost first, once each."""
    seen = set() if seen is None else seen
    for _, body, _ in hop_calls(gm):
        if id(body) not in seen:
            seen.add(id(body))
            yield body
            yield from hop_bodies(body, seen)


def holds(body: fx.GraphModule, predicate: Callable[[fx.Node], bool]) -> bool:
    """Whether any node of ``body`` or of a body nested in it matches ``predicate``."""
    for node in body.graph.nodes:
        if predicate(node):
            return True
        if node.op == "get_attr":
            inner = getattr(body, str(node.target), None)
            if isinstance(inner, fx.GraphModule) and holds(inner, predicate):
                return True
    return False


def fresh_value(val: object, *, requires_grad: bool = False) -> object:
    """A new fake tensor like ``val`` (elementwise for a list; ``val`` itself if no fake tensor), built on
    the meta device and wrapped by ``val``'s fake mode; ``requires_grad`` keeps ``val``'s."""
    if isinstance(val, (list, tuple)):
        return type(val)(fresh_value(v, requires_grad=requires_grad) for v in val)
    if isinstance(val, FakeTensor):
        meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta",
                                   requires_grad=requires_grad and val.requires_grad)
        return val.fake_mode.fake_tensor_converter.from_meta_and_device(val.fake_mode, meta, val.device)
    return val
