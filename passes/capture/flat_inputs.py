"""A flat shard that no collective will read becomes its pieces, one graph input each.

NOTE [elided flats]: compiled code reads a unit's parameter as ``flat.narrow(0, offset, n).view(shape)``
(NOTE [flat shards] in ``fsdp_compile/api/flat_shard.py``). Where the unit's collectives are elided (world
size 1) the flat only costs a copy of every gradient into the flat's. So such a flat input becomes one
input per piece, in offset order, which the backend passes the parameters for: autograd accumulates
their ``.grad`` directly. A flat read any other way is left whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import fx

from .._compat import copy_dynamo_graph, mark_sourceless_input

__all__ = ["Piece", "split_flat_inputs_pass"]

Piece = tuple[int, int, tuple[int, ...]]  # a piece of a flat shard: (offset, numel, shape)


def split_flat_inputs_pass(gm: fx.GraphModule, *, pieces: Mapping[str, Sequence[Piece]]) -> fx.GraphModule:
    """(NOTE [elided flats]) Replace each placeholder named in ``pieces`` (all its pieces, in offset order)
    and read only as listed pieces by a placeholder ``<old>_piece<i>`` per piece, in a copy of ``gm``."""
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
    """``ph -> narrow(0, offset, n) -> view(shape)``: each view and its piece's index, else ``None``."""
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
    """``view``'s shape, given as one sequence or several ints."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)
