"""Rank functions for the multi-process tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import FsdpGroups, fully_shard, make_backend
from fsdp_compile.models import ModelConfig, Transformer, loss_fn
from fsdp_compile.sharding import unit_of

TINY = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_seq_len=16)


def make_batches(cfg: ModelConfig, steps: int, batch: int, seq: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def shard_model(model: Transformer, groups: FsdpGroups, **kw: Any) -> Transformer:
    for block in model.layers:
        fully_shard(block, groups=groups, **kw)
    fully_shard(model, groups=groups, **kw)
    return model


def reference_run(cfg: ModelConfig, batches: list, optim: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process eager training on the global batches: losses per step and the first step's grads."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = make_optimizer(optim, model.parameters())
    losses, grads0 = [], {}
    for step, (x, y) in enumerate(batches):
        loss = loss_fn(model(x), y)
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads0


def train_sharded(rank: int, world: int, cfg: ModelConfig, steps: int, optim: str, inductor: bool,
                  backend_kw: dict | None = None, group_kw: dict | None = None) -> dict[str, Any]:
    """Train the sharded, compiled model on this rank's slice of each global batch."""
    batches = make_batches(cfg, steps, batch=2 * world, seq=8)
    groups = FsdpGroups.create(**(group_kw or {}))
    torch.manual_seed(0)
    model = shard_model(Transformer(cfg), groups)
    compiled = torch.compile(model, backend=make_backend(inductor=inductor, **(backend_kw or {})))
    opt = make_optimizer(optim, model.parameters())
    losses = []
    per = 2
    for step, (x, y) in enumerate(batches):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = loss_fn(compiled(xs), ys)
        loss.backward()
        if step == 0:
            grads0 = {sp.fqn: sp.shard.grad.clone() for u in _units(model) for sp in u.params}
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    ref_losses, ref_grads = reference_run(cfg, batches, optim)
    groups.destroy()
    return {"losses": losses, "ref_losses": ref_losses, "grads0": grads0,
            "ref_grads0": {n: _slice(ref_grads[n], rank, world) for n in grads0}}


def _units(model: nn.Module) -> list:
    return [u for m in model.modules() if (u := unit_of(m)) is not None]


def _slice(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = -(-full.shape[0] // world)
    padded = torch.zeros(rows * world, *full.shape[1:], dtype=full.dtype)
    padded[: full.shape[0]] = full
    return padded[rank * rows:(rank + 1) * rows]
