"""Hugging Face checkpoints in and out of a model sharded on the meta device.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, groups=groups)
    fully_shard(model, groups=groups)
    model.to_empty(device="cuda")
    load_pretrained(model, "path/to/save_pretrained_dir")   # rank 0 reads, every rank keeps its rows
    ...train...
    save_pretrained(model, "path/to/out")                   # rank 0 writes; from_pretrained reads it

Rank 0 alone reads the files (NOTE [rank-0 broadcast] in ``full_state.py``). Needs ``safetensors``, so
``import fsdp_compile`` does not load this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_compile.api.checkpoint import get_model_state_dict
from fsdp_compile.api.full_state import broadcast_full_state_dict, raise_on_every_rank

__all__ = ["init_buffers", "load_pretrained", "save_pretrained"]

_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"


def init_buffers(model: nn.Module) -> None:
    """Fill a Hugging Face model's non-persistent buffers after ``to_empty`` (every rank): each module holding
    one goes through ``model._init_weights(module)``, whole (parameters too): call it before loading."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise TypeError(f"init_buffers: {type(model).__name__} has no _init_weights (not a transformers "
                        "PreTrainedModel); fill its non-persistent buffers with its own init method.")
    with torch.no_grad():
        for module in model.modules():
            if module._non_persistent_buffers_set:
                init(module)


def _read(path: Path) -> dict[str, Tensor]:
    """The state dict of a ``save_pretrained`` directory (one safetensors file, or an index of several)."""
    if (path / _WEIGHTS).exists():
        return load_file(str(path / _WEIGHTS))
    if (path / _INDEX).exists():
        files = sorted(set(json.loads((path / _INDEX).read_text())["weight_map"].values()))
        for name in files:
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"load_pretrained: {path / _INDEX} names the shard {name!r}, which lies outside "
                                 f"{path}; an index may only name files in its own directory.")
        state: dict[str, Tensor] = {}
        for name in files:
            state.update(load_file(str(path / name)))
        return state
    raise FileNotFoundError(f"load_pretrained: {path} holds neither {_WEIGHTS} nor {_INDEX}; pass the directory "
                            "save_pretrained wrote (safetensors).")


def load_pretrained(model: nn.Module, path: str | Path, *, strict: bool = True) -> _IncompatibleKeys:
    """Load a ``save_pretrained`` directory into ``model`` (sharded, after ``to_empty``), after
    :func:`init_buffers` (non-persistent buffers are in no checkpoint). Collective."""
    init_buffers(model)
    state: dict[str, Tensor] = {}
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            state = _read(Path(path))
        except Exception as e:  # raised on every rank
            error = e
    raise_on_every_rank(error, f"load_pretrained: reading {path}")
    return broadcast_full_state_dict(model, state, strict, caller="load_pretrained")


def _distinct(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each tensor once (a tied head), contiguous, as ``save_pretrained`` writes it."""
    seen: set[int] = set()
    out = {}
    for name, value in state.items():
        if id(value) not in seen:
            seen.add(id(value))
            out[name] = value.contiguous()
    return out


def save_pretrained(model: nn.Module, path: str | Path, **config_kw: Any) -> None:
    """Write ``model`` (sharded) as ``save_pretrained`` would, from rank 0; collective. ``config_kw`` goes to
    ``config.save_pretrained``."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(out, **config_kw)
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(out)
            save_file(_distinct(state), str(out / _WEIGHTS), metadata={"format": "pt"})
        except Exception as e:  # raised on every rank
            error = e
    raise_on_every_rank(error, f"save_pretrained: writing {path}")  # the barrier: rank 0 has written
