"""Reduce-scatter scheduling: launch as soon as a unit's gradients exist, wait as late as memory allows.

``schedule="eager"``: each reduce-scatter region's pack and launch go right after the last node producing
one of its gradients; the remaining waits (and unpacks) sink together to just before the outputs::

    grads of unit 2 -> RS2 | grads of unit 1 -> RS1 | grads of unit 0 -> RS0 | wait2 wait1 wait0 -> outputs

An unwaited reduce-scatter keeps its input, a full-size gradient bucket, alive: ``max_bytes`` caps the
input bytes in flight by pulling in the oldest waits before a launch's pack (a bucket larger than the cap
runs alone); ``"auto"`` keeps one unit in flight (NOTE [one unit in flight]). HSDP: a unit's all-reduce
across replicas launches right after its reduce-scatter's wait, pulled in before the next launch; the
all-reduce waits sink to the end.

``schedule="delayed"`` (for one communicator): a unit's reduce-scatter waits for the next unit's backward
to begin (the first use of the next all-gather's parameters), as eager FSDP's pre-backward hook flushes
pending reductions; the last one goes to the end. Waits are placed as in ``"eager"``.
"""

from __future__ import annotations

from torch import fx

from ..collective_regions import Region, regions
from ..order import place, positions, reorder

__all__ = ["reduce_scatter_pass"]

SCHEDULES = ("eager", "delayed")


def reduce_scatter_pass(gm: fx.GraphModule, *, schedule: str = "eager",
                        max_bytes: int | str | None = "auto") -> fx.GraphModule:
    """Place reduce-scatter launches and waits (see module doc). ``max_bytes``: the cap on input bytes in
    flight, ``None`` for none, ``"auto"`` for one unit's reduce-scatters at a time.

    NOTE [one unit in flight]: the reduce-scatters share one communicator, which runs one at a time, so a
    second unit's bucket queued behind the first moves no byte sooner and only stays allocated. Waiting for
    unit k's reduce-scatter just before unit k-1's pack keeps the link as busy and holds one bucket, as
    FSDP2 does. A bytes cap instead lets a large last unit (embedding and head) launch with several block
    buckets alive, at the end of backward where memory peaks.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"reduce_scatter_pass: schedule must be one of {SCHEDULES}, got {schedule!r}")
    scatters = regions(gm, "reduce_scatter")
    if not scatters:
        return gm
    one_unit = max_bytes == "auto"
    if isinstance(max_bytes, str) and not one_unit:
        raise ValueError(f"reduce_scatter_pass: max_bytes must be an int, None or 'auto', got {max_bytes!r}")
    index = positions(gm.graph)
    end = float(len(index))
    ready = {id(r): max((index[i] for i in r.inputs), default=0) for r in scatters}
    gather_uses = sorted((min(index[u] for u in r.users), r.unit) for r in regions(gm, "all_gather") if r.users)
    follow_up = _replica_follow_ups(scatters, regions(gm, "all_reduce"))
    order = sorted(scatters, key=lambda r: ready[id(r)])
    keys: dict[fx.Node, float] = {}
    in_flight: list[Region] = []  # launched, not waited, in launch order
    replicating: list[Region] = []  # HSDP all-reduces launched, not waited
    cap = float("inf") if max_bytes is None or one_unit else max_bytes

    def over_cap(r: Region) -> bool:
        if one_unit:
            return in_flight[0].unit != r.unit
        return sum(x.in_bytes for x in in_flight) + r.in_bytes > cap

    def retire(r: Region, at: float) -> None:
        place(keys, [r.wait, *r.epilogue], at)
        if id(r) in follow_up:  # HSDP: the all-reduce across replicas goes right after
            ar = follow_up[id(r)]
            place(keys, [*ar.prologue, ar.launch], at + 0.05)
            replicating.append(ar)

    for i, r in enumerate(order):
        launch_at = ready[id(r)] + 0.5
        if schedule == "delayed":
            later = [p for p, unit in gather_uses if p > ready[id(r)] and unit != r.unit]
            launch_at = later[0] - 0.1 if later else end - 0.5
        launch_at += 0.05 * i / len(order)  # launch order = readiness order
        # Pull in the oldest waits while over the cap, and (HSDP) every wait an all-reduce follows.
        while in_flight and (over_cap(r) or id(in_flight[0]) in follow_up):
            retire(in_flight.pop(0), launch_at - 0.25)
        place(keys, [*r.prologue, r.launch], launch_at)
        in_flight.append(r)
    # The rest wait right before the outputs: every wait, then every unpack.
    for j, r in enumerate(in_flight):
        keys[r.wait] = end + j * 1e-3
        if id(r) in follow_up:
            retire(r, end + j * 1e-3)
        else:
            place(keys, r.epilogue, end + 1 + j * 1e-3)
    for j, ar in enumerate(replicating):
        keys[ar.wait] = end + 2 + j * 1e-3
        place(keys, ar.epilogue, end + 3 + j * 1e-3)
    reorder(gm.graph, keys)
    return gm


def _replica_follow_ups(scatters: list[Region], replicas: list[Region]) -> dict[int, Region]:
    """HSDP: for each reduce-scatter region, the all-reduce region that reads its result."""
    owner = {n: r for r in scatters for n in [r.wait, *r.epilogue]}
    return {id(owner[i]): ar for ar in replicas for i in ar.inputs if i in owner}
