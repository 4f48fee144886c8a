"""How long an emulated collective takes: the hardware model's estimate on a world of hosts.

NOTE [emulated time]: rank r of ``world`` sits on host ``r // gpus_per_host``, and a collective takes what NOTE
[collective time] (the model ``explain`` uses too) says: alone, the ring time of its group on the slowest link
it crosses; beside ``k - 1`` collectives of other communicators, ``min(1, shared / k)`` of its solo rate. Not
modelled besides: jitter, and the data's values (every rank's place holds rank 0's).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_compile.inspection.topology import COLLECTIVE_PASSES, Topology

__all__ = ["KINDS", "EmulatedTopology"]

KINDS = COLLECTIVE_PASSES


@dataclass(frozen=True)
class EmulatedTopology(Topology):
    """A ``Topology`` plus ``blocks``: the thread blocks an emulated collective holds, and which move its data,
    while it runs (an NCCL kernel holds one per channel); ``shared``: see NOTE [collective time]."""

    blocks: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.blocks < 1:
            raise ValueError(f"EmulatedTopology: blocks={self.blocks}: a collective holds at least one thread block.")

    def describe(self) -> str:
        hw = self.hardware
        return (f"world {self.world} = {self.hosts} host(s) x {self.gpus_per_host} GPUs, {hw.name}: busbw "
                f"{hw.intra_node_busbw / 1e9:.0f} GB/s within a host, {hw.inter_node_busbw / 1e9:.0f} GB/s across, "
                f"latency {hw.collective_latency * 1e6:.0f} us + {hw.hop_latency * 1e6:.1f} us per hop; "
                f"a collective holds {self.blocks} thread blocks; "
                f"concurrent ones share {self.shared:.2f}x one's bandwidth")
