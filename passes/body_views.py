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
The backward body also transposes, copies and transposes back: a weight ``w`` reaches its matmul as
``permute(clone(permute(w)))``, and a weight's gradient reaches the reduce-scatter's pack as
``clone(permute(clone(permute(mm(...)))))``. A transpose of a copy of a transpose that undoes it is
the original tensor, and a contiguous copy of a contiguous result that only a matmul or the pack reads
is that result: three copies the size of each weight, per iteration, gone.

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

from .copies import pack_rows

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
_READERS = _MATMULS | {pack_rows._opoverload}  # read their inputs, never mutate or keep them


def _dims(node: fx.Node) -> list[int] | None:
    """The permutation a transposing view applies, or ``None`` for any other node."""
    if node.op != "call_function":
        return None
    ndim = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else None
    if node.target is aten.permute.default:
        return [d % len(node.args[1]) for d in node.args[1]]  # type: ignore[arg-type]
    if node.target is aten.t.default and ndim == 2:
        return [1, 0]
    if node.target is aten.transpose.int and ndim is not None:
        dims, (a, b) = list(range(ndim)), (node.args[1] % ndim, node.args[2] % ndim)  # type: ignore[operator]
        dims[a], dims[b] = dims[b], dims[a]
        return dims
    return None


def _copy_of(node: object) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.clone.default
            and node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format)


def _value(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def body_views_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Each view copy in ``gm`` that ``gm`` does not return becomes the view it copies (its value the
    view's, computed under the graph's fake mode); a transpose of a copy of the transpose it undoes
    becomes the original; and a copy that only matmuls (of a view) or readers (of a contiguous result)
    read is dropped (NOTE [views in loop bodies])."""
    (output,) = gm.graph.find_nodes(op="output")
    returned: set[fx.Node] = set()
    fx.node.map_arg(output.args, returned.add)
    for node in gm.graph.nodes:
        view = VIEW_OF_COPY.get(node.target) if node.op == "call_function" else None
        if view is None or node in returned:
            continue
        node.target = view
        _revalue(node)
    for node in list(gm.graph.nodes):  # a transpose of a copy of the transpose it undoes: the original
        outer = _dims(node)
        copy = node.args[0] if outer is not None else None
        if not _copy_of(copy) or node in returned or any(u.target in _VIEWS for u in node.users):
            continue  # the original itself must not reach what the body returns through a view
        inner_node = copy.args[0]  # type: ignore[union-attr]
        inner = _dims(inner_node) if isinstance(inner_node, fx.Node) else None
        if inner is not None and len(inner) == len(outer) and all(inner[outer[i]] == i for i in range(len(outer))):
            node.replace_all_uses_with(inner_node.args[0])  # type: ignore[union-attr]
            for dead in (node, copy, inner_node):  # only these: a wait's result may go unused
                if not dead.users:  # type: ignore[union-attr]
                    gm.graph.erase_node(dead)  # type: ignore[arg-type]
    for node in list(gm.graph.nodes):
        if not _copy_of(node) or node in returned or not node.users or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        if source.target in _VIEWS and all(user.target in _MATMULS for user in node.users):
            node.replace_all_uses_with(source)  # a matmul reads the view as it is
        elif (source.op == "call_function" and source.target not in _VIEWS and _contiguous(source)
              and all(user.target in _READERS for user in node.users)
              and all(user.target in _READERS or user is node for user in source.users)):
            node.replace_all_uses_with(source)  # a contiguous copy of a contiguous result, read only
        else:
            continue
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _contiguous(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _revalue(node: fx.Node) -> None:
    """``node``'s value recomputed from its arguments' under the graph's fake mode."""
    old = node.meta.get("val")
    if isinstance(old, torch.Tensor) and hasattr(old, "fake_mode"):
        args = fx.node.map_aggregate(node.args, _value)
        kwargs = fx.node.map_aggregate(node.kwargs, _value)
        with old.fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
