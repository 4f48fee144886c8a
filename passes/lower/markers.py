"""Lower every marker to collectives: one all-gather and one reduce-scatter per unit and graph.

NOTE [one lowering]: a graph AOTAutograd hands on reads parameters through one marker op, of one piece or
several (NOTE [flat markers] in ``capture/group_markers.py``): a flat marker, every parameter of a flat
unit that one outlined call (or the unit's inline code) reads, and a marker of one piece, for a unit not
laid out flat. This pass gathers the markers' parameters into *buckets* and writes one collective per
bucket (``bucket.py``):

- a flat marker is one bucket: its flat shard gathered as it is, the reduce-scatter's output the flat's
  gradient as it is;
- the markers of one piece of a unit are one bucket per graph (one group, one dtype), in graph order; a
  reduce-scatter bucket is split into stretches (NOTE [gradients in stretches]);
- a parameter large enough goes alone (NOTE [large params alone]), and so does every parameter of a
  group of one rank whose collectives are elided: only its casts remain.

An all-gather bucket goes where its first member's marker was, a reduce-scatter where its last one was;
``order.reorder`` then moves each member's readers after the bucket. Gathers are lowered first: a
stretch ends before a gradient that needs a gather the earlier ones do not.

NOTE [large params alone]: a parameter is stored as a dim-0 shard, so its own all-gather's output *is*
the full parameter (rank-major rows) and its own reduce-scatter's output is its shard's gradient: alone,
it needs neither a pack nor an unpack copy (in a bucket, world > 1 makes every member's gathered rows
strided, copied out to be used). With ``alone_bytes`` set, a member whose full size is at least that
many bytes keeps its own collective; the smaller ones share the bucket, where one launch pays for them
all. HSDP buckets keep every member, and so does a reduction that casts (``reduce_dtype`` other than the
gradient's dtype): the cast it needs anyway writes each gradient straight into its slice of the bucket,
so alone it would save no copy, and a flat shard's bucket output *is* its gradient where alone pieces
are copied together again; what alone would cost is a launch per parameter, host time that a backward
of large matmuls cannot spare (docs/performance.md).

NOTE [gradients in stretches]: a unit's gradients usually exist together, in its own stretch of
backward. A unit that holds others (the root) does not: its output head's gradient exists at the start
of backward, its embedding's at the end, with every block's backward between. Its reduce-scatter
members are split where another unit's reduce-scatter comes between two of them in graph order, and
each stretch is a bucket of its own, launched as soon as that stretch exists
(``schedule/reduce_scatter.py``). In such a unit a stretch is split too before a member whose gradient
needs an all-gather that the members before it do not: the head's weight gradient needs only the loss's
gradient and the saved input, the final norm's needs the head's gathered weight, and in one bucket the
head's reduce-scatter would wait for that gather at the start of backward, while the reduce-scatter
link has nothing else to do. A flat marker's gradient is one tensor, never split, so ``fully_shard`` gives
each parameter of a unit that holds others a flat of its own (``flat_shard.py``): its markers have one
piece each.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from ..graph_ops import NAMES_SEP, numel, unflatten_shapes
from ..order import reorder
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
    out, offset = [], 0
    for i, (n, s, full) in enumerate(zip(names, shards, unflatten_shapes(a["ranks"], a["dims"]))):  # type: ignore[arg-type]
        if i in items:
            out.append(_Member(node, grouped, n, tuple(full), numel(s), a["shard"], offset, tuple(s), items[i]))  # type: ignore[arg-type]
        offset += numel(s)
    return out


def _dtype(m: _Member, a: dict[str, object], gather: bool) -> torch.dtype:
    cast_to = a["param_dtype" if gather else "reduce_dtype"]
    return cast_to or m.input.meta["val"].dtype  # type: ignore[return-value]


def _buckets(gm: fx.GraphModule, gather: bool) -> list[tuple[dict[str, object], list[_Member]]]:
    """Each marker's members, one list per bucket: a flat marker's alone, a unit's markers of one piece
    together (per group and dtype), in graph order; reduce-scatters in stretches."""
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
    position = _position(gm)  # (splicing keeps the markers' order)
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
            outs = splice_gather(gm.graph, inputs, before=first, meta=_meta(a, part, "all_gather"), world=world,
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
            pieces.append((inputs, _meta(a, part, "all_gather")))
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
    position = _position(gm)  # (splicing keeps the markers' order)
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
            outs = splice_reduce(gm.graph, [m.input for m in part], before=last, meta=_meta(a, part, "reduce_scatter",
                                 casts), world=world, group=group, sizes=[m.size for m in part],
                                 shapes=[m.shape for m in part], dtype=dtype, replicate_group=str(a["replicate_group"]),
                                 divisor=ranks if ranks > 1 else None, out_dtype=a["out_dtype"],  # type: ignore[arg-type]
                                 elide=elide, whole=whole)
            if whole:
                (results[0],) = outs
            else:
                results.update((id(m), out) for m, out in zip(part, outs))
        if flat:  # the flat's gradient: the bucket's output whole, or the parts' outputs together
            marker = members[0].marker
            grad = results[0] if whole else splice(gm.graph, lambda *gs: [torch.cat([g.reshape(-1) for g in gs])],
                                                   [results[id(m)] for m in members], before=marker)[0]
            marker.replace_all_uses_with(grad)
            gm.graph.erase_node(marker)
            continue
        for m in members:  # (one piece: its gradient in the shard's shape)
            m.marker.replace_all_uses_with(results[id(m)])
            gm.graph.erase_node(m.marker)


def _position(gm: fx.GraphModule) -> Callable[[fx.Node], int]:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


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
    """A piece of a flat shard (``narrow`` and ``view`` of a graph input) that only this collective reads
    gets its annotations: part of its prologue, it moves with it (``schedule/prefetch.py``)."""
    for x in inputs:
        piece = flat_piece(x)
        if piece is None or any(len(n.users) != 1 or n.meta.get("fsdp") for n in piece[3]):
            continue
        for n in piece[3]:
            n.meta["fsdp"] = {k: v for k, v in meta.items() if k in ("kind", "unit", "ag_group", "rs_group")}


def lower_markers_pass(gm: fx.GraphModule, *, elide_single_rank: bool = True, rank_of: Callable[[str], int] | None = None,
                       alone_bytes: int | None = None) -> fx.GraphModule:
    """(NOTE [one lowering]) Every ``fsdp::`` marker of ``gm`` replaced by its bucket's collectives.

    ``elide_single_rank``: a group of one rank gets no collective (``False`` keeps it, to measure its
    cost). ``rank_of(group_name)``: this rank's index in a group; given, a bucket is gathered in place
    (NOTE [in-place all-gather] in ``bucket.py``). ``alone_bytes``: a parameter of at least this full size
    keeps collectives of its own (NOTE [large params alone]); ``None``: every parameter shares its bucket."""
    hoist: dict[fx.Node, fx.Node] = {}
    _lower_gathers(gm, hoist, elide=elide_single_rank, rank_of=rank_of, alone_bytes=alone_bytes)
    _lower_reduces(gm, elide=elide_single_rank, alone_bytes=alone_bytes)
    reorder(gm.graph, before=hoist)
    return gm
