"""Prefetch all-gathers: issue unit k+d's all-gather before unit k's compute, wait just before use.

Units are taken in the order of their gathered parameters' first use (forward order in the forward graph,
reverse in the backward), and depth counts *groups*: runs of one unit's consecutive all-gathers (NOTE
[large params alone] in ``lower/markers.py``); a unit used in two places is two groups::

    before:  [AG0 wait0] use0 ... [AG1 wait1] use1 ... [AG2 wait2] use2
    depth 1: AG0 AG1 wait0 use0 ... AG2 wait1 use1 ... wait2 use2

The first ``depth`` groups launch before the graph's first compute (a backward begins with work that
needs no gathered parameter, such as the output head's weight gradient). ``max_bytes`` caps the bytes
gathered but not yet used: a group that would pass it gets a smaller depth, down to 0 (where a bucket
larger than the cap runs). Launches keep the order of first use: none queues behind one needed later.
"""

from __future__ import annotations

from torch import fx

from ..collective_regions import Region, regions
from ..order import place, positions, reorder

__all__ = ["prefetch_pass"]


def prefetch_pass(gm: fx.GraphModule, *, depth: int = 1, max_bytes: int | None = None) -> fx.GraphModule:
    """Move each all-gather region's launch ``depth`` units ahead of its first use (see module doc)."""
    if depth < 0:
        raise ValueError(f"prefetch_pass: depth must be >= 0, got {depth}")
    gathers = [r for r in regions(gm, "all_gather") if r.users]
    if not gathers:
        return gm
    index = positions(gm.graph)
    first_use = {id(r): min(index[u] for u in r.users) for r in gathers}
    order: list[list[Region]] = []  # groups: runs of one unit's all-gathers, by first use
    for r in sorted(gathers, key=lambda r: first_use[id(r)]):
        if order and order[-1][0].unit == r.unit:
            order[-1].append(r)
        else:
            order.append([r])
    keys: dict[fx.Node, float] = {}
    cap = max_bytes if max_bytes is not None else float("inf")
    last_target = -1.0
    k = 0
    for i, group in enumerate(order):
        d = min(depth, i + 1)  # i + 1: before the graph's first compute
        # Output bytes gathered and not yet used if group i is issued d groups early.
        while d > 0 and sum(r.out_bytes for g in order[i - min(d, i): i + 1] for r in g) > cap:
            d -= 1
        # Before the compute of the group d places earlier, never before an earlier group's launch.
        target = -1.0 if d > i else max(first_use[id(order[i - d][0])], last_target)
        last_target = target
        for r in group:
            # Launches keep first-use order within (target - 0.5, target - 0.4).
            place(keys, [*r.prologue, r.launch], target - 0.5 + 0.1 * k / len(gathers))
            place(keys, [r.wait, *r.epilogue], first_use[id(r)] - 0.25)
            k += 1
    reorder(gm.graph, keys)
    return gm
