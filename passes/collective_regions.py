"""A collective with the nodes that exist only for it: pack before, unpack after.

The lowering and bucketing passes tag every node they insert with ``meta["fsdp"]`` (kind, unit). A
*region* is one launch plus its wait and the tagged nodes around them::

    prologue (cast, flatten, pad, cat) -> launch -> wait -> epilogue (split, copy-out, narrow, div, view)

Scheduling passes move regions as wholes: the prologue and launch together, the wait and epilogue
together. The prologue also holds the views (``view``, ``permute``, ``t``...) that only it reads: they
compute nothing, and a gradient's collective is ready when the gradient is computed, not where the
graph put its transpose (AOTAutograd may emit a weight gradient's ``t()`` after later compute).
``inputs`` are the other nodes the prologue reads (shards, or the gradients computed in backward);
``users`` are the untagged nodes that read the epilogue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import fx

from .predicates import VIEW_OPS, collective_kind, fsdp_meta, is_collective, tensor_bytes, wait_of

__all__ = ["Region", "regions"]


@dataclass(eq=False)
class Region:
    launch: fx.Node
    wait: fx.Node
    prologue: list[fx.Node]  # graph order
    epilogue: list[fx.Node]  # graph order
    inputs: list[fx.Node]
    users: list[fx.Node]

    @property
    def kind(self) -> str:
        return collective_kind(self.launch)

    @property
    def unit(self) -> object:
        return fsdp_meta(self.launch).get("unit")

    @property
    def group(self) -> str:
        return str(self.launch.args[-1])

    @property
    def in_bytes(self) -> int:
        """Bytes of the collective's input (kept alive until its wait)."""
        return tensor_bytes(self.launch.args[0])  # type: ignore[arg-type]

    @property
    def out_bytes(self) -> int:
        """Bytes of the collective's output."""
        return tensor_bytes(self.wait)

    @property
    def nodes(self) -> list[fx.Node]:
        return [*self.prologue, self.launch, self.wait, *self.epilogue]


def _same(node: fx.Node, kind: object, unit: object) -> bool:
    meta = node.meta.get("fsdp")
    return bool(meta) and meta.get("kind") == kind and meta.get("unit") == unit and not is_collective(node)


def _tagged_closure(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]], kind: object,
                    unit: object) -> set[fx.Node]:
    """The nodes tagged for (kind, unit) reachable from ``start`` through tagged nodes only."""
    found: set[fx.Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if n not in found and n.op == "call_function" and _same(n, kind, unit):
            found.add(n)
            stack.extend(step(n))
    return found


def _views_only_read_by(nodes: set[fx.Node]) -> set[fx.Node]:
    """The chains of untagged views, of one input each, whose every user is in ``nodes`` or the chain."""
    found: set[fx.Node] = set()
    stack = [i for n in nodes for i in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if (n in found or n in nodes or n.op != "call_function" or n.target not in VIEW_OPS
                or n.meta.get("fsdp", {}).get("kind") or len(n.all_input_nodes) != 1
                or any(u not in nodes and u not in found for u in n.users)):
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def _region(launch: fx.Node, index: dict[fx.Node, int]) -> Region:
    meta = fsdp_meta(launch)
    kind, unit = meta.get("kind"), meta.get("unit")
    wait = wait_of(launch)
    prologue = _tagged_closure(launch.all_input_nodes, lambda n: n.all_input_nodes, kind, unit)
    prologue |= _views_only_read_by(prologue | {launch})
    epilogue = _tagged_closure(wait.users, lambda n: n.users, kind, unit)
    inside = prologue | epilogue | {launch, wait}
    inputs = {i for n in [*prologue, launch] for i in n.all_input_nodes if i not in inside}
    users = {u for n in [wait, *epilogue] for u in n.users if u not in inside}
    order = index.__getitem__
    return Region(
        launch=launch,
        wait=wait,
        prologue=sorted(prologue, key=order),
        epilogue=sorted(epilogue, key=order),
        inputs=sorted(inputs, key=order),
        users=sorted(users, key=order),
    )


def regions(gm: fx.GraphModule, kind: str | None = None) -> list[Region]:
    """Every collective region in ``gm`` (of one ``kind``, if given), in launch order."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = [_region(n, index) for n in gm.graph.nodes if is_collective(n)]
    return [r for r in out if kind is None or r.kind == kind]
