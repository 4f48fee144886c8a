"""Lower every marker to collectives: one all-gather and one reduce-scatter per unit and graph.

NOTE [one lowering]: markers of several pieces (flat markers, NOTE [flat markers] in
``capture/group_markers.py``) or of one are lowered in *buckets*, one collective each (``bucket.py``): a
flat marker is one bucket (its flat shard gathered as it is, the reduce-scatter's output its gradient);
a unit's one-piece markers are one bucket per graph, group and dtype, reduce-scatters in stretches (NOTE
[gradients in stretches]); a large parameter (NOTE [large params alone]) or one whose one-rank collectives
are elided goes alone. An all-gather goes where its bucket's first marker was, a reduce-scatter where the
last was, and ``reorder`` moves the readers after them. Gathers are lowered first (stretches split at them).

NOTE [large params alone]: a dim-0 shard's own all-gather output *is* the full parameter and its own
reduce-scatter output its shard's gradient: alone it needs no pack or unpack copy (in a bucket at world
size above 1 every member's rows are strided). With ``alone_bytes``, members of at least that full size
keep their own collectives; the rest share one. HSDP buckets keep every member, and so does a reduction
that casts: the cast writes each gradient into its slice anyway, so alone would only add launches.

NOTE [gradients in stretches]: a unit that holds others (the root) has gradients at both ends of backward
(output head first, embedding last). Its reduce-scatter members are split where another unit's marker
comes between, each stretch a bucket launched as soon as it exists (``schedule/reduce_scatter.py``); a
stretch is split too before a member that needs an all-gather the earlier members do not (the head's
weight gradient needs none, the final norm's needs the head's weight: one bucket would wait for that
gather). A flat marker's gradient is never split, so ``fully_shard`` gives each parameter of such a unit
a flat of its own (``flat_shard.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from ..graph_ops import NAMES_SEP, numel, unflatten_shapes
from ..order import positions, reorder
from ..predicates import flat_piece, gathers_needed, is_reduce_grad, is_unshard, schema_args
from ..splice import splice
from .bucket import splice_gather, splice_reduce

__all__ = ["lower_markers_pass"]


@dataclass
class _Member:
    """One parameter of a marker: one of its pieces."""
    marker: fx.Node
    grouped: bool  # the marker reads several pieces: a flat shard, cut into them
    name: str
    shape: tuple[int, ...]  # full (gather) or the shard's (reduce)
    size: int  # elements per rank: the shard's
    input: fx.Node  # the marker's shard (a gather), or the full gradient
    offset: int = 0  # in the marker's shard (a gather)
    piece: tuple[int, ...] = ()  # its shard's shape (a gather)
    out: fx.Node | None = None  # what stands for its gathered parameter (a gather): the marker's getitem


def _members(node: fx.Node, a: dict[str, object], gather: bool) -> list[_Member]:
    names = str(a["names"]).split(NAMES_SEP)
    shards = unflatten_shapes(a["shard_ranks"], a["shard_dims"])  # type: ignore[arg-type]
    grouped = len(shards) > 1
    if not gather:
        return [_Member(node, grouped, n, tuple(s), numel(s), g)
                for n, s, g in zip(names, shards, a["grads"])]  # type: ignore[call-overload]
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    assert len(items) == len(node.users), f"{node.name}: read other than by index"
    fulls = unflatten_shapes(a["ranks"], a["dims"])  # type: ignore[arg-type]
    out, offset = [], 0
    for i, (n, s, full) in enumerate(zip(names, shards, fulls)):
        if i in items:
            out.append(_Member(node, grouped, n, tuple(full), numel(s), a["shard"],  # type: ignore[arg-type]
                               offset, tuple(s), items[i]))
        offset += numel(s)
    return out


def _dtype(m: _Member, a: dict[str, object], gather: bool) -> torch.dtype:
    cast_to = a["param_dtype" if gather else "reduce_dtype"]
    return cast_to or m.input.meta["val"].dtype  # type: ignore[return-value]


def _buckets(gm: fx.GraphModule, gather: bool) -> list[tuple[dict[str, object], list[_Member]]]:
    """The markers' members, one list per bucket (NOTE [one lowering]), with the arguments of its first marker."""
    is_marker = is_unshard if gather else is_reduce_grad
    runs: dict[tuple, list[list[_Member]]] = {}
    args: dict[tuple, dict[str, object]] = {}
    previous = None  # the unit of the last reduce-scatter marker
    for node in gm.graph.nodes:
        if not is_marker(node):
            continue
        a = schema_args(node)
        members = _members(node, a, gather)
        if not members:
            continue
        if members[0].grouped:
            key: tuple = (node,)
            runs[key] = [members]
        else:
            key = (a["unit"], a["ag_group" if gather else "rs_group"], a["world_size"], _dtype(members[0], a, gather),
                   a["replicate_group"], a["replicate_size"], None if gather else a["out_dtype"])
            keyed = runs.setdefault(key, [[]])
            if not gather and keyed[-1] and previous != a["unit"]:
                keyed.append([])
            keyed[-1].extend(members)
        args.setdefault(key, a)
        previous = a["unit"]
    if not gather and any(len(r) > 1 for r in runs.values()):
        needs = gathers_needed(gm)
        for key, keyed in runs.items():
            if len(keyed) > 1:
                runs[key] = [part for run in keyed for part in _split_at_gathers(run, needs)]
    return [(args[key], run) for key, keyed in runs.items() for run in keyed if run]


