"""fsdp-compile: fully-sharded data parallelism as a ``torch.compile`` backend."""

from __future__ import annotations

from fsdp_compile.api.accumulate import set_requires_gradient_sync
from fsdp_compile.compiler.backend import fsdp_backend, make_backend
from fsdp_compile.api.checkpoint import (
    get_full_model_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from fsdp_compile.api.checkpoint_dirs import latest_checkpoint, save_checkpoint
from fsdp_compile.api.groups import Dedicated, FsdpGroups
from fsdp_compile.api.module import FsdpModule
from fsdp_compile.api.grads import ShardGrad
from fsdp_compile.api.sharding import MixedPrecisionPolicy, fully_shard, local_shard
from fsdp_compile.api.stack import BlockStack

__all__ = [
    "BlockStack", "Dedicated", "FsdpGroups", "FsdpModule", "MixedPrecisionPolicy", "ShardGrad", "fsdp_backend",
    "fully_shard", "get_full_model_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
    "latest_checkpoint", "local_shard", "make_backend", "save_checkpoint", "set_model_state_dict",
    "set_optimizer_state_dict", "set_requires_gradient_sync",
]


def __getattr__(name: str) -> object:
    """``fsdp_compile.emulate`` after a plain ``import fsdp_compile``, loaded when first named (PEP 562)."""
    if name == "emulate":
        import importlib

        return importlib.import_module(f"{__name__}.emulate")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
