"""A gradient summed from pieces that tile it: their ``cat``, or the tensor they are pieces of.

NOTE [tiled gradients]: a flat shard read as pieces outside a flat marker (NOTE [flat markers] in
``capture/group_markers.py``: a block read inline, not through an outlined call) gets from AOTAutograd
the gradient of each piece scattered into zeros and summed::

    z = full([N], 0); g = add(add(slice_scatter(z, g_a, 0, 0, n_a), slice_scatter(z, g_b, 0, n_a, n_a + n_b)), ...)

When the slices tile ``[0, N)`` once each, that is ``cat([g_a.reshape(-1), g_b.reshape(-1), ...])`` in
the slices' order: one copy, not a zero fill and an add per piece. When the pieces are, in that order,
the consecutive contiguous pieces of one 1-D tensor of ``N`` elements (a reduce-scatter bucket's output
cut into members, NOTE [pieces as strided views] in ``bucket.py``), it is that tensor: no copy at all.
Anything else is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, fx

from ..graph_ops import numel
from ..predicates import VIEW_OPS
from ..splice import splice

__all__ = ["tiles_pass"]

aten = torch.ops.aten


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _zeros(node: object) -> bool:
    """``full([N], 0)`` (``zeros([N])``): a 1-D zero tensor."""
    return (isinstance(node, fx.Node)
            and (node.target is aten.full.default and node.args[1] == 0 or node.target is aten.zeros.default)
            and isinstance(_val(node), Tensor) and _val(node).dim() == 1)  # type: ignore[union-attr]


def _leaves(node: fx.Node, root: fx.Node) -> list[tuple[int, int, fx.Node, fx.Node]] | None:
    """The ``(start, end, source, slice_scatter)`` summed into ``node``, through adds only ``root``'s sum reads."""
    if node is not root and len(node.users) != 1:
        return None
    if node.target is aten.slice_scatter.default:
        z, src, dim, start, end = (list(node.args) + [0, None, None])[:5]
        step = node.args[5] if len(node.args) > 5 else 1
        if not (_zeros(z) and dim == 0 and step == 1 and isinstance(start, int) and isinstance(end, int)
                and isinstance(src, fx.Node)):
            return None
        return [(start, end, src, node)]
    if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return None
        left, right = _leaves(a, root), _leaves(b, root)
        return None if left is None or right is None else left + right
    return None


def _strip_view(node: fx.Node) -> fx.Node:
    """``x -> view/reshape (same elements) -> node``: ``x``."""
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        inner = node.args[0]
        if isinstance(inner, fx.Node) and isinstance(_val(inner), Tensor) and _val(inner).is_contiguous():  # type: ignore[union-attr]
            return inner
    return node


def _whole(sources: Sequence[fx.Node], total: int) -> fx.Node | None:
    """The 1-D tensor of ``total`` elements whose consecutive contiguous pieces ``sources`` are, in order."""
    base, offset = None, 0
    for src in sources:
        piece = _strip_view(src)
        if piece.target is not aten.as_strided.default or len(piece.args) < 4:
            return None
        of, shape, stride, start = piece.args[:4]
        if base is None:
            base = of
        if of is not base or start != offset or list(stride) != _contiguous(shape):  # type: ignore[arg-type]
            return None
        offset += numel(shape)  # type: ignore[arg-type]
    val = _val(base)
    if (not isinstance(base, fx.Node) or not isinstance(val, Tensor) or val.dim() != 1 or val.numel() != total
            or offset != total or val.storage_offset() != 0 or not val.is_contiguous()):
        return None
    return base


def _contiguous(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(list(shape)):
        strides.append(step)
        step *= int(d)
    return strides[::-1]


def _is_sum_root(node: fx.Node) -> bool:
    if node.target not in (aten.add.Tensor, aten.slice_scatter.default):
        return False
    users = list(node.users)
    return not (len(users) == 1 and users[0].target is aten.add.Tensor)


def tiles_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [tiled gradients]) Each sum of ``slice_scatter``s into zeros that tiles its tensor becomes the
    ``cat`` of the pieces, or the tensor they are consecutive pieces of."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _is_sum_root(node) or node.target is not aten.add.Tensor:
            continue
        leaves = _leaves(node, node)
        if not leaves or len({leaf[3].args[0] for leaf in leaves}) != 1:
            continue
        leaves.sort(key=lambda leaf: leaf[0])
        z = leaves[0][3].args[0]
        total = int(_val(z).numel())  # type: ignore[union-attr]
        ends = [0] + [end for _, end, _, _ in leaves]
        if [start for start, _, _, _ in leaves] != ends[:-1] or ends[-1] != total:
            continue
        sources = [src for _, _, src, _ in leaves]
        if any(not isinstance(_val(s), Tensor) or _val(s).numel() != end - start  # type: ignore[union-attr]
               for start, end, s, _ in leaves):
            continue
        whole = _whole(sources, total)
        if whole is None or _val(whole).dtype != _val(node).dtype:  # type: ignore[union-attr]
            (whole,) = splice(gm.graph, lambda *xs: [torch.cat([x.reshape(-1) for x in xs])], sources, before=node)
        node.replace_all_uses_with(whole)
        _erase_sum(node)
        _erase_dead_views(sources)
        if not z.users:  # type: ignore[union-attr]
            gm.graph.erase_node(z)  # type: ignore[arg-type]
    gm.graph.lint()
    return gm


def _erase_dead_views(nodes: Sequence[fx.Node]) -> None:
    """Erase ``nodes`` that are views read by nothing now, and the views before them likewise."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function" or (n.target not in VIEW_OPS and n.target is not aten.reshape.default):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def _erase_sum(node: fx.Node) -> None:
    """Erase the sum's adds and ``slice_scatter``s, from ``node`` (read by nothing now) down."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users:
            continue
        inputs = [i for i in n.all_input_nodes if i.target in (aten.add.Tensor, aten.slice_scatter.default)]
        n.graph.erase_node(n)
        stack.extend(inputs)
