"""A probe of the design proposed for issue 11's rest: one flat shard per unit.

Today each sharded parameter of a block is its own shard: per block and per graph nine graph inputs, a
pack of nine shards into the all-gather bucket, nine gradient views out of the reduce-scatter, and in
Dynamo nine tensors to wrap and guard. The design proposed at stop 28 keeps a unit's shards as views
of one flat per-rank buffer that autograd sees as the leaf (as FSDP1's flat parameter), so that a block
has one input and one gradient. Building it touches the optimizer, gradients, checkpoints and
accumulation; this probe measures what it would buy at compile time first, without any of that.

``flatten_blocks(model)`` swaps every block of a :class:`fsdp_compile.models.Transformer` for a
:class:`FlatBlock`: the same submodules and the same arithmetic (its forward gives the block's output,
checked in ``tests/test_flat_probe.py``), but one ``nn.Parameter`` holding all of the block's weights,
split into views in ``forward``. Sharded, such a block is one shard, one marker and one gradient, with
the module tree (the submodules Dynamo calls, and guards) of the real block. The compile of the
probed model is what the flat design could reach for the outer graph and Dynamo's reads; the body
gains a split and views that the real design would also have.

``compile_time --variants fsdp-compile fsdp-compile-flatprobe`` compiles both side by side.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_compile.models import Block, Transformer, attend, heads, rms_norm

__all__ = ["FlatBlock", "flatten_blocks"]


class _Linear(nn.Module):
    """A bias-free linear layer whose weight is handed to ``forward``."""

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)


class _RMSNorm(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, n_heads: int, kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.kv_heads = n_heads, kv_heads
        self.wq, self.wk, self.wv, self.wo = _Linear(), _Linear(), _Linear(), _Linear()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, wq: Tensor, wk: Tensor, wv: Tensor,
                wo: Tensor) -> Tensor:
        q = heads(self.wq(x, wq), self.n_heads)
        k = heads(self.wk(x, wk), self.kv_heads)
        v = heads(self.wv(x, wv), self.kv_heads)
        return self.wo(attend(q, k, v, cos, sin), wo)


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = _Linear(), _Linear(), _Linear()

    def forward(self, x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x, w1)) * self.w3(x, w3), w2)


# The block's weights in the flat parameter, in this order.
_ORDER = ("attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
          "ffn_norm.weight", "ffn.w1.weight", "ffn.w3.weight", "ffn.w2.weight")


class FlatBlock(nn.Module):
    """A :class:`fsdp_compile.models.Block` whose weights are views of one flat parameter ``flat``."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        params = dict(block.named_parameters())
        if set(params) != set(_ORDER):
            raise ValueError(f"FlatBlock: expected a Block's parameters {_ORDER}, got {sorted(params)}")
        weights = [params[name].detach() for name in _ORDER]
        self.shapes = tuple(tuple(w.shape) for w in weights)
        self.sizes = tuple(math.prod(s) for s in self.shapes)
        self.flat = nn.Parameter(torch.cat([w.reshape(-1) for w in weights]))
        attn = block.attn
        self.attn_norm, self.ffn_norm = _RMSNorm(block.attn_norm.eps), _RMSNorm(block.ffn_norm.eps)
        self.attn = _Attention(attn.n_heads, attn.kv_heads)
        self.ffn = _FeedForward()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        an, wq, wk, wv, wo, fn, w1, w3, w2 = (
            piece.view(shape) for piece, shape in zip(self.flat.split(self.sizes), self.shapes))
        x = x + self.attn(self.attn_norm(x, an), cos, sin, wq, wk, wv, wo)
        return x + self.ffn(self.ffn_norm(x, fn), w1, w3, w2)


def flatten_blocks(model: nn.Module) -> nn.Module:
    """Swap each block of ``model`` (a :class:`fsdp_compile.models.Transformer`) for a :class:`FlatBlock`
    holding the same weights; returns ``model``."""
    if not isinstance(model, Transformer) or not isinstance(model.layers, nn.ModuleList):
        raise ValueError(f"flatten_blocks: needs a Transformer whose layers are a ModuleList, got "
                         f"{type(model).__name__}; use the llama model for the flat probe.")
    model.layers = nn.ModuleList(FlatBlock(block) for block in model.layers)  # type: ignore[arg-type]
    return model
