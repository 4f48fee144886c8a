"""Rank functions for tests/test_checkpoint.py (module level, so spawned processes can import them).

Models train uncompiled (the markers run eagerly: blocking collectives, same numerics) to keep the
tests fast. Every world size sees the same global batch of ``GLOBAL_BATCH`` sequences per step, each
rank its slice, so losses compare across world sizes.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_compile import FsdpGroups, fully_shard
from fsdp_compile.api.checkpoint import (
    get_full_model_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from fsdp_compile.examples.models import Transformer, loss_fn
from fsdp_compile.api.sharding import unit_of
from .workers import TINY, UnevenModel, shard_model

GLOBAL_BATCH = 4
SEQ = 8
LR = 1e-2
BEFORE, AFTER = 3, 3  # llama: steps before the checkpoint, steps after it


def global_batches(steps: int, vocab: int) -> list[tuple[Tensor, Tensor]]:
    """``steps`` global (tokens, targets) batches, the same for every world size."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def adamw(model: nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, rank: int, world: int) -> list[float]:
    """One optimizer step per global batch on this rank's slice; returns the global mean losses."""
    per = GLOBAL_BATCH // world
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "ran eagerly" warning
        for x, y in batches:
            loss = loss_fn(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    return losses


def reference(steps: int) -> tuple[list[float], dict[str, Tensor]]:
    """Single-process training of the llama model on the global batches: losses and final state dict."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    opt = adamw(model)
    losses = []
    for x, y in global_batches(steps, TINY.vocab_size):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def padding_is_zero(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Whether every shard's rows past the param's end, and the same rows of its optimizer state, are 0."""
    for m in model.modules():
        unit = unit_of(m)
        for sp in unit.params if unit is not None else ():
            n = sp.full_shape[0] if sp.full_shape else 1
            rows = sp.shard.shape[0]
            valid = max(0, min(rows, n - unit.groups.all_gather.rank() * rows))
            tensors = [sp.shard] + [v for v in opt.state.get(sp.shard, {}).values() if v.dim() > 0]
            if any(t[valid:].abs().sum().item() != 0 for t in tensors):
                return False
    return True


def full_optimizer_state(osd: dict[str, Any]) -> dict[str, Tensor]:
    """Every state tensor of an FQN-keyed optimizer state dict as a full plain tensor (collective)."""
    out = {}
    for name in sorted(osd["state"]):
        for key, value in sorted(osd["state"][name].items()):
            if isinstance(value, Tensor):
                out[f"{name}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value.clone()
    return out


# ---------------------------------------------------------------------------------------------
# Llama: save at one world size, resume at others
# ---------------------------------------------------------------------------------------------


def save_and_continue(rank: int, world: int, path: str, before: int, after: int) -> dict[str, Any]:
    """Train ``before`` steps, save model + optimizer, train ``after`` more; losses and final full state."""
    groups = FsdpGroups.create()
    torch.manual_seed(0)
    model = shard_model(Transformer(TINY), groups)
    opt = adamw(model)
    batches = global_batches(before + after, TINY.vocab_size)
    losses = train(model, opt, batches[:before], rank, world)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    losses += train(model, opt, batches[before:], rank, world)
    full = get_full_model_state_dict(model)
    groups.destroy()
    return {"losses": losses, "full": full}


def _groups_for(world: int, hsdp: bool) -> FsdpGroups:
    if hsdp:
        return FsdpGroups.create(init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    return FsdpGroups.create()


def _fresh_llama(groups: FsdpGroups) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)  # not the saved run's init: the checkpoint must overwrite everything
    model = shard_model(Transformer(TINY), groups)
    return model, adamw(model, lr=0.5)  # and not its lr: param_groups must be restored


def _load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    return sd


def resume(rank: int, world: int, path: str, before: int, after: int, hsdp: bool = False,
           resave: str = "") -> dict[str, Any]:
    """Load the checkpoint into a fresh model and optimizer at this world size and train ``after`` steps.

    With ``resave``, also save the resumed state there and load it back into another fresh model.
    """
    groups = _groups_for(world, hsdp)
    model, opt = _fresh_llama(groups)
    _load(model, opt, path)
    out: dict[str, Any] = {"lr": opt.param_groups[0]["lr"], "padding_zero": padding_is_zero(model, opt)}
    out["losses"] = train(model, opt, global_batches(before + after, TINY.vocab_size)[before:], rank, world)
    if resave:
        osd = get_optimizer_state_dict(model, opt)
        dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=resave)
        model2, opt2 = _fresh_llama(groups)
        sd2 = _load(model2, opt2, resave)
        out["roundtrip_model"] = all(
            torch.equal(a, b) for a, b in zip(
                get_full_model_state_dict(model, rank0_only=False).values(),
                get_full_model_state_dict(model2, rank0_only=False).values(),
            )
        )
        mine, theirs = full_optimizer_state(osd), full_optimizer_state(get_optimizer_state_dict(model2, opt2))
        out["roundtrip_optim"] = sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
        out["mesh_ndim"] = sd2["model"]["output.weight"].device_mesh.ndim
    groups.destroy()
    return out


# ---------------------------------------------------------------------------------------------
# Uneven shapes: padding never shows
# ---------------------------------------------------------------------------------------------


class OddParams(nn.Module):
    """A 0-d param, a 1-row param (ranks > 0 hold only padding) and 5 rows (2, 2, 1, 0 at 4 ranks)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.25))
        self.row = nn.Parameter(torch.randn(1, 3))
        self.bias = nn.Parameter(torch.randn(5))
        self.vocab = vocab


class OddModel(nn.Module):
    """UnevenModel (vocabulary 1001, width 10: sharded as blocks + body), a unit of odd shapes, an
    unmanaged (frozen) Linear and a root buffer (neither in any unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = UnevenModel()
        self.odd = OddParams(1001)
        self.free = nn.Linear(3, 1001).requires_grad_(False)  # frozen: nothing would keep replicas in sync
        self.register_buffer("shift", torch.full((1001,), 0.01))

    def forward(self, tokens: Tensor) -> Tensor:
        logits = self.body(tokens) * self.odd.temperature + self.free(self.odd.row) + self.shift
        return logits + F.pad(self.odd.bias, (0, logits.shape[-1] - 5))


def build_odd(groups: FsdpGroups, seed: int) -> tuple[nn.Module, nn.Module]:
    """The sharded OddModel and an unsharded copy made before sharding."""
    torch.manual_seed(seed)
    model = OddModel()
    unsharded = copy.deepcopy(model)
    for block in model.body.layers:
        fully_shard(block, groups=groups)
    fully_shard(model.body, groups=groups)
    fully_shard(model.odd, groups=groups)
    return model, unsharded


def save_odd(rank: int, world: int, path: str) -> dict[str, Any]:
    """Shard OddModel, compare the full state dict with the unsharded copy's, train 2 steps, save."""
    groups = FsdpGroups.create()
    model, unsharded = build_odd(groups, seed=0)
    full = get_full_model_state_dict(model)  # unmanaged tensors alias the live ones, as in state_dict()
    out: dict[str, Any] = {"unsharded": unsharded.state_dict(), "full_at_init": {k: v.clone() for k, v in full.items()}}
    opt = adamw(model)
    train(model, opt, global_batches(2, 1001), rank, world)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    out["shapes"] = {k: (type(v).__name__, tuple(v.shape)) for k, v in msd.items()}
    out["model_keys"] = list(model.state_dict())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    out["full"] = get_full_model_state_dict(model)
    out["optim"] = full_optimizer_state(osd)
    groups.destroy()
    return out


def load_odd(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load the OddModel checkpoint into a fresh model (another init) at this world size."""
    groups = FsdpGroups.create()
    model, _ = build_odd(groups, seed=7)
    opt = adamw(model, lr=0.5)
    sd = _load(model, opt, path)
    out = {
        "full": {k: v.clone() for k, v in get_full_model_state_dict(model).items()},
        "optim": full_optimizer_state(get_optimizer_state_dict(model, opt)),
        "padding_zero": padding_is_zero(model, opt),
        "loaded_shapes": {k: tuple(v.shape) for k, v in sd["model"].items()},
    }
    train(model, opt, global_batches(1, 1001), rank, world)  # and it still trains
    out["padding_zero_after_step"] = padding_is_zero(model, opt)
    groups.destroy()
    return out


def at_four_ranks(rank: int, world: int, llama: str, hsdp_resave: str, odd: str) -> dict[str, Any]:
    """Everything the tests run at 4 ranks, in one start-up (4 processes on 2 cores take ~20 s to start):
    resume the llama checkpoint on a 1-D mesh, then as HSDP on a (2, 2) mesh (saving and reloading
    there too), then save the OddModel checkpoint."""
    return {
        "flat": resume(rank, world, llama, BEFORE, AFTER),
        "hsdp": resume(rank, world, llama, BEFORE, AFTER, True, hsdp_resave),
        "odd": save_odd(rank, world, odd),
    }
