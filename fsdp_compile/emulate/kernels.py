"""The GPU kernels an emulated collective runs: a clock stamp before its data moves, a hold after.

NOTE [emulated kernel]: on the communicator's stream a collective is three launches:

1. ``emulated_stamp`` (one program) adds one to the count of collectives running on this GPU (a device
   counter shared by every communicator) and writes the GPU's clock (``%globaltimer``, ns) into the
   communicator's start slot.
2. The data moves through device memory as a rank's NCCL kernel would move it, with torch's own copy and
   reduction kernels at full device bandwidth: an all-gather writes its whole output from its input (the
   input repeated: rank 0's data in every rank's place); a reduce-scatter reads its whole input and writes
   the sum (or mean) of its chunks. The collective's few thread blocks could not draw that bandwidth.
3. The kind's kernel (``emulated_all_gather`` ...) with ``blocks`` programs: block 0 advances the
   collective's progress with the clock from the stamp, at ``min(1, shared / k)`` of its solo rate while
   ``k`` collectives run (NOTE [emulated time]), until the progress reaches its solo time; it takes one off
   the count and writes the collective's token into the communicator's flag. The other blocks spin until
   the flag holds the token, so the launch holds ``blocks`` thread blocks, as NCCL's kernels hold their
   channels' SMs.

The collective ends when both its data has moved and its time is up. Traces show the copies on the
communicator's stream before the kind's kernel; ``measure.timeline_of_trace`` counts them as the
collective's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["stamp", "hold", "RATE_ONE"]

RATE_ONE = 1024  # progress rate of a collective running alone, in fixed point
# Integer arguments compiled as values, not specialised (a token or a count of 1 is not a constant).
_PLAIN_INTS = ["token", "solo_ns", "shared_q"]


@triton.jit
def _clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def emulated_stamp(active, slot):
    tl.atomic_add(active, 1)
    tl.store(slot, _clock_ns())


@triton.jit
def _hold(active, flag, slot, token, solo_ns, shared_q):
    if tl.program_id(0) == 0:
        target = solo_ns.to(tl.int64) * 1024
        progress = tl.full([], 0, tl.int64)
        before = tl.load(slot, volatile=True)
        while progress < target:
            now = _clock_ns()
            running = tl.atomic_add(active, 0)
            rate = tl.minimum(shared_q // tl.maximum(running, 1), 1024)
            progress += (now - before) * rate
            before = now
        tl.atomic_add(active, -1)
        tl.atomic_xchg(flag, token)
    else:
        seen = tl.load(flag, volatile=True)
        while seen != token:
            seen = tl.load(flag, volatile=True)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_all_gather(active, flag, slot, token, solo_ns, shared_q):
    _hold(active, flag, slot, token, solo_ns, shared_q)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_reduce_scatter(active, flag, slot, token, solo_ns, shared_q):
    _hold(active, flag, slot, token, solo_ns, shared_q)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_all_reduce(active, flag, slot, token, solo_ns, shared_q):
    _hold(active, flag, slot, token, solo_ns, shared_q)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_other(active, flag, slot, token, solo_ns, shared_q):
    _hold(active, flag, slot, token, solo_ns, shared_q)


_KERNELS = {"all_gather": emulated_all_gather, "reduce_scatter": emulated_reduce_scatter,
            "all_reduce": emulated_all_reduce}


def stamp(active: torch.Tensor, slot: torch.Tensor) -> None:
    """Step 1 of NOTE [emulated kernel] on the current stream: count the collective in, note its start."""
    emulated_stamp[(1,)](active, slot, num_warps=1)


def hold(kind: str, *, active: torch.Tensor, flag: torch.Tensor, slot: torch.Tensor, token: int, solo_ns: int,
         shared: float, blocks: int) -> None:
    """Step 3 of NOTE [emulated kernel] on the current stream: hold ``blocks`` thread blocks until the
    collective's time since ``slot``'s stamp is up, then write ``token`` into ``flag``.

    ``active`` is the GPU's int64 counter of running collectives, ``flag`` and ``slot`` the communicator's.
    """
    kernel = _KERNELS.get(kind, emulated_other)
    kernel[(blocks,)](active, flag, slot, token, int(solo_ns), int(round(shared * RATE_ONE)), num_warps=1)
