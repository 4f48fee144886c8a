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
    "compile_time_metrics",
    "default_store",
    "group_timeout_s",
    "getArtifactLogger",
    "inductor_config_patch",
    "inductor_joint_graph_passes",
    "inductor_pre_grad_passes",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "queue_end_of_backward",
    "register_foreach_type",
    "resolve_group",
    "select_decomp_table",
    "store_connection",
    "timed",
]


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group called ``name`` (functional collectives name groups by string)."""
    return dist.distributed_c10d._resolve_process_group(name)


def default_store() -> dist.Store:
    """The key-value store the default process group was initialised with."""
    return dist.distributed_c10d._get_default_store()


def store_connection(store: dist.Store) -> dist.Store:
    """A second client connection to ``store`` (for a background thread), or ``store`` itself where
    the store cannot be cloned."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except RuntimeError:  # a store type without clone support
        return store


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout, in seconds, that ``group``'s collectives run under (``init_process_group(timeout=)``
    or ``new_group(timeout=)``; the backend's default when none was given)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.distributed_c10d._get_default_timeout(backend).total_seconds())


def register_foreach_type(cls: type) -> None:
    """Let ``torch.nn.utils.clip_grad_norm_`` and friends take their foreach path for tensors of type
    ``cls`` (torch registers ``DTensor`` the same way)."""
    from torch.utils import _foreach_utils

    if cls not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(cls)


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the autograd engine finishes the current backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def inductor_config_patch(changes: dict[str, Any]) -> Any:
    """A context manager applying Inductor config ``changes`` for one compile only."""
    return torch._inductor.config.patch(changes)


def _on_meta(inputs: Any) -> bool:
    # Inductor's graph passes fold meta-device computations away entirely (nothing is computed on
    # meta): ``explain`` traces on meta and must keep the graph as written.
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves)


def inductor_pre_grad_passes(gm: Any, example_inputs: Any) -> Any:
    """Inductor's pre-grad passes on a Dynamo graph, as ``torch.compile``'s Inductor runs them."""
    from torch._inductor import compile_fx as _fx

    if _on_meta(example_inputs):
        return gm
    if hasattr(_fx, "_recursive_pre_grad_passes"):
        return _fx._recursive_pre_grad_passes(gm, example_inputs)
    return _fx.pre_grad_passes(gm, example_inputs)  # type: ignore[attr-defined]


def inductor_joint_graph_passes(joint: Any, joint_inputs: Any) -> Any:
    """Inductor's joint-graph passes (before partitioning), as its own partition function runs them."""
    from torch._inductor import compile_fx as _fx
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    if _on_meta(joint_inputs):
        return joint
    devices = [t.device for t in torch.utils._pytree.tree_leaves(joint_inputs) if isinstance(t, torch.Tensor)]
    device = devices[0] if devices else None
    recursive = getattr(_fx, "_recursive_joint_graph_passes", None)
    if recursive is not None:
        try:
            return recursive(joint, skip_invoke_subgraph=True, input_device=device)
        except TypeError:  # older signature
            return recursive(joint)
    return joint_graph_passes(joint)


def timed(key: str) -> Any:
    """A context manager adding its duration to torch.compile's timing table under ``key`` (it shows in
    ``torch._dynamo.utils.compile_times()``, tlparse and :func:`compile_time_metrics`)."""
    from torch._dynamo.utils import dynamo_timed

    return dynamo_timed(key)


def compile_time_metrics() -> dict[str, float]:
    """Seconds spent so far in this process under each ``dynamo_timed`` key (Dynamo, AOTAutograd,
    Inductor and :func:`timed`), summed over compiles."""
    from torch._dynamo.utils import compilation_time_metrics

    return {key: float(sum(values)) for key, values in compilation_time_metrics.items()}
