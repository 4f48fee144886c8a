"""Lower a flat marker straight to its unit's bucket, without the per-parameter collectives between.

NOTE [grouped lowering]: a flat marker (NOTE [flat markers] in ``capture/group_markers.py``) holds every
parameter of a flat unit that one outlined call reads. Split back into per-parameter markers, each is
lowered to a collective of its own (``per_param.py``) and ``bucket.py`` then merges the unit's
collectives into one, erasing what lowering made: per parameter and per graph a splice and its fake
values built only to be thrown away, the larger part of our passes' time for a deep model. When the flat
marker is all of its unit in the graph, it becomes the bucket at once::

    ws = unshard_flat(flat, ...)               -> bucket gather of the flat, copied out per member
                                                  (bucket.splice_gather_bucket)
    g = reduce_grad_flat([g_a, g_b], ...)      -> bucket reduce-scatter of [g_a, g_b], its output whole:
                                                  the flat's gradient (bucket.splice_reduce_bucket)

The gather is the graph that expanding, lowering and bucketing give, node for node, and so is the
reduce-scatter up to its output: the same ops, members in the same order (the flat's), in the same place
(an all-gather bucket where its first member was, a reduce-scatter bucket where its last one was: both
where the flat marker stood). That path then cuts the reduce-scatter's output into members and joins
them again (a ``cat``); here the output is the flat's gradient as it is.

A flat marker is left for the per-parameter path (``expand_markers_pass``) when that path would give
something else: a unit with other markers in the graph (they would share its bucket), a gathered
parameter nothing reads (expanding drops it), a member large enough to keep its own collective
(``alone_bytes``), HSDP (its all-reduce), gradients of mixed dtypes with no reduce dtype, or a world
of one whose collectives are elided.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable

import torch
from torch import fx

from ..graph_ops import NAMES_SEP, numel, unflatten_shapes
from ..predicates import (
    is_flat_reduce_grad,
    is_flat_unshard,
    is_reduce_grad,
    is_unshard,
    schema_args,
)
from .bucket import splice_gather_bucket, splice_reduce_bucket

__all__ = ["lower_grouped_pass"]


def lower_grouped_pass(gm: fx.GraphModule, *, elide_single_rank: bool = True,
                       rank_of: Callable[[str], int] | None = None, alone_bytes: int | None = None) -> fx.GraphModule:
    """(NOTE [grouped lowering]) Each flat marker that is all of its unit in the graph becomes the unit's
    bucketed collective. ``rank_of`` and ``alone_bytes`` as in ``bucket_pass``, ``elide_single_rank``
    as in ``lower_unshard_pass``; whatever is not lowered here is left as it was."""
    markers = Counter()  # (unit, gather?) -> markers, flat or not
    flat: list[fx.Node] = []
    for node in gm.graph.nodes:
        if is_flat_unshard(node) or is_flat_reduce_grad(node):
            flat.append(node)
            markers[(schema_args(node)["unit"], is_flat_unshard(node))] += 1
        elif is_unshard(node) or is_reduce_grad(node):
            markers[(schema_args(node)["unit"], is_unshard(node))] += 1
    for node in flat:
        gather = is_flat_unshard(node)
        a = schema_args(node)
        if markers[(a["unit"], gather)] == 1:
            _lower(gm, node, a, gather=gather, elide=elide_single_rank, rank_of=rank_of, alone_bytes=alone_bytes)
    return gm


def _lower(gm: fx.GraphModule, node: fx.Node, a: dict[str, object], *, gather: bool, elide: bool,
           rank_of: Callable[[str], int] | None, alone_bytes: int | None) -> None:
    # The flat is the gather bucket's one input; the reduce-scatter's output is its gradient.
    inputs = [a["flat"]] if gather else list(a["grads"])  # type: ignore[call-overload]
    world = int(a["world_size"])  # type: ignore[call-overload]
    names = str(a["names"]).split(NAMES_SEP)
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if (a["replicate_group"] or (world == 1 and elide)
            or (gather and (len(items) != len(node.users) or len(items) != len(names)))):
        return
    shard_shapes = unflatten_shapes(a["shard_ranks"], a["shard_dims"])  # type: ignore[arg-type]
    shapes = unflatten_shapes(a["ranks"], a["dims"]) if gather else shard_shapes  # type: ignore[arg-type]
    sizes = [numel(s) for s in shard_shapes]  # each member's share of the bucket, per rank
    vals = [x.meta["val"] for x in inputs]
    cast_to = a["param_dtype"] if gather else a["reduce_dtype"]
    dtypes = {cast_to or v.dtype for v in vals}
    if len(dtypes) != 1:
        return
    (dtype,) = dtypes
    width = torch.empty((), dtype=dtype).element_size()
    casts = not gather and any(v.dtype != dtype for v in vals)  # NOTE [large params alone] in bucket.py
    if alone_bytes is not None and not casts and any(world * n * width >= alone_bytes for n in sizes):
        return
    group = str(a["ag_group" if gather else "rs_group"])
    if gather:  # (the annotations a merged bucket gets, in its order)
        meta: dict[str, object] = {"unit": a["unit"], "kind": "all_gather", "ag_group": a["ag_group"],
                                   "rs_group": a["rs_group"], "params": names}
        outs = splice_gather_bucket(gm.graph, inputs, before=node, meta=meta, world=world, group=group,
                                    sizes=sizes, rank=rank_of(group) if rank_of is not None else None,
                                    dtype=dtype, shapes=shapes)
        for i, out in enumerate(outs):
            items[i].replace_all_uses_with(out)
            gm.graph.erase_node(items[i])
    else:
        meta = {"unit": a["unit"], "ag_group": a["ag_group"], "rs_group": a["rs_group"],
                "replicate_group": a["replicate_group"], "casts": casts, "kind": "reduce_scatter", "params": names}
        ranks = world * max(int(a["replicate_size"]), 1)  # type: ignore[call-overload]
        (out,) = splice_reduce_bucket(gm.graph, inputs, before=node, meta=meta, world=world, group=group,
                                      sizes=sizes, dtype=dtype, divisor=ranks if ranks > 1 else None,
                                      out_dtype=a["out_dtype"], shapes=shapes, whole=True)  # type: ignore[arg-type]
        node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
