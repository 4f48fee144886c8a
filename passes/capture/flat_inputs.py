"""A flat shard that no collective will read becomes its pieces, one graph input each (NOTE [elided flats]).

NOTE [elided flats]: compiled code reads a unit's parameter ``i`` as a piece of the unit's flat shard,
``flat.narrow(0, offset_i, n_i).view(shape_i)`` (NOTE [flat shards] in
``fsdp_compile/api/flat_shard.py``), so that the all-gather packs the flat in one copy and the
reduce-scatter's output is the flat's gradient. Where the unit's collectives are elided (world size 1),
nothing packs or scatters, and the flat only costs: autograd builds the flat's gradient from the pieces'
gradients, a copy of every gradient per step (docs/performance.md measures it). This pass replaces such
a flat input by one input per piece, in offset order, and each ``view(narrow(flat))`` by its piece's
input. The backend then calls the graph
with the unit's parameters in the flat's place (each is that piece, a view of the flat), and autograd
accumulates each parameter's gradient into its ``.grad`` directly, as for a module that is not sharded.

A flat input read any other way (a narrow that is no piece, a use that is no narrow) is left whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import fx

from .._compat import copy_dynamo_graph, mark_sourceless_input

__all__ = ["Piece", "split_flat_inputs_pass"]

Piece = tuple[int, int, tuple[int, ...]]
"""A piece of a flat shard: ``(offset, numel, shape)``."""


def split_flat_inputs_pass(gm: fx.GraphModule, *, pieces: Mapping[str, Sequence[Piece]]) -> fx.GraphModule:
    """Replace each placeholder named in ``pieces`` (every piece of it, in offset order) by one
    placeholder per piece, where every read of it is ``view(narrow(flat, 0, offset, numel), shape)`` of a
    listed piece. The new placeholders take the old one's place, named ``<old>_piece<i>``. Returns a new
    module (``gm``'s graph, Dynamo's, keeps its placeholders) when a flat is split, else ``gm``."""
    if not any(_reads(ph, pieces[ph.name]) for ph in gm.graph.find_nodes(op="placeholder") if ph.name in pieces):
        return gm
    gm = copy_dynamo_graph(gm)
    for ph in list(gm.graph.find_nodes(op="placeholder")):
        layout = pieces.get(ph.name)
        if layout is None or not ph.users:
            continue
        reads = _reads(ph, layout)
        if reads is None:
            continue
        with gm.graph.inserting_before(ph):
            inputs = [gm.graph.placeholder(f"{ph.name}_piece{i}") for i in range(len(layout))]
        example = ph.meta.get("example_value")
        for node, (offset, n, shape) in zip(inputs, layout):
            mark_sourceless_input(node)
            if example is not None:
                node.meta["example_value"] = example.narrow(0, offset, n).view(shape)
        for view, index in reads:
            view.replace_all_uses_with(inputs[index])
            narrow = view.args[0]
            gm.graph.erase_node(view)
            if not narrow.users:  # type: ignore[union-attr]
                gm.graph.erase_node(narrow)  # type: ignore[arg-type]
        gm.graph.erase_node(ph)
    gm.graph.lint()
    gm.recompile()
    return gm


def _reads(ph: fx.Node, layout: Sequence[Piece]) -> list[tuple[fx.Node, int]] | None:
    """Every ``view`` of a piece of ``ph`` and that piece's index, or ``None`` if ``ph`` is read otherwise."""
    index = {(offset, n): i for i, (offset, n, _) in enumerate(layout)}
    out: list[tuple[fx.Node, int]] = []
    for narrow in ph.users:
        if not (_is_method(narrow, "narrow") and narrow.args[0] is ph and not narrow.kwargs
                and len(narrow.args) == 4 and narrow.args[1] == 0):
            return None
        i = index.get((narrow.args[2], narrow.args[3]))  # type: ignore[index]
        if i is None:
            return None
        for view in narrow.users:
            if not (_is_method(view, "view") and view.args[0] is narrow and _shape(view.args[1:]) == layout[i][2]):
                return None
            out.append((view, i))
    return out


def _is_method(node: fx.Node, name: str) -> bool:
    return node.op == "call_method" and node.target == name


def _shape(args: Sequence[object]) -> tuple[object, ...]:
    """``view``'s shape, given as one sequence or as several ints."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)
