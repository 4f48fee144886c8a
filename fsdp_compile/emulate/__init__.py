"""An emulated world: one process on one GPU plays rank 0 of N, its compute real, its communication timed.

``init_emulated_world`` starts it (NOTE [emulated backend]); ``measure_steps`` times training steps.
"""

from fsdp_compile.emulate.group import BACKEND, EmulatedGroup, Ledger, emulated_topology, init_emulated_world, ledger
from fsdp_compile.emulate.measure import StepReport, measure_steps
from fsdp_compile.emulate.timing import KINDS, EmulatedTopology

__all__ = ["BACKEND", "KINDS", "EmulatedGroup", "EmulatedTopology", "Ledger", "emulated_topology",
           "init_emulated_world", "ledger", "measure_steps", "StepReport"]
