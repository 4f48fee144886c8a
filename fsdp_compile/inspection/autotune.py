"""``"auto"`` settings: pick the prefetch depth, then the reduce-scatter cap, with the cost model.

Each candidate is scheduled on a copy of the bucketed graph by the caller's ``schedule`` and simulated; the
winner is the *smallest* setting within ``tolerance`` of the best time, as larger ones hold more memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx

from fsdp_compile.passes.collective_regions import regions

from fsdp_compile.inspection.cost import Hardware
from fsdp_compile.inspection.timeline import simulate

__all__ = ["Choice", "choose"]

DEPTHS = (0, 1, 2, 3)
CAP_BUCKETS = (1, 2, 3, 4)  # reduce-scatter caps, in largest buckets; None (no cap) is tried last


@dataclass(frozen=True)
class Choice:
    prefetch: int
    reduce_scatter_bytes: int | str | None


Schedule = Callable[[fx.GraphModule, Choice], fx.GraphModule]


def _time(gm: fx.GraphModule, hw: Hardware, schedule: Schedule, depth: int, cap: int | str | None) -> float:
    return simulate(schedule(copy.deepcopy(gm), Choice(prefetch=depth, reduce_scatter_bytes=cap)), hw).step_seconds


def _smallest_near_best(times: Sequence[tuple[object, float]], tolerance: float) -> object:
    best = min(t for _, t in times)
    return next(option for option, t in times if t <= best * (1 + tolerance))


def choose(
    gm: fx.GraphModule,
    hw: Hardware,
    *,
    prefetch: int | str,
    reduce_scatter_bytes: int | str | None,
    schedule: Schedule,
    tolerance: float = 0.005,
) -> Choice:
    """Resolve ``"auto"`` in ``prefetch`` and ``reduce_scatter_bytes`` for ``gm`` on ``hw``."""
    depth = prefetch
    if depth == "auto":
        times = [(d, _time(gm, hw, schedule, d, "auto")) for d in DEPTHS]
        depth = _smallest_near_best(times, tolerance)  # type: ignore[assignment]
    cap = reduce_scatter_bytes
    scatters = regions(gm, "reduce_scatter")
    if cap == "auto" and scatters:
        largest = max(r.in_bytes for r in scatters)
        options: list[int | None] = [k * largest for k in CAP_BUCKETS] + [None]
        times = [(c, _time(gm, hw, schedule, depth, c)) for c in options]  # type: ignore[arg-type]
        cap = _smallest_near_best(times, tolerance)  # type: ignore[assignment]
    return Choice(prefetch=depth, reduce_scatter_bytes=cap)  # type: ignore[arg-type]
