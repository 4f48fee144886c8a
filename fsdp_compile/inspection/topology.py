"""How long collectives take on a world of hosts, alone and side by side (``timeline.simulate`` and
``fsdp_compile.emulate`` share it).

NOTE [collective time]: ``world`` ranks sit ``gpus_per_host`` to a host (rank r on host
``r // gpus_per_host``). A collective of ``n`` ranks over a ``full_bytes`` buffer (an all-gather's output,
a reduce-scatter's input) takes alone

    latency + (n - 2) * hop_latency + (n - 1) / n * full_bytes / busbw

with ``busbw`` the intra-host bandwidth, or the inter-host one when its ranks span hosts; an all-reduce
takes twice that, a broadcast moves the buffer once, a barrier costs the latency. ``k`` collectives running
at once on different communicators each advance at ``min(1, shared / k)`` of their solo rate
(``SHARED_LINKS``: measured with an all-gather and a reduce-scatter on two communicators, docs/performance.md).
One communicator runs its collectives one at a time, in issue order. Not modelled: contention for NVLink
or the NIC beyond the bus bandwidth, NCCL's algorithm choice, stragglers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from fsdp_compile.inspection.hardware import Hardware

__all__ = ["COLLECTIVE_PASSES", "SHARED_LINKS", "Links", "Topology", "ring_seconds"]

# Passes over the buffer each kind makes (an all-reduce is a reduce-scatter and an all-gather).
COLLECTIVE_PASSES = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0,
                     "broadcast": 1.0, "barrier": 0.0}
SHARED_LINKS = 1.27  # (solo time of both) / (time of both together), NOTE [collective time]


def ring_seconds(kind: str, full_bytes: int, n: int, hw: Hardware, *, spans_hosts: bool) -> float:
    """Seconds one ``kind`` collective over ``full_bytes`` among ``n`` ranks takes alone
    (NOTE [collective time]); ``spans_hosts``: whether its ranks sit on more than one host."""
    if kind not in COLLECTIVE_PASSES:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(COLLECTIVE_PASSES)}")
    if n <= 1:
        return 0.0
    latency = hw.collective_latency + (n - 2) * hw.hop_latency
    busbw = hw.inter_node_busbw if spans_hosts else hw.intra_node_busbw
    if kind == "barrier":
        return latency
    if kind == "broadcast":
        return latency + full_bytes / busbw
    return COLLECTIVE_PASSES[kind] * (latency + (n - 1) / n * full_bytes / busbw)


@dataclass(frozen=True)
class Topology:
    """``world`` ranks on ``hosts`` hosts of ``hardware``, concurrent collectives sharing ``shared`` solo
    collectives' worth of bandwidth (NOTE [collective time])."""

    world: int
    hardware: Hardware
    hosts: int = 1
    shared: float = SHARED_LINKS

    def __post_init__(self) -> None:
        if self.world < 1 or self.hosts < 1 or self.world % self.hosts:
            raise ValueError(
                f"{type(self).__name__}: world={self.world} on hosts={self.hosts}: the world must be a positive "
                "multiple of the hosts (the same number of GPUs on each host), e.g. world=64, hosts=8."
            )
        if self.shared < 1.0:
            raise ValueError(f"{type(self).__name__}: shared={self.shared}: concurrent collectives together move at "
                             "least one collective's bytes per second; use shared >= 1.")

    @classmethod
    def of(cls, world: int, hardware: Hardware, hosts: int | None = None) -> Topology:
        """``world`` ranks on ``hosts`` hosts; by default the fewest hosts of at most
        ``hardware.ranks_per_node`` GPUs that divide the world evenly."""
        if hosts is None:
            fewest = max(1, math.ceil(world / hardware.ranks_per_node))
            hosts = next(h for h in range(fewest, max(world, 1) + 1) if world % h == 0)
        return cls(world, hardware, hosts=hosts)

    @property
    def gpus_per_host(self) -> int:
        return self.world // self.hosts

    def spans_hosts(self, ranks: Sequence[int]) -> bool:
        """Whether a group of these global ranks crosses a host boundary."""
        return len({r // self.gpus_per_host for r in ranks}) > 1

    def solo_seconds(self, kind: str, full_bytes: int, ranks: Sequence[int]) -> float:
        """Seconds a ``kind`` collective over ``full_bytes`` among ``ranks`` takes alone on the links."""
        return ring_seconds(kind, full_bytes, len(ranks), self.hardware, spans_hosts=self.spans_hosts(ranks))


class Links:
    """Collectives issued in time order on communicators that share one rank's links
    (NOTE [collective time])."""

    def __init__(self, shared: float = SHARED_LINKS) -> None:
        self.shared = shared
        self.now = 0.0
        self._queues: dict[str, list[list[object]]] = {}  # communicator -> [[key, solo seconds left]], head running
        self._start: dict[Hashable, float] = {}
        self._end: dict[Hashable, float] = {}
        self._plan: dict[Hashable, tuple[float, float]] | None = None  # pending ones, if nothing more is issued

    def issue(self, key: Hashable, communicator: str, solo: float, at: float) -> None:
        """Queue collective ``key`` of ``solo`` seconds alone on ``communicator`` at time ``at``."""
        if at < self.now:
            raise ValueError(f"Links.issue: {key!r} issued at {at}, before the last event at {self.now}; issue in "
                             "time order.")
        self._run(at)
        queue = self._queues.setdefault(communicator, [])
        queue.append([key, max(solo, 0.0)])
        if len(queue) == 1:
            self._start[key] = at
        self._plan = None

    def interval(self, key: Hashable) -> tuple[float, float]:
        """When ``key`` starts and ends, if nothing more is issued before it ends."""
        if key in self._end:
            return self._start[key], self._end[key]
        return self.pending()[key]

    def pending(self) -> dict[Hashable, tuple[float, float]]:
        """``(start, end)`` of every collective not yet ended, if nothing more is issued."""
        if self._plan is None:
            ahead = Links(self.shared)
            ahead.now = self.now
            ahead._queues = {c: [list(item) for item in q] for c, q in self._queues.items()}
            ahead._start = {item[0]: self._start[item[0]] for q in self._queues.values() for item in q[:1]}
            ahead._run(math.inf)
            self._plan = {k: (ahead._start[k], end) for k, end in ahead._end.items()}
        return self._plan

    def _run(self, until: float) -> None:
        """Advance to ``until`` (``inf``: until every queue is empty)."""
        while True:
            running = [q[0] for q in self._queues.values() if q]
            if not running:
                self.now = max(self.now, until) if until < math.inf else self.now
                return
            if self.now >= until:
                return
            rate = min(1.0, self.shared / len(running))
            step = min(min(float(left) for _, left in running) / rate, until - self.now)  # type: ignore[arg-type]
            self.now += step
            for q in self._queues.values():
                if not q:
                    continue
                q[0][1] = float(q[0][1]) - step * rate  # type: ignore[arg-type]
                if float(q[0][1]) <= 1e-12 * max(step, 1.0):  # type: ignore[arg-type]
                    self._end[q.pop(0)[0]] = self.now
                    if q:
                        self._start[q[0][0]] = self.now