def _split_at_gathers(run: list[_Member], needs: dict[fx.Node, int]) -> list[list[_Member]]:
    """``run`` split before each member that needs an all-gather its earlier members do not."""
    parts: list[list[_Member]] = [[]]
    needed = 0
    for m in run:
        if parts[-1] and needs[m.input] & ~needed:
            parts.append([])
        parts[-1].append(m)
        needed |= needs[m.input]
    return parts


def _parts(members: list[_Member], a: dict[str, object], *, gather: bool, elide: bool, alone_bytes: int | None
           ) -> list[list[_Member]]:
    """``members`` split into the parameters alone (NOTE [large params alone]) and the rest, one bucket."""
    world = int(a["world_size"])  # type: ignore[call-overload]
    if world == 1 and elide:
        return [[m] for m in members]
    dtype = _dtype(members[0], a, gather)
    casts = not gather and any(m.input.meta["val"].dtype != dtype for m in members)
    if alone_bytes is None or a["replicate_group"] or casts:
        return [members]
    width = torch.empty((), dtype=dtype).element_size()
    alone = [m for m in members if world * m.size * width >= alone_bytes]
    rest = [m for m in members if m not in alone]
    return [[m] for m in alone] + ([rest] if rest else [])


def _meta(a: dict[str, object], part: list[_Member], kind: str, casts: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"unit": a["unit"], "kind": kind, "ag_group": a["ag_group"], "rs_group": a["rs_group"]}
    if kind != "all_gather":
        meta.update(replicate_group=a["replicate_group"], casts=casts)
    if len(part) == 1 and not part[0].grouped:
        meta["param"] = part[0].name
    else:
        meta["params"] = [m.name for m in part]
    return meta


def _lower_gathers(gm: fx.GraphModule, hoist: dict[fx.Node, fx.Node], *, elide: bool,
                   rank_of: Callable[[str], int] | None, alone_bytes: int | None) -> None:
    pieces: list[tuple[list[fx.Node], dict[str, object]]] = []
    position = positions(gm.graph).__getitem__  # (splicing keeps the markers' order)
    for a, members in _buckets(gm, gather=True):
        world, group = int(a["world_size"]), str(a["ag_group"])  # type: ignore[call-overload]
        dtype = _dtype(members[0], a, gather=True)
        flat = members[0].grouped
        for part in _parts(members, a, gather=True, elide=elide, alone_bytes=alone_bytes):
            whole = flat and len(part) > 1 and len(part) == len(str(a["names"]).split(NAMES_SEP))
            cuts = None if not flat or whole else [(m.offset, m.piece) for m in part]
            inputs = [part[0].input] if flat else [m.input for m in part]
            first = min((m.marker for m in part), key=position)
            inserted: list[fx.Node] = []
            meta = _meta(a, part, "all_gather")
            outs = splice_gather(gm.graph, inputs, before=first, meta=meta, world=world,
                                 group=group, sizes=[m.size for m in part], shapes=[m.shape for m in part],
                                 dtype=dtype, rank=rank_of(group) if rank_of is not None and len(part) > 1 else None,
                                 elide=elide, cuts=cuts, whole=whole, inserted=inserted)
            for m, out in zip(part, outs):
                assert m.out is not None
                m.out.replace_all_uses_with(out)
                gm.graph.erase_node(m.out)
            if len(part) > 1 and inserted:  # the inputs (views of graph inputs) move up with the bucket
                for x in inputs:
                    for n in _ancestors(x):
                        hoist.setdefault(n, inserted[0])
            pieces.append((inputs, meta))
        for marker in {m.marker: None for m in members}:
            _erase_with_items(marker)
    for marker in [n for n in gm.graph.nodes if is_unshard(n)]:
        _erase_with_items(marker)  # (a marker nothing reads)
    for inputs, meta in pieces:
        _tag_pieces(inputs, meta)


