"""A collective with the nodes that exist only for it (tagged ``meta["fsdp"]`` with its kind and unit)::

    prologue (cast, flatten, pad, pack) -> launch -> wait -> epilogue (copy-out, narrow, div, view)

Scheduling passes move the prologue with the launch and the epilogue with the wait. The prologue also
holds the untagged views that only it reads (a weight gradient's ``t()`` may come after later compute).
``inputs``: the other nodes the prologue reads; ``users``: the untagged nodes that read the epilogue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import fx

from .order import positions
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
        return tensor_bytes(self.launch.args[0])  # type: ignore[arg-type]

    @property
    def out_bytes(self) -> int:
        return tensor_bytes(self.wait)

    @property
    def nodes(self) -> list[fx.Node]:
        return [*self.prologue, self.launch, self.wait, *self.epilogue]


def _tagged_closure(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]], kind: object,
                    unit: object) -> set[fx.Node]:
    """The nodes tagged (kind, unit) reachable from ``start`` through such nodes."""
    found: set[fx.Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        meta = n.meta.get("fsdp")
        if (n not in found and n.op == "call_function" and meta and meta.get("kind") == kind
                and meta.get("unit") == unit and not is_collective(n)):
            found.add(n)
            stack.extend(step(n))
    return found


def _views_only_read_by(nodes: set[fx.Node]) -> set[fx.Node]:
    """The untagged one-input views whose every user is in ``nodes`` or among them."""
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
    return Region(launch, wait, sorted(prologue, key=order), sorted(epilogue, key=order),
                  sorted(inputs, key=order), sorted(users, key=order))


def regions(gm: fx.GraphModule, kind: str | None = None) -> list[Region]:
    """Every collective region in ``gm`` (of one ``kind``, if given), in launch order."""
    index = positions(gm.graph)
    out = [_region(n, index) for n in gm.graph.nodes if is_collective(n)]
    return [r for r in out if kind is None or r.kind == kind]
