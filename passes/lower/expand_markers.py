"""Split flat markers back into per-parameter markers, in each graph AOTAutograd hands on.

NOTE [flat markers] (``capture/group_markers.py``): the markers one outlined call reads of a flat unit
became one ``fsdp::unshard_flat`` of the flat for AOTAutograd's trace, and its backward one
``fsdp::reduce_grad_flat``; a flat marker that the grouped lowering (``grouped.py``) did not take is
split here into the per-parameter ``fsdp::unshard`` / ``fsdp::reduce_grad`` markers, with the same
arguments and in the same order, so the passes that follow see what they always saw::

    ws = unshard_flat(flat, shard_ranks, shard_dims, ranks, dims, "a\\nb", ...); w_a = ws[0]; w_b = ws[1]
    -> w_a = unshard(view(narrow(flat, 0, 0, n_a), s_a), full_a, ..., "a", ...); w_b = unshard(..., "b", ...)

    g = reduce_grad_flat([g_a, g_b], shard_ranks, shard_dims, "a\\nb", ...)
    -> g = cat([reduce_grad(g_a, s_a, ..., "a", ...).reshape(-1), reduce_grad(g_b, s_b, ..., "b", ...).reshape(-1)])
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx

from ..graph_ops import (
    NAMES_SEP,
    REDUCE_GRAD_ARGS,
    REDUCE_GRAD_SHARED,
    UNSHARD_ARGS,
    UNSHARD_SHARED,
    by_name,
    flat_pieces,
    in_order,
    unflatten_shapes,
)
from ..predicates import is_flat_reduce_grad, is_flat_unshard
from ..splice import splice

__all__ = ["expand_markers_pass"]


def expand_markers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """(NOTE [flat markers]) Each ``fsdp::unshard_flat`` and ``fsdp::reduce_grad_flat`` of an AOTAutograd
    graph split back into its per-parameter ``fsdp::unshard`` / ``fsdp::reduce_grad``."""
    for node in [n for n in gm.graph.nodes if is_flat_unshard(n) or is_flat_reduce_grad(n)]:
        expand_flat(gm, node)
    return gm  # (not recompiled: the passes that follow recompile it)


def expand_flat(gm: fx.GraphModule, node: fx.Node) -> None:
    """Split an ``fsdp::unshard_flat`` back into per-parameter ``fsdp::unshard`` markers on views of the flat,
    or an ``fsdp::reduce_grad_flat`` into per-parameter ``fsdp::reduce_grad`` markers and a ``cat``."""
    if is_flat_unshard(node):
        (flat, shard_ranks, shard_dims, ranks, dims, names, *rest) = node.args
        shard_shapes = unflatten_shapes(shard_ranks, shard_dims)  # type: ignore[arg-type]
        pieces = splice(gm.graph, lambda f: flat_pieces(f, shard_shapes), [flat], before=node)  # type: ignore[list-item]
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        assert len(items) == len(node.users), f"{node.name}: read other than by index"
        for i, (piece, shape, name) in enumerate(zip(pieces, unflatten_shapes(ranks, dims), str(names).split(NAMES_SEP))):  # type: ignore[arg-type]
            item = items.get(i)
            if item is None:
                continue
            with gm.graph.inserting_before(node):
                single = gm.graph.call_function(torch.ops.fsdp.unshard.default,
                                                _single_args(True, piece, shape, name, rest))
            single.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            single.meta["val"] = item.meta["val"]
            item.replace_all_uses_with(single)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        stack = list(pieces)
        while stack:  # the pieces nothing reads, and their narrows
            piece = stack.pop()
            if not piece.users and piece.op == "call_function":
                stack.extend(i for i in piece.all_input_nodes if i is not flat)
                gm.graph.erase_node(piece)
        return
    (grads, shard_ranks, shard_dims, names, *rest) = node.args
    singles = []
    for g, shape, name in zip(grads, unflatten_shapes(shard_ranks, shard_dims), str(names).split(NAMES_SEP)):  # type: ignore[arg-type]
        with gm.graph.inserting_before(node):
            single = gm.graph.call_function(torch.ops.fsdp.reduce_grad.default,
                                            _single_args(False, g, shape, name, rest))
        single.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        val = node.meta["val"]
        single.meta["val"] = val.new_empty(shape)
        singles.append(single)
    (cat,) = splice(gm.graph, lambda *gs: [torch.cat([g.reshape(-1) for g in gs])], singles, before=node)
    node.replace_all_uses_with(cat)
    gm.graph.erase_node(node)


def _single_args(unshard: bool, x: fx.Node, shape: list[int], name: str, shared: Sequence[object]) -> tuple:
    """A per-parameter marker's arguments (NOTE [one marker spec]): ``x`` (the shard, or the full
    gradient), its shape (full, or the shard's), its name and a flat marker's shared arguments."""
    if unshard:
        return in_order(UNSHARD_ARGS, shard=x, full_shape=shape, name=name, accumulate=None,
                        **by_name(UNSHARD_SHARED, shared))
    return in_order(REDUCE_GRAD_ARGS, grad=x, shard_shape=shape, name=name, **by_name(REDUCE_GRAD_SHARED, shared))
