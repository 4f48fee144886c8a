"""``BlockStack``: identical blocks run as one loop, so that a compiler traces and compiles one block.

NOTE [stacked blocks]: an outlined model (NOTE [outlined units] in ``module.py``) still hands Dynamo,
AOTAutograd, our passes and Inductor one call of the block's body, with its glue, per block: its cold
compile grows with depth (README, Compile time). A ``BlockStack`` holds the blocks' parameters stacked,
one tensor per role (``block.attn.wq.weight`` of shape ``(blocks, *shape)``), and runs them, when
compiled, as one ``scan`` over those stacks: Dynamo traces the block once, AOTAutograd partitions one
loop body, Inductor compiles one forward and one backward body, and the graph holds no node per block.

Sharded (``fully_shard(stack, ...)``), each role's tensor holds every block's dim-0 shard, shape
``(blocks, rows, *shape[1:])`` (NOTE [padding] in ``ops.py``, per block), and the loop body reads its
block's slice through ``fsdp::unshard``, so each iteration gathers its block, and its backward
reduce-scatters the block's gradients (both lowered inside the loop body by ``passes/loops.py``). As
torch partitions a loop body, it would keep every block's gathered parameters from forward to
backward; the backend tags the body's unshards must-recompute first (``tagging_loop_bodies`` in
``_compat_loops.py``), so the forward keeps the shards and the backward gathers again, as resharding after
forward does elsewhere.

What a stack gives up against outlined blocks: a loop iteration cannot leave a collective in flight
into the next one, so in this version no gather is prefetched and no reduce-scatter overlaps the next
block's backward: each block's collectives wait before its compute (forward) or right after it
(backward). With one rank (collectives elided) nothing is lost; with more, the communication is
exposed. The blocks must be alike (one class, the same parameter names, shapes, dtypes and
``requires_grad``, equal buffers, no hooks), and the model must call the stack (``h = self.layers(h,
...)``): a ``for layer in layers`` loop would be unrolled by Dynamo.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from ._compat_loops import SCAN_NEEDS_FIRST_CARRY_GRAD, scan
from .ops import shard_rows
from .units import ShardedParam, Unit, _params, _units

__all__ = ["BlockStack", "shard_stack"]


class BlockStack(nn.Module):
    """``len(blocks)`` alike blocks applied in turn, ``h = block_i(h, *args, **kwargs)``, run as one loop
    when compiled (NOTE [stacked blocks]).

    The stack keeps the first block as ``self.block``, its parameters replaced by the stacks of every
    block's (shape ``(len(blocks), *shape)``; the other blocks are not kept), so ``state_dict()`` keys read
    ``block.<name>``. Each block's forward must return a tensor of its first argument's shape and dtype;
    ``args`` and ``kwargs`` (rotary tables, masks) are the same for every block.
    """

    def __init__(self, blocks: Iterable[nn.Module]) -> None:
        blocks = list(blocks)
        _check_alike(blocks)
        super().__init__()
        first = blocks[0]
        self.names: tuple[str, ...] = tuple(name for name, _ in first.named_parameters())
        self.length = len(blocks)
        with torch.no_grad():
            stacks = {name: torch.stack([b.get_parameter(name).detach() for b in blocks]) for name in self.names}
        for name in self.names:
            owner_name, _, leaf = name.rpartition(".")
            owner = first.get_submodule(owner_name) if owner_name else first
            owner._parameters[leaf] = nn.Parameter(stacks[name], requires_grad=first.get_parameter(name).requires_grad)
        self.block = first

    def stacked(self) -> list[Tensor]:
        """The stacked parameter of each role, in ``self.names`` order (the shards, once sharded)."""
        return [self.block.get_parameter(name) for name in self.names]

    def forward(self, h: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        stacks = self.stacked()
        # Set by fully_shard (name -> ShardedParam): a plain dict that Dynamo reads as it traces.
        shards = self.__dict__.get("_fsdp_reads", {})
        names = self.names

        def apply(carry: Tensor, slices: Sequence[Tensor]) -> Tensor:
            params = {name: _read(shards.get(name), x) for name, x in zip(names, slices)}
            return functional_call(self.block, params, (carry, *args), kwargs)

        if not torch.compiler.is_compiling():
            for i in range(self.length):
                out = apply(h, [t[i] for t in stacks])
                if not isinstance(out, Tensor) or out.shape != h.shape or out.dtype != h.dtype:
                    raise TypeError(_bad_output(self.block, h, out))
                h = out
            return h
        if SCAN_NEEDS_FIRST_CARRY_GRAD and torch.is_grad_enabled() and not h.requires_grad:
            trained = next((t for t in stacks if t.requires_grad), None)
            if trained is not None:  # a zero that requires grad: see SCAN_NEEDS_FIRST_CARRY_GRAD
                h = h + (trained.flatten()[:1] * 0).sum().to(h.dtype)

        def body(carry: Tensor, slices: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
            return apply(carry, slices), []  # no per-iteration output: only the carry

        out, _ = scan(body, h, stacks)
        return out

    def extra_repr(self) -> str:
        return f"{self.length} x {type(self.block).__name__}"


def shard_stack(stack: BlockStack, unit: Unit, unit_name: str) -> None:
    """Each stacked parameter of ``stack`` (``(blocks, *shape)``) in place as every block's dim-0 shard,
    ``(blocks, rows, *shape[1:])``, padded per block (NOTE [stacked blocks], NOTE [padding]), each one a
    parameter of ``unit``: ``fully_shard``'s part for a stack."""
    from .sharding import _check_params, _hand_out_global_grads, _register_grad_hook  # (imports this module)

    for name, m in stack.named_modules():
        taken = [n for n, p in m.named_parameters(recurse=False) if p in _params]
        if taken or parametrize.is_parametrized(m):
            raise ValueError(
                f"fully_shard({unit_name}): {name or 'the stack'} already belongs to a unit; a stack is sharded "
                "as one unit: call fully_shard(stack, groups=groups) alone, not on its block's modules."
            )
    stacks = stack.stacked()
    _check_params(stack, unit_name, [(stack, n, p) for n, p in zip(stack.names, stacks)])
    groups = unit.groups
    rank, world = groups.all_gather.rank(), groups.shard_size
    for name, p in zip(stack.names, stacks):
        per_block = tuple(p.shape[1:])
        full = p.detach().reshape(stack.length, *(per_block or (1,)))
        dim0 = full.shape[1]
        rows = shard_rows(dim0, world)
        start, stop = min(rank * rows, dim0), min((rank + 1) * rows, dim0)
        shard = full.new_zeros(stack.length, rows, *full.shape[2:])
        shard[:, : stop - start].copy_(full[:, start:stop])
        p.grad = None
        p.data = shard
        # Dim 0 of the shard is the block, so all of it is real (the padding rows of each block, along
        # dim 1, have zero gradients): its ShardGrad's norms take every row (NOTE [global norms]).
        sp = ShardedParam(shard=p, full_shape=per_block, local_name=f"block.{name}", unit=unit, sharded=True,
                          shard_index=rank, real_rows=stack.length)
        unit.params.append(sp)
        _params[p] = sp
        stack.__dict__.setdefault("_fsdp_reads", {})[name] = sp
        _register_grad_hook(p, _hand_out_global_grads(sp))


