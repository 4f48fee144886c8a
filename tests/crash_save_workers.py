"""Rank functions for tests/test_crash_save.py: a rank killed (SIGKILL) during a checkpoint save.

The kill comes from a patch inside this worker, at one of two moments of ``dcp.save`` on the victim
rank: ``"writing"``, after the first item of its file is written and flushed (its file is truncated);
``"before-open"``, as its storage writer starts, before it opens its file (the file is missing).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch import nn

from fsdp_compile import (FsdpGroups, fully_shard, get_model_state_dict, get_optimizer_state_dict,
                          latest_checkpoint, save_checkpoint, set_model_state_dict, set_optimizer_state_dict)

VICTIM = 1


def _kill_while_writing() -> None:
    original = dcp_fs._write_item
    written = [0]

    def write_item(transforms: Any, stream: Any, *args: Any, **kw: Any) -> Any:
        result = original(transforms, stream, *args, **kw)
        written[0] += 1
        if written[0] == 1:
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp_fs._write_item = write_item


def _kill_before_open() -> None:
    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    dcp_fs.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


def _build(groups: FsdpGroups) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer, groups=groups)
    fully_shard(model, groups=groups)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "step": torch.tensor(step)}


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards and optimizer state, copied."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optim": [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]}


def crash_during_save(rank: int, world: int, root: str, kill: str | None) -> None:
    """Save step 1 (complete), keep this rank's values beside it, train a step and save step 2 while
    ``kill`` (``None``: nobody) kills the victim."""
    groups = FsdpGroups.create()
    model, opt = _build(groups)
    _train(model, opt, 0)
    save_checkpoint(_state(model, opt, 1), root, 1)
    torch.save(_values(model, opt), Path(root) / f"expected-{rank}.pt")
    _train(model, opt, 1)
    if rank == VICTIM and kill == "writing":
        _kill_while_writing()
    elif rank == VICTIM and kill == "before-open":
        _kill_before_open()
    save_checkpoint(_state(model, opt, 2), root, 2)


def resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Fresh ranks resume from the newest complete checkpoint; whether they hold exactly what was saved
    at step 1; then step 2 is saved again, over what the crash left."""
    groups = FsdpGroups.create()
    model, opt = _build(groups)
    ckpt = latest_checkpoint(root)
    assert ckpt is not None
    state = _state(model, opt, 0)
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    expected = torch.load(Path(root) / f"expected-{rank}.pt")
    got = _values(model, opt)
    same_params = all(torch.equal(a, b) for a, b in zip(got["params"], expected["params"]))
    same_optim = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                     for a, b in zip(got["optim"], expected["optim"]))
    _train(model, opt, 1)
    save_checkpoint(_state(model, opt, 2), root, 2)
    return {"checkpoint": os.path.basename(ckpt), "step": int(state["step"]), "same_params": same_params,
            "same_optim": same_optim, "latest_after": os.path.basename(latest_checkpoint(root) or ""),
            "dirs_after": sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step-"))}
