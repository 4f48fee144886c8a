"""The GPU kernel an emulated collective runs: its own thread blocks move the data and hold for its time.

NOTE [emulated kernel]: a collective is one launch of ``blocks`` programs on the communicator's stream, as an
NCCL collective is one kernel of one thread block per channel. Program 0 reads the clock (``%globaltimer``) and
increments the GPU's count of running collectives. Every program moves its share of the data, as NCCL's kernel
would on its own SMs (all-gather: the input repeated into the output; reduce-scatter: the scaled sum of the
input's chunks; all-reduce: the buffer scaled in place), leaving the other SMs to compute. Program 0 then
advances the progress at ``min(1, shared / k)`` of the solo rate while ``k`` collectives run (NOTE [emulated
time]) until it reaches the solo time, decrements the count and writes the token into the communicator's flag;
the other programs spin on the flag, so the launch holds its blocks for the collective's whole time. Forms with
lists of tensors move them with torch ops before the kernel (``move=None``); ``measure.timeline_of_trace``
counts those copies as the collective's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["hold", "RATE_ONE"]

RATE_ONE = 1024  # progress rate of a collective running alone, in fixed point
_WARPS, _BLOCK = 16, 16384  # per program: enough loads in flight to draw on the memory bandwidth
_GATHER, _REDUCE, _SCALE, _NONE = 0, 1, 2, 3
# Not specialised (a token or count of 1 is no constant); the chunk size ``m`` is, so aligned loads vectorise.
_PLAIN_INTS = ["n", "token", "solo_ns", "shared_q"]


@triton.jit
def _clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _move(src, dst, m, n, scale, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's share of the data: ``m`` elements per rank's chunk, ``n`` chunks."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    if MODE == 0:  # all-gather: dst[i * m + j] = src[j]
        for i in range(n):
            for s in range(first, m, step):
                o = s + lanes
                tl.store(dst + i.to(tl.int64) * m + o, tl.load(src + o, mask=o < m), mask=o < m)
    elif MODE == 1:  # reduce-scatter: dst[j] = scale * sum_i src[i * m + j]
        for s in range(first, m, step):
            o = s + lanes
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(n):
                acc += tl.load(src + i.to(tl.int64) * m + o, mask=o < m).to(tl.float32)
            tl.store(dst + o, (acc * scale).to(dst.dtype.element_ty), mask=o < m)
    elif MODE == 2:  # all-reduce: dst[j] *= scale
        for s in range(first, m, step):
            o = s + lanes
            v = tl.load(dst + o, mask=o < m)
            tl.store(dst + o, (v.to(tl.float32) * scale).to(dst.dtype.element_ty), mask=o < m)


@triton.jit
def _hold(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE: tl.constexpr, BLOCK: tl.constexpr):
    start = _clock_ns()
    if tl.program_id(0) == 0:
        tl.atomic_add(active, 1)
    _move(src, dst, m, n, scale, MODE, BLOCK)
    if tl.program_id(0) == 0:
        target = solo_ns.to(tl.int64) * 1024
        progress = tl.full([], 0, tl.int64)
        before = start
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


# One kernel per kind, so that a trace names the collective.
@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_all_gather(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE: tl.constexpr,
                        BLOCK: tl.constexpr):
    _hold(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_reduce_scatter(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE: tl.constexpr,
                            BLOCK: tl.constexpr):
    _hold(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_all_reduce(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE: tl.constexpr,
                        BLOCK: tl.constexpr):
    _hold(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_other(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE: tl.constexpr,
                   BLOCK: tl.constexpr):
    _hold(src, dst, m, n, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


_KERNELS = {"all_gather": emulated_all_gather, "reduce_scatter": emulated_reduce_scatter,
            "all_reduce": emulated_all_reduce}
_MODES = {"gather": _GATHER, "reduce": _REDUCE, "scale": _SCALE}


def hold(kind: str, *, active: torch.Tensor, flag: torch.Tensor, token: int, solo_ns: int, shared: float,
         blocks: int, move: tuple[str, torch.Tensor, torch.Tensor, int, int, float] | None = None) -> None:
    """Launch NOTE [emulated kernel] on the current stream. ``move``: ``(mode, src, dst, m, n, scale)``, mode
    ``"gather"``, ``"reduce"`` or ``"scale"``, or ``None``; ``active``: the GPU's counter; ``flag``: the
    communicator's."""
    kernel = _KERNELS.get(kind, emulated_other)
    if move is None:
        mode, src, dst, m, n, scale = _NONE, flag, flag, 0, 0, 1.0
    else:
        name, src, dst, m, n, scale = move
        mode = _MODES[name]
    kernel[(blocks,)](src, dst, m, n, float(scale), active, flag, token, int(solo_ns),
                      int(round(shared * RATE_ONE)), MODE=mode, BLOCK=_BLOCK, num_warps=_WARPS)
