"""Lower a grouped marker straight to its unit's bucket, without the per-parameter collectives between.

NOTE [grouped lowering]: a grouped marker (NOTE [grouped markers] in ``capture/group_markers.py``) holds
every parameter one outlined call reads. Split back into per-parameter markers, each is lowered to a collective of its
own (``per_param.py``) and ``bucket.py`` then merges the unit's collectives into one, erasing what lowering
made: per parameter and per graph a splice and its fake values built only to be thrown away, the larger
part of our passes' time for a deep model. When the grouped marker is all of its unit in the graph, it
becomes the bucket at once::

    ws = unshard_many([s_a, s_b], ...)           -> bucket gather of [s_a, s_b]   (bucket.splice_gather_bucket)
    gs = reduce_grad_many([g_a, g_b], ...)       -> bucket reduce-scatter of [g_a, g_b]

The result is the graph lowering and bucketing give, node for node: the same ops, members in the same
order (the grouped marker's, which expanding keeps), in the same place (an all-gather bucket where its
first member was, a reduce-scatter bucket where its last one was: both where the grouped marker stood).
A grouped marker is left for the per-parameter path (``expand_markers_pass``) when that path would give
something else: a unit with other markers in the graph (they would share its bucket), an output nothing
reads (expanding drops it), a member large enough to keep its own collective (``alone_bytes``), HSDP
(its all-reduce), mixed collective dtypes, or a world of one whose collectives are elided.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable

import torch
from torch import fx

from ..graph_ops import NAMES_SEP, numel, unflatten_shapes
from ..predicates import (
    is_flat_reduce_grad,
    is_flat_unshard,
    is_grouped_reduce_grad,
    is_grouped_unshard,
    is_reduce_grad,
    is_unshard,
    schema_args,
)
from .bucket import splice_gather_bucket, splice_reduce_bucket

__all__ = ["lower_grouped_pass"]


def lower_grouped_pass(gm: fx.GraphModule, *, elide_single_rank: bool = True,
                       rank_of: Callable[[str], int] | None = None, alone_bytes: int | None = None) -> fx.GraphModule:
    """NOTE [grouped lowering]: each grouped marker that is all of its unit in the graph becomes the
    unit's bucketed collective. ``rank_of`` and ``alone_bytes`` as in ``bucket_pass``,
    ``elide_single_rank`` as in ``lower_unshard_pass``; whatever is not lowered here is left as it was."""
    markers = Counter()  # (unit, gather?) -> markers, grouped or not
    grouped: list[fx.Node] = []
    for node in gm.graph.nodes:
        if is_grouped_unshard(node) or is_grouped_reduce_grad(node) or is_flat_unshard(node) or is_flat_reduce_grad(node):
            grouped.append(node)
            markers[(schema_args(node)["unit"], is_grouped_unshard(node) or is_flat_unshard(node))] += 1
        elif is_unshard(node) or is_reduce_grad(node):
            markers[(schema_args(node)["unit"], is_unshard(node))] += 1
    for node in grouped:
        gather = is_grouped_unshard(node) or is_flat_unshard(node)
        a = schema_args(node)
        if markers[(a["unit"], gather)] == 1:
            _lower(gm, node, a, gather=gather, elide=elide_single_rank, rank_of=rank_of, alone_bytes=alone_bytes)
    return gm


def _lower(gm: fx.GraphModule, node: fx.Node, a: dict[str, object], *, gather: bool, elide: bool,
           rank_of: Callable[[str], int] | None, alone_bytes: int | None) -> None:
    # NOTE [flat shards] in capture/group_markers.py: the flat is the bucket's one input, the reduce-scatter's
    # output its gradient.
    flat = is_flat_unshard(node) or is_flat_reduce_grad(node)
    inputs = [a["flat"]] if is_flat_unshard(node) else list(a["shards" if gather else "grads"])  # type: ignore[call-overload]
    world = int(a["world_size"])  # type: ignore[call-overload]
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    members = len(str(a["names"]).split(NAMES_SEP))
    if (a["replicate_group"] or (world == 1 and elide)
            or (not (flat and not gather) and (len(items) != len(node.users) or len(items) != members))):
        return
    if flat:
        shard_shapes = unflatten_shapes(a["shard_ranks"], a["shard_dims"])  # type: ignore[arg-type]
        shapes = unflatten_shapes(a["ranks"], a["dims"]) if gather else shard_shapes  # type: ignore[arg-type]
    else:
        shapes = unflatten_shapes(a["ranks"], a["dims"])  # type: ignore[arg-type]
    vals = [x.meta["val"] for x in inputs]
    cast_to = a["param_dtype"] if gather else a["reduce_dtype"]
    dtypes = {cast_to or v.dtype for v in vals}
    if len(dtypes) != 1:
        return
    (dtype,) = dtypes
    # Each member's collective input: its shard (gather), or its full gradient padded to ``world`` shards.
    if flat and gather:
        sizes = [numel(s) for s in shard_shapes]
    else:
        sizes = [int(v.numel()) if gather else math.prod(shape) for v, shape in zip(vals, shapes)]
    width = torch.empty((), dtype=dtype).element_size()
    casts = not gather and any(v.dtype != dtype for v in vals)  # NOTE [large params alone] in bucket.py
    if alone_bytes is not None and not casts and any(world * n * width >= alone_bytes for n in sizes):
        return
    group = str(a["ag_group" if gather else "rs_group"])
    names = str(a["names"]).split(NAMES_SEP)
    if gather:  # (the annotations a merged bucket gets, in its order)
        meta: dict[str, object] = {"unit": a["unit"], "kind": "all_gather", "ag_group": a["ag_group"],
                                   "rs_group": a["rs_group"], "params": names}
        outs = splice_gather_bucket(gm.graph, inputs, before=node, meta=meta, world=world, group=group,
                                    sizes=sizes, rank=rank_of(group) if rank_of is not None else None,
                                    dtype=dtype, shapes=shapes)
    else:
        meta = {"unit": a["unit"], "ag_group": a["ag_group"], "rs_group": a["rs_group"],
                "replicate_group": a["replicate_group"], "casts": casts, "kind": "reduce_scatter", "params": names}
        ranks = world * max(int(a["replicate_size"]), 1)  # type: ignore[call-overload]
        outs = splice_reduce_bucket(gm.graph, inputs, before=node, meta=meta, world=world, group=group,
                                    sizes=sizes, dtype=dtype, divisor=ranks if ranks > 1 else None,
                                    out_dtype=a["out_dtype"], shapes=shapes, whole=flat)  # type: ignore[arg-type]
        if flat:
            node.replace_all_uses_with(outs[0])
            gm.graph.erase_node(node)
            return
    for i, out in enumerate(outs):
        items[i].replace_all_uses_with(out)
        gm.graph.erase_node(items[i])
    gm.graph.erase_node(node)
