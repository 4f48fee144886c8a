"""Every private torch API fsdp-compile uses, in one place (supported: torch >= 2.11).

Where these move between releases, the fallback belongs here and nowhere else. Checked on torch 2.13
(CPU, CI) and 2.11 (CUDA, the H200 machine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._logging._internal import getArtifactLogger

__all__ = [
    "aot_autograd",
    "compile_fx_inner",
    "default_store",
    "getArtifactLogger",
    "inductor_config_patch",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "queue_end_of_backward",
    "resolve_group",
    "select_decomp_table",
]


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group called ``name`` (functional collectives name groups by string)."""
    return dist.distributed_c10d._resolve_process_group(name)


def default_store() -> dist.Store:
    """The key-value store the default process group was initialised with."""
    return dist.distributed_c10d._get_default_store()


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the autograd engine finishes the current backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def inductor_config_patch(changes: dict[str, Any]) -> Any:
    """A context manager applying Inductor config ``changes`` for one compile only."""
    return torch._inductor.config.patch(changes)
