"""The variants ``benchmarks.step_time`` compares: how one model is sharded and compiled.

A *variant* (``VARIANTS``, ``build_variant``) is fsdp-compile with each communicator layout and schedule
(and the comparisons that take one of its choices back: ``COMPARISONS``), FSDP2 eager or compiled, the
peers of ``benchmarks.baselines`` (SimpleFSDP, Megatron-FSDP), or plain ``torch.compile``. Each builds a
fresh model from a seed (``benchmarks.workloads``) and returns its ``Runner``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks.workloads import ModelSpec, Runner, blocks_of, build_model, stack_blocks
from benchmarks.baselines import PEERS, build_megatron_fsdp, build_simple_fsdp, peer_reason
from fsdp_compile import FsdpGroups, fully_shard, make_backend

__all__ = ["COMPARISONS", "DEFAULT_VARIANTS", "OPTIMIZERS", "VARIANTS", "SharedGroups", "build_variant", "own_forward",
           "raise_recompile_limit", "unavailable_reason"]


VARIANTS: tuple[str, ...] = ("fsdp-compile", "fsdp-compile-whole", "fsdp-compile-bucketed", "fsdp-compile-packed",
                             "fsdp-compile-ag", "fsdp-compile-delayed", "fsdp2-eager",
                             "fsdp2-eager-one-group", "fsdp2-compile", *PEERS, "compile", "fsdp-compile-keep",
                             "fsdp-compile-keep-whole", "fsdp-compile-keep-bucketed", "fsdp-compile-keep-packed",
                             "fsdp-compile-stacked", "fsdp-compile-keep-stacked")
_STACKED = ("fsdp-compile-stacked", "fsdp-compile-keep-stacked")  # one BlockStack (NOTE [stacked blocks])
_KEEP = ("fsdp-compile-keep", "fsdp-compile-keep-whole", "fsdp-compile-keep-bucketed",
         "fsdp-compile-keep-packed", "fsdp-compile-keep-stacked")  # world 1 only
COMPARISONS: tuple[str, ...] = ("fsdp-compile-whole", "fsdp-compile-bucketed", "fsdp-compile-packed",
                                "fsdp-compile-keep-whole", "fsdp-compile-keep-bucketed", "fsdp-compile-keep-packed",
                                *_STACKED)
"""Variants that only take one of fsdp-compile's choices back (see ``_BACKEND_KW``): run when named."""
DEFAULT_VARIANTS: tuple[str, ...] = tuple(v for v in VARIANTS if v not in COMPARISONS)
OPTIMIZERS: tuple[str, ...] = ("fused", "foreach")
_DEDICATED = {"fsdp-compile": "reduce_scatter", "fsdp-compile-whole": "reduce_scatter",
              "fsdp-compile-bucketed": "reduce_scatter",
              "fsdp-compile-packed": "reduce_scatter", "fsdp-compile-ag": "all_gather", "fsdp-compile-delayed": "none",
              "fsdp-compile-stacked": "reduce_scatter",
              **{k: "reduce_scatter" for k in _KEEP}}
_BUCKETED: dict[str, Any] = {"bucket_alone_bytes": None}  # every param bucketed, gathered in place
_PACKED: dict[str, Any] = {"bucket_alone_bytes": None, "inplace_gather": False}  # bucketed, gathered then copied out
_WHOLE: dict[str, Any] = {"outline": False}  # every block inline, one whole-model graph
_BACKEND_KW: dict[str, dict[str, Any]] = {"fsdp-compile-delayed": {"schedule": "delayed"}, "fsdp-compile-whole": _WHOLE,
                                          "fsdp-compile-keep-whole": {"elide_single_rank": False, **_WHOLE},
                                          "fsdp-compile-bucketed": _BUCKETED, "fsdp-compile-packed": _PACKED,
                                          "fsdp-compile-keep": {"elide_single_rank": False},
                                          "fsdp-compile-keep-stacked": {"elide_single_rank": False},
                                          "fsdp-compile-keep-bucketed": {"elide_single_rank": False, **_BUCKETED},
                                          "fsdp-compile-keep-packed": {"elide_single_rank": False, **_PACKED}}


