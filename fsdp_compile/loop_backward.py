"""A stack's backward loop that reads each block's saved values in place (NOTE [a loop's backward in place]).

NOTE [a loop's backward in place]: torch builds a scan's backward (``ScanAutogradImpl.call_backward``,
torch 2.11 and 2.13) as a second scan over *reversed copies* of everything the forward saved: every
saved activation of every block, and the stacked shards the body read, each go through
``torch.flip`` before the backward loop runs. The partition then placed those flips of activations in
the forward graph, as its outputs, so a step copied every saved activation twice and held both copies
at once: at 16 x D=1024 the transient peak went from 943 MiB (outlined blocks) to 2,092 MiB, and at
4 x D=4096 GPU copy kernels took 16.8 ms a step against 2.6 (README, Compile time).

:func:`backward_in_place` builds the same backward with nothing reversed. Its loop runs over one
small host tensor, the block numbers from the last down (``fsdp_loop::countdown``, an op Inductor
calls as it is: no C++). Each iteration reads its number with ``.item()`` on the host, as
Inductor's own loop reads its counter, and views row ``block`` of each saved stack; that costs no
copy. The blocks' gradients still come out of the loop last block first, and are flipped once at the
end. Those are the shards' gradients, a world's size smaller than the activations at world size > 1.

The backward iteration is the torch-built per-block backward (``bw_gm``) unchanged. Only where its
inputs come from changes, so the numerics are the loop's as torch builds it
(``tests/test_stack.py``, ``tests/test_numerics.py::test_stacked_blocks_match_the_reference``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["backward_in_place"]


def _chunks(flat: tuple[Any, ...], sizes: list[int]) -> list[list[Any]]:
    out, at = [], 0
    for size in sizes:
        out.append(list(flat[at:at + size]))
        at += size
    return out


def backward_in_place(impl: Any, *grad_outputs: Any) -> tuple[Any, ...]:
    """The gradients of a scan's inputs, ``(*init, *xs, *additional_inputs)``, given ``impl`` (torch's
    ``ScanAutogradImpl`` after its forward ran) and the gradients of the scan's outputs
    ``(*carry, *ys)``: NOTE [a loop's backward in place]."""
    from torch._higher_order_ops.scan import ScanForwardIntermediatesHandlingPolicy as Policy
    from torch._higher_order_ops.scan import scan_op
    from torch._higher_order_ops.utils import materialize_as_graph

    from ._compat_loops import loop_countdown

    n_carry, n_xs = len(impl.init), len(impl.xs)
    length = impl.xs[0].shape[0]
    grad_carry, grad_ys = list(grad_outputs[:n_carry]), list(grad_outputs[n_carry:])
    is_tensor = [isinstance(t, torch.Tensor) for t in impl.additional_inputs]
    grad_inputs = [torch.zeros_like(t) for t, tensor in zip(impl.additional_inputs, is_tensor) if tensor]
    saved_xs, saved = list(impl.saved_fw_xs), list(impl.saved_intermediates)
    stacks = [*grad_ys, *saved_xs, *saved]
    passed = list(impl.saved_fw_additional_inputs)
    policies = list(impl.forward_intermediates_handling_policies)
    backward = impl.hop_partitioned_graph.bw_gm
    sizes = [len(grad_carry), len(grad_inputs), 1, len(stacks), len(passed)]

    def iteration(*flat: Any) -> list[Any]:
        carry, summed, (number,), rows_of, passed_in = _chunks(flat, sizes)
        block = number.item()
        torch._check(block >= 0)
        torch._check(block < length)
        rows = [stack.select(0, block) for stack in rows_of]
        y_rows = rows[:len(grad_ys)]
        x_rows = iter(rows[len(grad_ys):len(grad_ys) + len(saved_xs)])
        kept = iter(rows[len(grad_ys) + len(saved_xs):])
        inputs = iter(passed_in)
        intermediates = []
        for policy in policies:
            if policy in (Policy.CLONE, Policy.KEEP):
                intermediates.append(next(kept))
            elif policy == Policy.REMOVE_XS:
                intermediates.append(next(x_rows))
            elif policy == Policy.REMOVE_ADDITIONAL_INPUTS:
                intermediates.append(next(inputs))
            else:
                raise AssertionError(f"unknown scan intermediate policy {policy}")
        grads = list(backward(*intermediates, *carry, *y_rows))
        next_carry, grad_x, grad_in = grads[:n_carry], grads[n_carry:n_carry + n_xs], grads[n_carry + n_xs:]
        grad_in = [g for g, tensor in zip(grad_in, is_tensor) if tensor]
        return [*next_carry, *[s + g for s, g in zip(summed, grad_in)], *grad_x]

    order = loop_countdown(impl.xs[0], length)
    example = (*grad_carry, *grad_inputs, order[0], *stacks, *passed)
    body = materialize_as_graph(iteration, example)
    out = scan_op(body, [*grad_carry, *grad_inputs], [order], [*stacks, *passed])
    grad_init, summed, grad_xs = _chunks(tuple(out), [n_carry, len(grad_inputs), n_xs])
    summed_it = iter(summed)
    grad_additional = [next(summed_it) if tensor else None for tensor in is_tensor]
    return (*grad_init, *[torch.flip(g, (0,)) for g in grad_xs], *grad_additional)
