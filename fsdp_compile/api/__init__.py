"""What the user calls: groups, fully_shard, sharded parameters, gradients, accumulation, checkpoints."""

from __future__ import annotations

import importlib
from types import ModuleType

_ON_FIRST_USE = ("hf",)  # needs safetensors: loaded when first named


def __getattr__(name: str) -> ModuleType:
    """``fsdp_compile.api.hf`` after a plain ``import fsdp_compile`` (PEP 562)."""
    if name in _ON_FIRST_USE:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