def _read(sp: ShardedParam | None, x: Tensor) -> Tensor:
    """A loop iteration's parameter from its slice ``x`` of a stack: ``x`` itself, or, sharded, gathered
    through the marker."""
    return x if sp is None else torch.ops.fsdp.unshard(x, *sp.marker_args, None)


def _bad_output(block: nn.Module, h: Tensor, out: object) -> str:
    got = f"a tensor of shape {tuple(out.shape)} and {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
    return (f"BlockStack: {type(block).__name__}.forward returned {got} for an input of shape {tuple(h.shape)} and "
            f"{h.dtype}; a stack's block must return a tensor like its first argument (the carried hidden "
            "state). Return extra results through a plain nn.ModuleList loop instead of a BlockStack.")


def _check_alike(blocks: list[nn.Module]) -> None:
    """Refuse blocks one loop body cannot stand for, naming what differs."""
    if not blocks:
        raise ValueError("BlockStack: no blocks given; pass the model's blocks (an nn.ModuleList of at least one).")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"BlockStack: block {i} is a {type(b).__name__}, not an nn.Module.")
        for name, m in b.named_modules():
            where = f"block {i}" + (f" ({name})" if name else "")
            if m in _units or parametrize.is_parametrized(m):
                raise ValueError(f"BlockStack: {where} is already sharded or parametrized; build the BlockStack "
                                 "from plain blocks first, then call fully_shard(stack, groups=groups) on it.")
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                raise ValueError(f"BlockStack: {where} has hooks, which one loop body cannot run per block; "
                                 "remove them, or keep the blocks in an nn.ModuleList.")
    first = blocks[0]
    want = [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in first.named_parameters()]
    if not want:
        raise ValueError("BlockStack: the blocks have no parameters; nothing to stack.")
    names = [n for n, _ in first.named_parameters(remove_duplicate=False)]
    if len(names) != len(want):
        tied = sorted(set(names) - {n for n, *_ in want})
        raise ValueError(f"BlockStack: a parameter of the blocks is tied to another ({tied[0]}); a stack keeps one "
                         "tensor per name. Untie it inside the block, or keep the blocks in an nn.ModuleList.")
    buffers = dict(first.named_buffers())
    for i, b in enumerate(blocks[1:], start=1):
        if type(b) is not type(first):
            raise ValueError(f"BlockStack: block {i} is a {type(b).__name__}, block 0 a {type(first).__name__}; "
                             "a stack runs one kind of block. Stack each kind on its own.")
        got = [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in b.named_parameters()]
        if got != want:
            diff = next((g, w) for g, w in zip(got + [None] * len(want), want + [None] * len(got)) if g != w)
            raise ValueError(f"BlockStack: block {i}'s parameters differ from block 0's (first difference: "
                             f"{diff[0]} against {diff[1]}: name, shape, dtype, device, requires_grad); a stack's "
                             "blocks must be alike. Freeze or unfreeze whole roles, or keep an nn.ModuleList.")
        theirs = dict(b.named_buffers())
        if theirs.keys() != buffers.keys() or any(not torch.equal(theirs[k], v) for k, v in buffers.items()):
            raise ValueError(f"BlockStack: block {i}'s buffers differ from block 0's; a stack runs block 0's "
                             "buffers for every block. Pass per-block tensors as parameters, or keep an "
                             "nn.ModuleList.")
