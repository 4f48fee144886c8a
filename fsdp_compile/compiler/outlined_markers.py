"""Before AOTAutograd: every ``fsdp::unshard`` marker named after the shard it reads; which bodies stay.

A traced read names no unit or parameter (NOTE [anonymous reads]), so Dynamo hands the backend alike
blocks as calls of one ``invoke_subgraph`` body. Once the capture stage has hoisted the markers to the
calls and inlined the bodies that cannot stay (:func:`worth_a_call`), :func:`name_markers` gives each
marker the unit and name of the shard it reads, from the example inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from fsdp_compile.passes.graph_ops import NAMES_SEP
from fsdp_compile.passes.predicates import flat_piece, is_reduce_grad, is_unshard, marker_args, needs_grad
from fsdp_compile.passes.subgraphs import hop_bodies, hop_calls, holds
from fsdp_compile.api.flat_shard import flat_member
from fsdp_compile.api.markers import ANONYMOUS_UNIT
from fsdp_compile.api.units import sharded_param

__all__ = ["name_markers", "read_params", "worth_a_call"]


def name_markers(gm: fx.GraphModule, *, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Each marker of ``gm`` and of the bodies it calls given the unit and name of the shard it reads."""
    _name_markers(gm, dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)))
    return gm


def read_params(gm: fx.GraphModule) -> frozenset[tuple[int, str]] | None:
    """The (unit, name) of every parameter a marker of ``gm``, or of a body it calls, reads as needing a
    gradient (not under ``no_grad``, not only detached; NOTE [gradients through the parameters]);
    ``None`` while a marker is unnamed."""
    read = {(marker_args(n).unit, name) for g in (gm, *hop_bodies(gm)) for n in g.graph.nodes
            if is_unshard(n) and needs_grad(n) and not all(_only_detached(g, item) for item in n.users)
            for name in str(marker_args(n).names).split(NAMES_SEP)}
    return None if any(unit == ANONYMOUS_UNIT for unit, _ in read) else frozenset(read)


_DETACH = (torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default)


def _only_detached(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether every use of ``node`` in ``gm`` is a ``detach``, or an input of a body that only detaches it."""
    calls = {call: (body, start) for call, body, start in hop_calls(gm)}
    for user in node.users:
        if ((user.op == "call_method" and user.target == "detach")
                or (user.op == "call_function" and user.target in _DETACH)):
            continue
        if user not in calls:
            return False
        body, start = calls[user]
        placeholders = body.graph.find_nodes(op="placeholder")
        if not all(_only_detached(body, placeholders[i - start]) for i, a in enumerate(user.args) if a is node):
            return False
    return True


def _value(gm: fx.GraphModule, values: dict[fx.Node, object], node: object) -> object:
    """What ``node`` of ``gm`` stands for: a placeholder's entry in ``values``, or an attribute of ``gm``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "placeholder":
        return values.get(node)
    if node.op == "get_attr":
        value: object = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return value
    return None


def _name_markers(gm: fx.GraphModule, values: dict[fx.Node, object]) -> None:
    """:func:`name_markers`, with ``values`` the tensors ``gm``'s placeholders stand for."""
    for node in gm.graph.nodes:
        if is_unshard(node) and marker_args(node).unit == ANONYMOUS_UNIT:
            shard = marker_args(node).shard
            tensor = _value(gm, values, shard)
            sp = sharded_param(tensor) if isinstance(tensor, torch.Tensor) else None
            piece = flat_piece(shard) if sp is None else None
            if piece is not None:  # a piece of a flat shard (NOTE [flat shards])
                sp = flat_member(_value(gm, values, piece[0]), piece[1])
            assert sp is not None, f"an outlined unit's marker reads {shard.name}, which is no sharded parameter"
            _set_marker_arg(node, "unit", sp.unit.index)
            _set_marker_arg(node, "names", sp.fqn)
    for call, body, start in hop_calls(gm):
        if holds(body, is_unshard):
            placeholders = body.graph.find_nodes(op="placeholder")
            _name_markers(body, {p: _value(gm, values, a) for p, a in zip(placeholders, call.args[start:])})
            body.recompile()


# A body of fewer ops is inlined: a call costs Inductor the fusion of its ends with their neighbours.
_MIN_BODY_OPS = 8


def worth_a_call(body: fx.GraphModule) -> bool:
    """Keep an outlined body: no marker left inside (NOTE [hoisting markers]), and enough ops."""
    markers = holds(body, lambda n: is_unshard(n) or is_reduce_grad(n))
    return not markers and sum(n.op == "call_function" for n in body.graph.nodes) >= _MIN_BODY_OPS


def _set_marker_arg(node: fx.Node, name: str, value: object) -> None:
    schema = torch.ops.fsdp.unshard.default._schema
    index = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)
