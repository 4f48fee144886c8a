"""fsdp-compile: fully-sharded data parallelism as a ``torch.compile`` backend."""

from __future__ import annotations

from .backend import fsdp_backend, make_backend
from .groups import Dedicated, FsdpGroups
from .sharding import MixedPrecisionPolicy, fully_shard

__all__ = ["Dedicated", "FsdpGroups", "MixedPrecisionPolicy", "fsdp_backend", "fully_shard", "make_backend"]
