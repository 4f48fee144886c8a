"""The other FSDPs that ``benchmarks.step_time`` runs beside fsdp-compile (``pip install -e '.[bench]'``).

* ``simplefsdp``: torchtitan's SimpleFSDP (``data_parallel(model, mesh, mode="fully_shard")``: every
  parameter a ``Shard(0)`` DTensor, read through a parametrization that redistributes it to
  ``Replicate``), compiled as one graph with the settings torchtitan's ``graph_passes="auto_bucketing"``
  uses with the Inductor backend: gathered params tagged must-recompute in the joint graph (reshard
  after forward), Inductor's ``schedule_overlap_bucketing`` as the post-grad pass with collective
  bucketing on and overlap dependencies inserted, and ``reorder_for_peak_memory``,
  ``reorder_for_compute_comm_overlap`` and ``allow_buffer_reuse`` off. Only the ``simple_fsdp.py`` file
  is loaded, by path: torchtitan's top package imports its trainer's dependencies (tyro, datasets, ...).
  torchtitan 0.2.2 sets ``aten_distributed_optimizations.collective_bucketing / insert_overlap_deps``
  and then calls ``schedule_overlap_bucketing(gm)`` with its defaults; here the two settings are passed
  to it explicitly, so bucketing and the overlap dependencies are on whatever those defaults are.
* ``megatron-fsdp``: NVIDIA's Megatron-FSDP (``fully_shard_model`` with each block class an FSDP unit,
  ``zero_dp_strategy=3``; ``fully_shard_optimizer``). ``main_params_dtype=None``: the model's own
  (bf16 or fp32) weights are the optimizer's, as for every other variant, instead of an extra fp32
  copy. It needs CUDA (its buffers and side streams are ``torch.cuda`` ones).

Each ``*_reason`` function says why a peer cannot run here (the same answer on every rank), or ``None``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["PEERS", "peer_reason", "build_simple_fsdp", "build_megatron_fsdp", "simple_fsdp_inductor_options"]

PEERS = ("simplefsdp", "megatron-fsdp")

c10d = torch.ops._c10d_functional


# --- SimpleFSDP ---------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _simple_fsdp_module() -> ModuleType:
    """``torchtitan/experiments/simple_fsdp/simple_fsdp.py``, loaded by path (it imports only torch)."""
    spec = importlib.util.find_spec("torchtitan")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("torchtitan is not installed: pip install -e '.[bench]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "experiments" / "simple_fsdp" / "simple_fsdp.py"
    if not path.exists():
        raise ModuleNotFoundError(f"this torchtitan has no {path}; install torchtitan==0.2.2")
    name = "_bench_simple_fsdp"
    file_spec = importlib.util.spec_from_file_location(name, path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    sys.modules[name] = module  # Dynamo looks its classes' module up by name
    return module


def _from_graph_input(node: fx.Node) -> bool:
    """``placeholder -> (one-input op)* -> node``: an all-gather of a parameter, safe to re-run later."""
    n = node
    while len(n.all_input_nodes) == 1:
        n = n.all_input_nodes[0]
        if n.op == "placeholder":
            return True
    return False


def _tag_recompute(node: fx.Node) -> None:
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = 1 << 30  # above every activation-checkpoint region (see partition._AC_GRAPH_ID)


def reshard_after_forward_pass(joint: fx.GraphModule) -> fx.GraphModule:
    """Joint-graph pass: tag each parameter all-gather (with its wait, the cast before it and the slices
    after it) must-recompute, so forward keeps shards and backward gathers again (torchtitan's default
    ``fsdp_reshard_after_forward`` without pipeline parallelism)."""
    for wait in joint.graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
        gather = wait.args[0]
        if not (isinstance(gather, fx.Node) and gather.target is c10d.all_gather_into_tensor.default):
            continue
        if not _from_graph_input(wait):
            continue
        _tag_recompute(gather)
        _tag_recompute(wait)
        source = gather.all_input_nodes[0]
        if source.op == "call_function" and source.target is torch.ops.prims.convert_element_type.default:
            _tag_recompute(source)
        for user in wait.users:
            if user.op == "call_function" and user.target is torch.ops.aten.slice.Tensor:
                _tag_recompute(user)
    joint.recompile()
    return joint


class _OverlapBucketing(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor's post-grad pass: ``schedule_overlap_bucketing`` with bucketing and overlap deps on.

    ``compute_estimator``: ``"benchmark"`` (Inductor's default: compute nodes timed on the GPU) on CUDA;
    on CPU, where that needs Triton, ``"analytical"`` (roofline estimates)."""

    def __init__(self, compute_estimator: str = "benchmark") -> None:
        self.compute_estimator = compute_estimator

    def __call__(self, graph: fx.Graph) -> None:
        from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing
        kwargs: dict[str, Any] = {"collective_bucketing": True, "insert_overlap_deps": True}
        if "compute_estimator" in inspect.signature(schedule_overlap_bucketing).parameters:  # not in torch 2.11
            kwargs["compute_estimator"] = self.compute_estimator
        schedule_overlap_bucketing(graph.owning_module, **kwargs)

    def uuid(self) -> str:
        return f"fsdp-compile-bench-simplefsdp-auto-bucketing-{self.compute_estimator}"