def unavailable_reason(name: str, world: int, device: torch.device | str = "cpu") -> str | None:
    """Why ``name`` cannot run here (the same answer on every rank), or ``None``."""
    if name in PEERS:
        return peer_reason(name, torch.device(device))
    if (name == "compile" or name in _KEEP) and world != 1:
        return f"only at world size 1 (this run: {world})"
    if name == "fsdp2-eager":
        from torch.distributed.fsdp import FSDPModule
        if not hasattr(FSDPModule, "set_separate_reduce_scatter_group"):
            return f"torch {torch.__version__} has no FSDPModule.set_separate_reduce_scatter_group"
    return None


@dataclass
class SharedGroups:
    """Process groups made once per process, in variant order (the same on every rank)."""

    device: torch.device
    world: int
    fsdp: dict[str, FsdpGroups] = field(default_factory=dict)
    mesh: Any = None

    def groups(self, dedicated: str) -> FsdpGroups:
        if dedicated not in self.fsdp:
            self.fsdp[dedicated] = FsdpGroups.create(dedicated=dedicated)
        return self.fsdp[dedicated]

    mesh_2d: Any = None

    def fsdp2_mesh(self) -> Any:
        """The 1-D mesh of FSDP2 and SimpleFSDP."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = init_device_mesh(self.device.type, (self.world,))
        return self.mesh

    def megatron_mesh(self) -> Any:
        """Megatron-FSDP's ``(fsdp, tp)`` mesh, tp of size 1."""
        if self.mesh_2d is None:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh_2d = init_device_mesh(self.device.type, (self.world, 1), mesh_dim_names=("fsdp", "tp"))
        return self.mesh_2d

    def destroy(self) -> None:
        for g in self.fsdp.values():
            g.destroy()


def own_forward(model: nn.Module) -> None:
    """Give ``model`` a ``forward`` with a code object of its own (same code, a distinct object).

    Dynamo keeps state per code object: cache entries, and a "skip this frame" mark when a graph break
    falls inside a loop, as FSDP2 + ``torch.compile(model)`` breaks at every block. With one shared
    ``Transformer.forward``, that mark would make every variant compiled later, or stepped later, run
    its forward eagerly and compile each block apart; with its own code, each variant runs as compiled.
    """
    fn = type(model).forward
    code = fn.__code__.replace()
    model.forward = types.MethodType(  # type: ignore[method-assign]
        types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), model)


def build_variant(name: str, spec: ModelSpec, shared: SharedGroups, seed: int, optimizer: str = "fused") -> Runner:
    """A fresh model from ``seed``, sharded (blocks first, then the root) and compiled as ``name`` says,
    with AdamW in ``optimizer`` form (``"fused"``: one kernel per step; ``"foreach"``: grouped kernels)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"build_variant: optimizer={optimizer!r}; use one of {OPTIMIZERS}")
    fused = optimizer == "fused"
    torch.manual_seed(seed)
    model = build_model(spec, shared.device)
    own_forward(model)
    forward: Callable[..., Any] = model
    if name == "megatron-fsdp":
        units = list(dict.fromkeys(type(b) for b in blocks_of(model)))
        wrapped, opt = build_megatron_fsdp(model, units, shared.megatron_mesh(), lr=1e-5, fused=fused)
        return Runner(name, wrapped, wrapped, opt)
    if name == "simplefsdp":
        forward = build_simple_fsdp(model, shared.fsdp2_mesh())
    elif name in _DEDICATED:
        groups = shared.groups(_DEDICATED[name])
        for block in [stack_blocks(model)] if name in _STACKED else blocks_of(model):
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        forward = torch.compile(model, backend=make_backend(**_BACKEND_KW.get(name, {})))
    elif name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
        mesh = shared.fsdp2_mesh()
        for block in blocks_of(model):
            fsdp2_fully_shard(block, mesh=mesh)
        fsdp2_fully_shard(model, mesh=mesh)
        if name == "fsdp2-eager":
            model.set_separate_reduce_scatter_group()  # type: ignore[operator]
        if name == "fsdp2-compile":
            forward = torch.compile(model)
    elif name == "compile":
        forward = torch.compile(model)
    return Runner(name, model, forward, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused,
                                                          foreach=None if fused else True))


def raise_recompile_limit(n: int) -> None:
    """Variants share the code of nested forwards (blocks, norms), which FSDP2 + compile compiles as frames
    of their own, one cache entry per module type: allow several per variant."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 16 * n))
