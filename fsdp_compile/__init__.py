"""fsdp-compile: fully-sharded data parallelism as a ``torch.compile`` backend."""

from __future__ import annotations

from .accumulate import set_requires_gradient_sync
from .backend import fsdp_backend, make_backend
from .checkpoint import (
    get_full_model_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .groups import Dedicated, FsdpGroups
from .module import FsdpModule
from .grads import ShardGrad
from .sharding import MixedPrecisionPolicy, fully_shard, local_shard
from .stack import BlockStack

__all__ = [
    "BlockStack",
    "Dedicated",
    "FsdpGroups",
    "FsdpModule",
    "MixedPrecisionPolicy",
    "ShardGrad",
    "fsdp_backend",
    "fully_shard",
    "get_full_model_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "local_shard",
    "make_backend",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_requires_gradient_sync",
]
