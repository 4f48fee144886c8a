"""``BlockStack``: alike blocks that Dynamo traces once, compiled as one body that every block calls.

NOTE [stacked blocks]: an outlined model (NOTE [outlined units] in ``module.py``) still has Dynamo trace
each block's call (the part of a cold compile growing fastest with depth). A ``BlockStack`` is an
``nn.ModuleList`` of alike blocks called as one module (``h = self.layers(h, *args)``); traced for
``fsdp_backend``, it hands Dynamo one ``scan`` whose body is block 0 and whose inputs are every block's
parameters (shards) stacked per role. The backend unrolls it into one call of the body per block (NOTE
[unrolled stacks] in ``passes/capture/unroll.py``): an outlined model, the stacks never built. Each block
stays its own ``fully_shard`` unit; the one trace asks of them one class, the same parameters, buffers and
plain attributes, no hooks, and alike sharding. Eagerly, under another backend or
``make_backend(outline=False)``, or while a block accumulates (NOTE [no-sync]), the blocks run one by one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from fsdp_compile._compat import scan, scan_example_values_without_autograd
from fsdp_compile.api.module import outlining
from fsdp_compile.api.units import ShardedParam, Unit, _units

__all__ = ["BlockStack", "add_sharded_block", "check_stacks_sharded", "stack_of"]

# Block -> the stack holding it (weakly both ways).
_stacks: weakref.WeakKeyDictionary[nn.Module, weakref.ref[BlockStack]] = weakref.WeakKeyDictionary()


def stack_of(module: nn.Module) -> BlockStack | None:
    """The :class:`BlockStack` that holds ``module`` as one of its blocks, or ``None``."""
    ref = _stacks.get(module)
    return ref() if ref is not None else None


class BlockStack(nn.ModuleList):
    """``h = block_i(h, *args, **kwargs)`` for each block in turn, traced once for all by ``fsdp_backend``.

    ``blocks``: alike modules whose forward returns a tensor like its first argument. ``ignore_attributes``:
    plain attributes the forward does not read, which may differ (a KV cache's ``layer_idx``). Shard it with
    ``fully_shard(stack, groups=groups)`` (each block one unit).
    """

    def __init__(self, blocks: Iterable[nn.Module], *, ignore_attributes: Iterable[str] = ()) -> None:
        blocks = list(blocks)
        _check_alike(blocks, frozenset(ignore_attributes))
        # NOTE [scan example values] in _compat.py: torch's scan kernel wrapped once, from the first stack
        scan_example_values_without_autograd(outlining)
        super().__init__()
        nn.ModuleList.extend(self, blocks)  # the stack's own extend refuses
        first = blocks[0]
        self.roles: tuple[str, ...] = tuple(n for n, _ in first.named_parameters())
        self.buffer_roles: tuple[str, ...] = tuple(n for n, _ in first.named_buffers())
        # Set by fully_shard, per block: its ShardedParam of each role.
        self.shards: list[tuple[ShardedParam, ...] | None] = [None] * len(blocks)
        for block in blocks:
            _stacks[block] = weakref.ref(self)

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy's blocks are its own
        super().__setstate__(state)
        for block in self:
            _stacks[block] = weakref.ref(self)

    def forward(self, h: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not (torch.compiler.is_compiling() and outlining() and self._one_trace()):
            return self._one_by_one(h, args, kwargs)
        if self.shards[0] is None:
            tensors = [[block.get_parameter(role) for block in self] for role in self.roles]
            keys = list(self.roles)
        else:
            tensors = [[shards[j].shard for shards in self.shards] for j in range(len(self.roles))]  # type: ignore[union-attr]
            keys = [_original(role) for role in self.roles]
        tensors += [[block.get_buffer(role) for block in self] for role in self.buffer_roles]
        keys += list(self.buffer_roles)
        first = self[0]

        def body(carry: Tensor, rows: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
            return functional_call(first, dict(zip(keys, rows)), (carry, *args), kwargs), []

        out, _ = scan(body, h, [torch.stack(ts) for ts in tensors])
        return out

    def _one_by_one(self, h: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        for block in self:
            out = block(h, *args, **kwargs)
            if not torch.compiler.is_compiling() and (
                    not isinstance(out, Tensor) or out.shape != h.shape or out.dtype != h.dtype):
                got = (f"a tensor of shape {tuple(out.shape)} and {out.dtype}" if isinstance(out, Tensor)
                       else type(out).__name__)
                raise TypeError(f"BlockStack: {type(block).__name__}.forward returned {got} for an input of shape "
                                f"{tuple(h.shape)} and {h.dtype}; a stack's block must return a tensor like its first "
                                "argument (the carried hidden state). Return extra results through a plain "
                                "nn.ModuleList loop instead of a BlockStack.")
            h = out
        return h

    def _one_trace(self) -> bool:
        """Whether one trace of block 0 stands for every block now."""
        sharded = [shards is not None for shards in self.shards]
        if any(sharded) and not all(sharded):
            missing = sharded.index(False)
            raise ValueError(f"BlockStack: block {missing} is not sharded while block {sharded.index(True)} is; "
                             "shard every block of a stack (for block in stack: fully_shard(block, groups=groups)), "
                             "or none.")
        return not any(shards[0].unit.accumulating for shards in self.shards if shards is not None)

    def extra_repr(self) -> str:
        return f"{len(self)} x {type(self[0]).__name__}, traced once when compiled"

    def _fixed(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("BlockStack: a stack's blocks are fixed when it is built (it checked them alike and "
                        "sharding records each one); build a new BlockStack from the blocks you want.")

    append = extend = insert = pop = __setitem__ = __delitem__ = __iadd__ = _fixed


def _original(role: str) -> str:
    """Where a sharded block keeps the shard of ``role``: ``attn.wq.parametrizations.weight.original``."""
    owner, _, leaf = role.rpartition(".")
    return f"{owner}.parametrizations.{leaf}.original" if owner else f"parametrizations.{leaf}.original"


def add_sharded_block(stack: BlockStack, block: nn.Module, unit: Unit) -> None:
    """``fully_shard``'s part for a block of ``stack``: check it and record its ShardedParam of each role."""
    index = next(i for i, b in enumerate(stack) if b is block)
    by_name = {sp.local_name: sp for sp in unit.params}
    if set(by_name) != set(stack.roles) or any(not parametrize.is_parametrized(block.get_submodule(r.rpartition(".")[0]))
                                                for r in stack.roles):
        raise ValueError(f"fully_shard: block {index} of a BlockStack must be sharded as one unit holding all of its "
                         "parameters: call fully_shard on the block, not on modules inside it, and before the root.")
    for other in (shards[0].unit for shards in stack.shards if shards is not None):
        mine = (unit.groups, unit.reshard_after_forward, unit.mp_policy)
        if mine != (other.groups, other.reshard_after_forward, other.mp_policy):
            raise ValueError(f"fully_shard: block {index} of a BlockStack is sharded unlike an earlier block (groups, "
                             "reshard_after_forward or mp_policy differ); a stack's blocks are compiled as one body: "
                             "shard them alike.")
    stack.shards[index] = tuple(by_name[r] for r in stack.roles)


def check_stacks_sharded(module: nn.Module, unit_name: str) -> None:
    """Refuse a unit around a BlockStack whose blocks are not units yet."""
    for name, inner in module.named_modules():
        if isinstance(inner, BlockStack):
            loose = [i for i, block in enumerate(inner) if block not in _units]
            if loose:
                where = f"{name}.{loose[0]}" if name else str(loose[0])
                raise ValueError(
                    f"fully_shard({unit_name}): block {where} of a BlockStack is not sharded yet; each block of a "
                    "stack is a unit of its own: call fully_shard on the blocks first (for block in stack: "
                    "fully_shard(block, groups=groups), or fully_shard(stack, groups=groups)), then the root.")


_PLAIN = (bool, int, float, str, type(None))


def _attributes(module: nn.Module, ignore: frozenset[str]) -> dict[str, object]:
    """A module's plain attributes that its forward may read."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k not in ignore and k != "training" and isinstance(v, _PLAIN)}


def _check_alike(blocks: list[nn.Module], ignore: frozenset[str]) -> None:
    """Refuse blocks one trace cannot stand for, naming what differs."""
    if not blocks:
        raise ValueError("BlockStack: no blocks given; pass the model's blocks (an nn.ModuleList of at least one).")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"BlockStack: block {i} is a {type(b).__name__}, not an nn.Module.")
        for name, m in b.named_modules():
            where = f"block {i}" + (f" ({name})" if name else "")
            if m in _units or parametrize.is_parametrized(m):
                raise ValueError(f"BlockStack: {where} is already sharded or parametrized; build the BlockStack "
                                 "from plain blocks first, then call fully_shard on its blocks.")
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                raise ValueError(f"BlockStack: {where} has hooks, which one trace of block 0 cannot run per block; "
                                 "remove them, or keep the blocks in an nn.ModuleList.")
    first = blocks[0]
    want = [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in first.named_parameters()]
    names = [n for n, _ in first.named_parameters(remove_duplicate=False)]
    if len(names) != len(want):
        tied = sorted(set(names) - {n for n, *_ in want})
        raise ValueError(f"BlockStack: a parameter of the blocks is tied to another ({tied[0]}); a stack passes each "
                         "block one tensor per name. Untie it inside the block, or keep the blocks in an nn.ModuleList.")
    buffers = [(n, t.shape, t.dtype, t.device) for n, t in first.named_buffers()]
    attributes = {name: _attributes(m, ignore) for name, m in first.named_modules()}
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
        if [(n, t.shape, t.dtype, t.device) for n, t in b.named_buffers()] != buffers:
            raise ValueError(f"BlockStack: block {i}'s buffers differ from block 0's in name, shape, dtype or device; "
                             "a stack's blocks must be alike. Keep the blocks in an nn.ModuleList.")
        for name, m in b.named_modules():
            theirs, ours = _attributes(m, ignore), attributes.get(name)
            if theirs != ours:
                key = next(k for k in sorted({*theirs, *(ours or {})}) if theirs.get(k) != (ours or {}).get(k))
                where = f"{name}.{key}" if name else key
                raise ValueError(
                    f"BlockStack: block {i}'s attribute {where} is {theirs.get(key)!r}, block 0's "
                    f"{(ours or {}).get(key)!r}; the compiled stack runs block 0's code and attributes for every block. "
                    f"If the block's forward does not read it, pass BlockStack(..., ignore_attributes=[{key!r}]); "
                    "otherwise keep the blocks in an nn.ModuleList.")