def simple_fsdp_inductor_options(device_type: str = "cuda") -> dict[str, Any]:
    """Inductor settings of torchtitan's ``graph_passes="auto_bucketing"`` (inductor backend), as
    ``torch.compile(options=...)``: applied to this compile only, backward included."""
    estimator = "benchmark" if device_type == "cuda" else "analytical"
    return {
        "reorder_for_peak_memory": False,
        "reorder_for_compute_comm_overlap": False,
        "allow_buffer_reuse": False,
        "post_grad_custom_post_pass": _OverlapBucketing(estimator),
    }


def _simple_fsdp_backend(device_type: str) -> Callable[..., Any]:
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    options = simple_fsdp_inductor_options(device_type)

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        with functorch_config.patch(joint_custom_pass=lambda g, _inputs: reshard_after_forward_pass(g)):
            return compile_fx(gm, example_inputs, config_patches=options)

    return backend


def build_simple_fsdp(model: nn.Module, mesh: Any) -> Callable[..., Any]:
    """Shard ``model`` in place with SimpleFSDP on a 1-D ``mesh``; return its compiled forward."""
    _simple_fsdp_module().data_parallel(model, mesh, mode="fully_shard")
    return torch.compile(model, backend=_simple_fsdp_backend(mesh.device_type), fullgraph=True)


def simple_fsdp_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return ("Inductor's schedule_overlap_bucketing (torchtitan's auto_bucketing) needs CUDA and Triton: it "
                "estimates compute from Triton's GPU memory bandwidth, even with the analytical estimator")
    try:
        _simple_fsdp_module()
    except (ImportError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    from torch._functorch import config as functorch_config
    if not hasattr(functorch_config, "joint_custom_pass"):
        return f"torch {torch.__version__} has no torch._functorch.config.joint_custom_pass"
    try:
        from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no Inductor overlap_scheduling pass"
    return None


# --- Megatron-FSDP --------------------------------------------------------------------------------------


def megatron_fsdp_reason(device: torch.device) -> str | None:
    if importlib.util.find_spec("megatron_fsdp") is None:
        return "megatron_fsdp is not installed: pip install -e '.[bench]'"
    if device.type != "cuda":
        return "Megatron-FSDP runs on CUDA only (its gradient/parameter buffers and side streams are torch.cuda's)"
    return None


def build_megatron_fsdp(model: nn.Module, unit_types: list[type[nn.Module]], mesh: Any,
                        lr: float, fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """ZeRO-3 Megatron-FSDP of ``model`` (units: modules of ``unit_types``) on a 2-D ``(fsdp, tp=1)``
    ``mesh``; returns the wrapped model and its AdamW, both extended by Megatron-FSDP."""
    import megatron_fsdp

    wrapped = megatron_fsdp.fully_shard_model(
        module=model, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp", fsdp_unit_modules=unit_types,
        zero_dp_strategy=3, mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=None),
    )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=lr, fused=fused)
    return wrapped, megatron_fsdp.fully_shard_optimizer(opt)


def peer_reason(name: str, device: torch.device) -> str | None:
    """Why peer ``name`` cannot run on ``device`` (missing package, no CUDA, old torch), or ``None``."""
    if name == "simplefsdp":
        return simple_fsdp_reason(device)
    if name == "megatron-fsdp":
        return megatron_fsdp_reason(device)
    raise ValueError(f"peer_reason: unknown peer {name!r}; known: {PEERS}")
