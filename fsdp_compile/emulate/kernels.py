"""The GPU kernel an emulated collective runs: move a rank's bytes, then hold its blocks until its time is up.

NOTE [emulated kernel]: one launch per collective, on the communicator's stream, ``blocks`` programs:

1. Block 0 reads the GPU's clock (``%globaltimer``, ns) and adds one to the count of collectives
   running on this GPU (a device counter shared by every communicator).
2. Every block copies its share of the data through device memory as a rank's NCCL kernel would: an
   all-gather writes its whole output from its input (the input repeated: rank 0's data in every rank's
   place); a reduce-scatter reads its whole input and writes the sum (or mean) of its chunks; an
   all-reduce reads and writes its buffer in place.
3. Block 0 then advances the collective's progress with the clock, at ``min(1, shared / k)`` of its solo
   rate while ``k`` collectives run (NOTE [emulated time]), until the progress reaches its solo time;
   it takes one off the count and writes the collective's token into its communicator's flag. The
   other blocks spin until the flag holds the token, so the launch holds ``blocks`` thread blocks for
   the collective's whole time, as NCCL's kernels hold their channels' SMs.

The kernel ends when both the data is moved and the time is up: a collective is never faster than its
own copy. Kernel names say the kind (``emulated_all_gather`` ...), so traces show them as such.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["launch", "RATE_ONE"]

RATE_ONE = 1024  # progress rate of a collective running alone, in fixed point
_BLOCK = 4096
_GATHER, _REDUCE, _INPLACE, _NONE = 0, 1, 2, 3
# Integer arguments compiled as values, not specialised (a token or a count of 1 is not a constant).
_PLAIN_INTS = ["n_dst", "n_src", "chunks", "token", "solo_ns", "shared_q"]


@triton.jit
def _clock_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _body(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q,
          MODE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    start = _clock_ns()
    if pid == 0:
        tl.atomic_add(active, 1)
    if MODE == 0:  # gather: each of the dst's chunks is src (read once, written chunks times)
        for off in range(pid * BLOCK, n_src, programs * BLOCK):
            idx = off.to(tl.int64) + tl.arange(0, BLOCK)
            m = idx < n_src
            v = tl.load(src + idx, mask=m)
            for j in range(0, chunks):
                tl.store(dst + j * n_src + idx, v, mask=m)
    elif MODE == 1:  # reduce: dst[i] = scale * sum_j src[j * n_dst + i]
        for off in range(pid * BLOCK, n_dst, programs * BLOCK):
            idx = off.to(tl.int64) + tl.arange(0, BLOCK)
            m = idx < n_dst
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in range(0, chunks):
                acc += tl.load(src + j * n_dst + idx, mask=m, other=0).to(tl.float32)
            tl.store(dst + idx, (acc * scale).to(dst.dtype.element_ty), mask=m)
    elif MODE == 2:  # in place: dst[i] = scale * dst[i]
        for off in range(pid * BLOCK, n_dst, programs * BLOCK):
            idx = off.to(tl.int64) + tl.arange(0, BLOCK)
            m = idx < n_dst
            v = tl.load(dst + idx, mask=m).to(tl.float32)
            tl.store(dst + idx, (v * scale).to(dst.dtype.element_ty), mask=m)
    if pid == 0:
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


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_all_gather(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q,
                        MODE: tl.constexpr, BLOCK: tl.constexpr):
    _body(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_reduce_scatter(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q,
                            MODE: tl.constexpr, BLOCK: tl.constexpr):
    _body(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_all_reduce(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q,
                        MODE: tl.constexpr, BLOCK: tl.constexpr):
    _body(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


@triton.jit(do_not_specialize=_PLAIN_INTS)
def emulated_other(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q,
                   MODE: tl.constexpr, BLOCK: tl.constexpr):
    _body(src, dst, n_dst, n_src, chunks, scale, active, flag, token, solo_ns, shared_q, MODE, BLOCK)


_KERNELS = {"all_gather": emulated_all_gather, "reduce_scatter": emulated_reduce_scatter,
            "all_reduce": emulated_all_reduce}


def launch(kind: str, *, src: torch.Tensor | None, dst: torch.Tensor | None, mode: str, scale: float,
           active: torch.Tensor, flag: torch.Tensor, token: int, solo_ns: int, shared: float, blocks: int) -> None:
    """Launch one emulated collective on the current stream (NOTE [emulated kernel]).

    ``mode``: ``"gather"`` (``dst`` is ``src`` repeated), ``"reduce"`` (``dst`` is ``scale`` times the sum of
    ``src``'s ``dst``-sized chunks), ``"inplace"`` (``dst *= scale``) or ``"none"`` (time only).
    ``active`` is the GPU's int64 counter of running collectives, ``flag`` the communicator's int64 slot.
    """
    modes = {"gather": _GATHER, "reduce": _REDUCE, "inplace": _INPLACE, "none": _NONE}
    if mode == "none" or dst is None or dst.numel() == 0:
        src = dst = active  # placeholders: no element is read or written
        n_dst = n_src = chunks = 0
        code = _NONE
    else:
        src = dst if src is None else src
        n_dst, n_src = dst.numel(), src.numel()
        chunks = max(1, n_dst // max(n_src, 1)) if mode == "gather" else max(1, n_src // max(n_dst, 1))
        code = modes[mode]
    kernel = _KERNELS.get(kind, emulated_other)
    kernel[(blocks,)](src, dst, n_dst, n_src, chunks, float(scale), active, flag, token, int(solo_ns),
                      int(round(shared * RATE_ONE)), MODE=code, BLOCK=_BLOCK, num_warps=8)
