"""How long an emulated collective takes: the hardware model's ring estimate on a world of hosts.

NOTE [emulated time]: one process plays rank 0 of ``world`` ranks laid out ``hosts`` x ``gpus_per_host``
(rank r on host ``r // gpus_per_host``). A collective of ``n`` ranks over a ``full_bytes`` buffer (an
all-gather's output, a reduce-scatter's input) takes, when it runs alone,

    latency + (n - 2) * hop_latency + (n - 1) / n * full_bytes / busbw

with ``busbw`` the intra-host bus bandwidth when the group's ranks share one host and the inter-host
one when they span hosts (a ring is as fast as its slowest link); an all-reduce is twice that, a
broadcast moves the buffer once, a barrier costs the latency. Collectives running at the same time on
different communicators share the rank's links: ``k`` of them each advance at ``min(1, shared / k)``
of their own solo rate, ``shared`` being how many solo collectives' worth of bytes per second the
links carry together. The numbers come from ``Hardware`` (``fsdp_compile.inspection.hardware``) and a
calibration file; ``shared`` from a measurement of an all-gather and a reduce-scatter run together on
two communicators (``benchmarks/calibration/h200x2.json``).

What is not modelled: contention between ranks of a host for NVLink or the NIC beyond the bus
bandwidth, stragglers and jitter, NCCL's algorithm choice (tree, NVLS), and the values of the data: an
emulated collective's output holds rank 0's data in every rank's place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_compile.inspection.hardware import Hardware

__all__ = ["KINDS", "EmulatedTopology"]

# The collective kinds the emulated backend times, and how many passes over the buffer each makes.
KINDS = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0, "broadcast": 1.0,
         "barrier": 0.0}


@dataclass(frozen=True)
class EmulatedTopology:
    """A world of ``world`` ranks on ``hosts`` hosts, timed by ``hardware``.

    ``blocks`` is how many thread blocks an emulated collective holds while it runs (an NCCL kernel
    holds one per channel, and the blocks move the collective's data: 32 move a 1 GiB reduce-scatter of
    world 2 within its time on an H100, 16 do not); ``shared`` is the links' capacity in solo
    collectives (NOTE [emulated time]).
    """

    world: int
    hardware: Hardware
    hosts: int = 1
    blocks: int = 32
    shared: float = 1.27

    def __post_init__(self) -> None:
        if self.world < 1 or self.hosts < 1 or self.world % self.hosts:
            raise ValueError(
                f"EmulatedTopology: world={self.world} on hosts={self.hosts}: the world must be a positive "
                "multiple of the hosts (the same number of GPUs on each host), e.g. world=64, hosts=8."
            )
        if self.blocks < 1 or self.shared < 1.0:
            raise ValueError(
                f"EmulatedTopology: blocks={self.blocks}, shared={self.shared}: a collective holds at least one "
                "block, and concurrent collectives together move at least one collective's bytes per second."
            )

    @property
    def gpus_per_host(self) -> int:
        return self.world // self.hosts

    def spans_hosts(self, ranks: Sequence[int]) -> bool:
        """Whether a group of these global ranks crosses a host boundary."""
        return len({r // self.gpus_per_host for r in ranks}) > 1

    def solo_seconds(self, kind: str, full_bytes: int, ranks: Sequence[int]) -> float:
        """Seconds a ``kind`` collective over ``full_bytes`` among ``ranks`` takes alone on the links."""
        if kind not in KINDS:
            raise ValueError(f"EmulatedTopology: unknown collective kind {kind!r}; expected one of {sorted(KINDS)}")
        n = len(ranks)
        if n <= 1:
            return 0.0
        hw = self.hardware
        latency = hw.collective_latency + (n - 2) * hw.hop_latency
        busbw = hw.inter_node_busbw if self.spans_hosts(ranks) else hw.intra_node_busbw
        if kind == "barrier":
            return latency
        if kind == "broadcast":
            return latency + full_bytes / busbw
        return KINDS[kind] * (latency + (n - 1) / n * full_bytes / busbw)

    def describe(self) -> str:
        hw = self.hardware
        return (f"world {self.world} = {self.hosts} host(s) x {self.gpus_per_host} GPUs, {hw.name}: busbw "
                f"{hw.intra_node_busbw / 1e9:.0f} GB/s within a host, {hw.inter_node_busbw / 1e9:.0f} GB/s across, "
                f"latency {hw.collective_latency * 1e6:.0f} us + {hw.hop_latency * 1e6:.1f} us per hop; "
                f"a collective holds {self.blocks} thread blocks; concurrent ones share {self.shared:.2f}x one's bandwidth")
