"""Prefetch all-gathers: issue unit k+d's all-gather before unit k's compute, wait just before use.

Units are taken in the order their gathered params are first used, which is forward order in the
forward graph and reverse order in the backward graph, so one rule serves both. A unit with several
all-gathers (NOTE [large params alone] in ``lower/markers.py``) moves them together: depth counts *groups*,
each a run of consecutive all-gathers (by first use) of one unit, so a unit used in two places (a root
holding the embedding and the output head) is gathered in two groups, each as late as its use allows::

    before:  [AG0 wait0] use0 ... [AG1 wait1] use1 ... [AG2 wait2] use2
    depth 1: AG0 AG1 wait0 use0 ... AG2 wait1 use1 ... wait2 use2

The first ``depth`` groups have no group that far ahead of them: they launch before the graph's first
compute, which they then run under. A backward's first group is the one this matters for: its graph
begins with work that reads no gathered parameter (an output head's weight gradient is the incoming
gradient times saved activations), as long as the all-gather that the rest of it waits for.

``max_bytes`` caps the bytes gathered but not yet used (all-gather outputs issued whose first use has
not come): a unit that would pass it is issued later (smaller depth for that unit), never earlier
than depth 0. A single bucket larger than the cap still runs, at depth 0. Launches keep the order of
first use, so on one communicator no all-gather queues behind one needed later.
"""

from __future__ import annotations

from torch import fx

from ..collective_regions import Region, regions
from ..order import positions, reorder

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
        d = min(depth, i + 1)  # d = i + 1: ahead of every group, before the graph's first compute
        while d > 0 and _in_flight(order, i, min(d, i)) > cap:
            d -= 1
        # Before the compute of the group d places earlier; never before an earlier group's launch.
        target = -1.0 if d > i else max(first_use[id(order[i - d][0])], last_target)
        last_target = target
        for r in group:
            # Launches keep first-use order within (target - 0.5, target - 0.4), however many regions.
            _place(keys, [*r.prologue, r.launch], target - 0.5 + 0.1 * k / len(gathers))
            _place(keys, [r.wait, *r.epilogue], first_use[id(r)] - 0.25)
            k += 1
    reorder(gm.graph, keys)
    return gm


def _in_flight(order: list[list[Region]], i: int, d: int) -> int:
    """Output bytes gathered and not yet used when group ``i`` is issued ``d`` groups early."""
    return sum(r.out_bytes for group in order[i - d: i + 1] for r in group)


def _place(keys: dict[fx.Node, float], nodes: list[fx.Node], key: float) -> None:
    for j, n in enumerate(nodes):
        keys[n] = key + j * 1e-6
