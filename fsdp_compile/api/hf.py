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

Rank 0 alone reads the safetensors files; the tensors reach the other ranks one at a time (NOTE
[rank-0 broadcast] in ``full_state.py``). Non-persistent buffers (the rotary ``inv_freq``) are in no
checkpoint: ``to_empty`` leaves them uninitialised, and :func:`init_buffers` recomputes them through the
model's own ``_init_weights``. A tied output head (``tie_word_embeddings``) stays one parameter through
``to_empty`` (NOTE [converted parameters] in ``materialize.py``) and is written once, as
``save_pretrained`` writes it. ``safetensors`` (which ``transformers`` installs) is needed only here: ``import fsdp_compile`` does not
load this module.
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
    """Fill the non-persistent buffers of a Hugging Face model after ``to_empty`` (on every rank): each
    module holding one goes through ``model._init_weights(module)``, the model's own init (the rotary
    embedding's recomputes ``inv_freq``). A module with parameters too is initialised whole: call this
    before loading weights."""
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
    """Load a ``save_pretrained`` directory into ``model`` (sharded, after ``to_empty``): rank 0 reads the
    safetensors, every rank keeps its rows; the non-persistent buffers are recomputed first
    (:func:`init_buffers`). Call it on every rank."""
    init_buffers(model)
    state: dict[str, Tensor] = {}
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            state = _read(Path(path))
        except Exception as e:  # every rank raises it, not rank 0 alone (the others would wait for it)
            error = e
    raise_on_every_rank(error, f"load_pretrained: reading {path}")
    return broadcast_full_state_dict(model, state, strict, caller="load_pretrained")


def _distinct(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the second and later names of one tensor (a tied head), as ``save_pretrained``
    writes it, each tensor contiguous (safetensors' requirement)."""
    seen: set[int] = set()
    out = {}
    for name, value in state.items():
        if id(value) not in seen:
            seen.add(id(value))
            out[name] = value.contiguous()
    return out


def save_pretrained(model: nn.Module, path: str | Path, **config_kw: Any) -> None:
    """Write ``model`` (sharded) as ``save_pretrained`` would: ``config.json`` (plus
    ``generation_config.json`` where the model has one) and ``model.safetensors`` of the full weights.
    Every rank gathers each parameter in turn; rank 0 alone holds the full state dict (on the CPU) and
    writes. ``config_kw`` goes to ``config.save_pretrained``."""
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
        except Exception as e:  # every rank raises it, not rank 0 alone (the others wait here)
            error = e
    raise_on_every_rank(error, f"save_pretrained: writing {path}")  # the barrier: rank 0 has written
