"""Write a rewrite as eager code and splice its trace into a graph.

``splice(graph, fn, inputs, before=node)`` traces ``fn`` with ``make_fx`` on the fake values of
``inputs`` (under the graph's own fake mode), copies the traced nodes in before ``before`` and returns
the nodes standing for ``fn``'s outputs. A pass then reads as the eager code it inserts, and every new
node carries a fake value (``meta["val"]``) for later passes and for Inductor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["splice"]


def _fake_mode(vals: Sequence[object]) -> FakeTensorMode | None:
    return detect_fake_mode(list(vals))


def splice(
    graph: fx.Graph,
    fn: Callable[..., object],
    inputs: Sequence[fx.Node],
    *,
    before: fx.Node,
    meta: dict[str, object] | None = None,
    inserted: list[fx.Node] | None = None,
) -> list[fx.Node]:
    """Insert ``fn(*inputs)`` before ``before``; return the nodes of its (flattened) outputs.

    Every inserted node gets ``meta["fsdp"]`` updated with ``meta`` (unit, kind, ...); when
    ``inserted`` is given, the new nodes are appended to it in graph order.
    """
    vals = [n.meta["val"] for n in inputs]
    mode = _fake_mode(vals)
    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx:
        traced = make_fx(lambda *xs: fn(*xs))(*vals)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs), (len(placeholders), len(inputs))
    env.update(zip(placeholders, inputs))
    outputs: list[fx.Node] = []
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                flat, _ = torch.utils._pytree.tree_flatten(node.args[0])
                outputs = [env[o] for o in flat]
                break
            if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
                env[node] = env[node.args[0]]  # type: ignore[index]
                continue
            new = graph.node_copy(node, lambda n: env[n])
            if meta:
                new.meta.setdefault("fsdp", {}).update(meta)
            if inserted is not None:
                inserted.append(new)
            env[node] = new
    return outputs
