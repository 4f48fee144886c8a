"""A loop body's view copies become views again (NOTE [views in loop bodies]).

NOTE [views in loop bodies]: torch traces a ``scan``'s body functionalized, with every view as its
copying twin (``t_copy``, ``view_copy``, ``select_copy``, ...). Inductor lowers each of those as a
real copy: a kernel, or an eager fallback op, per transposed weight, per reshaped activation and per
half of a rotary embedding, in every iteration. The outer graph keeps plain views, which cost
nothing. The body is functional, so a view is safe wherever the copy was, with one exception: a value
the body returns must not alias one of its inputs, or another returned value (torch's loop ops
refuse that). So a view copy that the body returns stays a copy.

AOTAutograd's decompositions turn some of those copies into a ``clone`` of a view before the backend
sees the body: each weight a matmul reads transposed becomes ``clone(permute(w))``, a copy of the
gathered weight in every iteration (7 in a Llama block's forward and 14 in its backward). A matmul
reads a transposed operand as it is, so a clone of a view that only matmuls read is dropped too.

Before (a loop body)::

    w = all_gather(...) -> wait -> view_copy(w, [out, in]) -> permute -> clone -> mm(x, .)
    return [h, saved]

After ``body_views_pass``::

    w = all_gather(...) -> wait -> view(w, [out, in]) -> permute -> mm(x, .)
    return [h, saved]

The backend runs it in each loop body of a stack's forward and backward (``passes/loops.py``). It
does not touch a graph that holds no loop.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["VIEW_OF_COPY", "body_views_pass"]

aten = torch.ops.aten

VIEW_OF_COPY = {
    aten.t_copy.default: aten.t.default,
    aten.view_copy.default: aten.view.default,
    aten.permute_copy.default: aten.permute.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.expand_copy.default: aten.expand.default,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.select_copy.int: aten.select.int,
    aten.alias_copy.default: aten.alias.default,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
}


_VIEWS = set(VIEW_OF_COPY.values()) | {aten._unsafe_view.default, aten.reshape.default}
_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default}


def _value(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def body_views_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Each view copy in ``gm`` that ``gm`` does not return becomes the view it copies (its value the
    view's, computed under the graph's fake mode), and each clone of a view that only matmuls read is
    dropped (NOTE [views in loop bodies])."""
    (output,) = gm.graph.find_nodes(op="output")
    returned: set[fx.Node] = set()
    fx.node.map_arg(output.args, returned.add)
    for node in gm.graph.nodes:
        view = VIEW_OF_COPY.get(node.target) if node.op == "call_function" else None
        if view is None or node in returned:
            continue
        node.target = view
        _revalue(node)
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is aten.clone.default
                and node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format
                and node not in returned and isinstance(node.args[0], fx.Node)
                and node.args[0].target in _VIEWS and node.users
                and all(user.target in _MATMULS for user in node.users)):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _revalue(node: fx.Node) -> None:
    """``node``'s value recomputed from its arguments' under the graph's fake mode."""
    old = node.meta.get("val")
    if isinstance(old, torch.Tensor) and hasattr(old, "fake_mode"):
        args = fx.node.map_aggregate(node.args, _value)
        kwargs = fx.node.map_aggregate(node.kwargs, _value)
        with old.fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