def _erase_with_items(marker: fx.Node) -> None:
    for item in list(marker.users):
        marker.graph.erase_node(item)  # (items nothing reads)
    marker.graph.erase_node(marker)


def _lower_reduces(gm: fx.GraphModule, *, elide: bool, alone_bytes: int | None) -> None:
    position = positions(gm.graph).__getitem__
    for a, members in _buckets(gm, gather=False):
        world, group = int(a["world_size"]), str(a["rs_group"])  # type: ignore[call-overload]
        dtype = _dtype(members[0], a, gather=False)
        casts = any(m.input.meta["val"].dtype != dtype for m in members)
        ranks = world * max(int(a["replicate_size"]), 1)  # type: ignore[call-overload]
        flat = members[0].grouped
        parts = _parts(members, a, gather=False, elide=elide, alone_bytes=alone_bytes)
        whole = flat and len(parts) == 1 and not (world == 1 and elide)
        results: dict[int, fx.Node] = {}
        for part in parts:
            last = max((m.marker for m in part), key=position)
            outs = splice_reduce(gm.graph, [m.input for m in part], before=last,
                                 meta=_meta(a, part, "reduce_scatter", casts), world=world, group=group,
                                 sizes=[m.size for m in part], shapes=[m.shape for m in part], dtype=dtype,
                                 replicate_group=str(a["replicate_group"]), divisor=ranks if ranks > 1 else None,
                                 out_dtype=a["out_dtype"], elide=elide, whole=whole)  # type: ignore[arg-type]
            if whole:
                (results[0],) = outs
            else:
                results.update((id(m), out) for m, out in zip(part, outs))
        if flat:  # the flat's gradient: the bucket's output, or the parts' outputs concatenated
            marker = members[0].marker
            grad = results[0] if whole else splice(gm.graph, lambda *gs: [torch.cat([g.reshape(-1) for g in gs])],
                                                   [results[id(m)] for m in members], before=marker)[0]
            marker.replace_all_uses_with(grad)
            gm.graph.erase_node(marker)
            continue
        for m in members:  # (one piece: its gradient in the shard's shape)
            m.marker.replace_all_uses_with(results[id(m)])
            gm.graph.erase_node(m.marker)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen[n] = None
        stack.extend(n.all_input_nodes)
    return list(seen)


def _tag_pieces(inputs: list[fx.Node], meta: dict[str, object]) -> None:
    """Tag each piece of a flat shard (``narrow`` and ``view``) that only this collective reads as part of
    its prologue."""
    for x in inputs:
        piece = flat_piece(x)
        if piece is None or any(len(n.users) != 1 or n.meta.get("fsdp") for n in piece[3]):
            continue
        for n in piece[3]:
            n.meta["fsdp"] = {k: v for k, v in meta.items() if k in ("kind", "unit", "ag_group", "rs_group")}


def lower_markers_pass(gm: fx.GraphModule, *, elide_single_rank: bool = True,
                       rank_of: Callable[[str], int] | None = None, alone_bytes: int | None = None) -> fx.GraphModule:
    """(NOTE [one lowering]) Replace every marker of ``gm`` by its bucket's collectives.

    ``elide_single_rank``: a group of one rank gets no collective. ``rank_of(group_name)``: this rank's
    index in a group, to gather buckets in place (NOTE [in-place all-gather] in ``bucket.py``).
    ``alone_bytes``: NOTE [large params alone] (``None``: every parameter shares its bucket)."""
    hoist: dict[fx.Node, fx.Node] = {}
    _lower_gathers(gm, hoist, elide=elide_single_rank, rank_of=rank_of, alone_bytes=alone_bytes)
    _lower_reduces(gm, elide=elide_single_rank, alone_bytes=alone_bytes)
    reorder(gm.graph, before=hoist)
    return gm
