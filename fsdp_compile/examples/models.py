"""A small Llama-style decoder (RMSNorm, causal attention with RoPE, SwiGLU); presets from tiny to Llama-3-70B."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_compile.api.stack import BlockStack

__all__ = ["ModelConfig", "Transformer", "PRESETS"]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a :class:`Transformer`."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    hidden_dim: int | None = None  # SwiGLU width; default: 8/3 * dim rounded up to a multiple of 8
    max_seq_len: int = 64
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    @property
    def ffn_dim(self) -> int:
        return self.hidden_dim if self.hidden_dim is not None else 8 * -(-(8 * self.dim // 3) // 8)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def with_(self, **kwargs: object) -> ModelConfig:
        """A copy with some fields changed."""
        return replace(self, **kwargs)  # type: ignore[arg-type]


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64),
    "demo": ModelConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, max_seq_len=128),
    # 4 Llama blocks of width 4096, no GQA, a 32k vocabulary
    "llama-d4096": ModelConfig(vocab_size=32000, dim=4096, n_layers=4, n_heads=32, max_seq_len=2048),
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                             max_seq_len=8192),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672,
                              max_seq_len=8192),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` over its last dim (in float32), scaled by ``weight``."""
    norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return norm.type_as(x) * weight


def _rope_tables(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    head_dim = cfg.dim // cfg.n_heads
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of ``x`` ``(batch, heads, seq, head_dim)``: rotates pairs (even, odd)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = heads(self.wq(x), self.n_heads)
        k = heads(self.wk(x), self.kv_heads)
        v = heads(self.wv(x), self.kv_heads)
        return self.wo(attend(q, k, v, cos, sin))


def heads(t: Tensor, n: int) -> Tensor:
    """A projection ``(batch, seq, n * head_dim)`` as ``(batch, n, seq, head_dim)``."""
    b, s, _ = t.shape
    return t.view(b, s, n, t.shape[-1] // n).transpose(1, 2)


def attend(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Causal attention with RoPE of ``heads``-shaped ``q``, ``k``, ``v`` (``k``, ``v`` may have fewer heads)."""
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b, _, s, _ = q.shape
    return out.transpose(1, 2).reshape(b, s, -1)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """A Llama-style decoder: ``tokens (batch, seq) -> logits (batch, seq, vocab)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self) -> None:
        """torchtitan's Llama initialisation (also on a sharded model after ``to_empty``), and the RoPE tables."""
        std_out = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            cos, sin = _rope_tables(self.cfg)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers:
            for norm in (block.attn_norm, block.ffn_norm):
                nn.init.ones_(norm.weight)
            for linear in (block.attn.wq, block.attn.wk, block.attn.wv, block.ffn.w1):
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
            for linear in (block.attn.wo, block.ffn.w2, block.ffn.w3):
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=std_out)
        nn.init.ones_(self.norm.weight)
        bound = self.cfg.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=bound, a=-3 * bound, b=3 * bound)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        if isinstance(self.layers, BlockStack):  # traced once for all blocks (NOTE [stacked blocks])
            x = self.layers(x, self.rope_cos, self.rope_sin)
        else:
            for layer in self.layers:
                x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
