"""How long an emulated collective takes: the hardware model's estimate on a world of hosts.

NOTE [emulated time]: one process plays rank 0 of ``world`` ranks laid out ``hosts`` x ``gpus_per_host``
(rank r on host ``r // gpus_per_host``), and each collective takes what NOTE [collective time]
(``fsdp_compile/inspection/topology.py``, the model ``explain`` uses too) says: alone, the ring time of
its group on the slowest link the group crosses; beside ``k - 1`` collectives of other communicators,
``min(1, shared / k)`` of its solo rate. The numbers come from ``Hardware``
(``fsdp_compile.inspection.hardware``) and a calibration file.

Not modelled beyond NOTE [collective time]'s list: jitter, and the values of the data: an emulated
collective's output holds rank 0's data in every rank's place.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_compile.inspection.topology import COLLECTIVE_PASSES, Topology

__all__ = ["KINDS", "EmulatedTopology"]

# The collective kinds the emulated backend times.
KINDS = COLLECTIVE_PASSES


@dataclass(frozen=True)
class EmulatedTopology(Topology):
    """A world of ``world`` ranks on ``hosts`` hosts, timed by ``hardware`` (``Topology``), and how an
    emulated collective runs on the GPU.

    ``blocks`` is how many thread blocks an emulated collective holds while it runs (an NCCL kernel
    holds one per channel, and the blocks move the collective's data: 32 move a 1 GiB reduce-scatter of
    world 2 within its time on an H100, 16 do not); ``shared`` is the links' capacity in solo
    collectives (NOTE [collective time]).
    """

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
                f"a collective holds {self.blocks} thread blocks; concurrent ones share {self.shared:.2f}x one's bandwidth")
