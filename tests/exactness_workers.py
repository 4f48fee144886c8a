"""Models whose blocks are not alike, and the rank function that trains each against eager.

Each pattern builds a model of four blocks of one class that differ (or come to differ after the first
compile) in something the forward does; ``train_patterns`` trains it sharded with the default backend and
unsharded eagerly, step for step, and returns the largest relative difference of the outputs and of the
parameters (NOTE [outlining by proof] in passes/capture/outline.py: the default must be exact on all of them).
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from fsdp_compile import FsdpGroups, fully_shard, get_full_model_state_dict, make_backend
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.examples.models import Transformer, loss_fn

from .workers import TINY, stacked_llama

WIDTH = 8
TABLE: dict[nn.Module, float] = {}  # a module-level table keyed by the block


class Block(nn.Module):
    """Reads, besides its parameters, an activation submodule, a float, a dropout, a config object, a
    list and the table keyed by the block."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.act: nn.Module = nn.Tanh()
        self.mlp: nn.Module = DenseMlp()
        self.drop = nn.Dropout(0.0)
        self.scale = 1.0
        self.shift = 0.0
        self.cfg = types.SimpleNamespace(gain=1.0)
        self.coeffs = [1.0, 0.5]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(x))[..., :WIDTH] * self.scale * self.cfg.gain
        h = self.drop(self.mlp(h)) * self.coeffs[1] + math.copysign(0.25, self.shift)
        return x + h * TABLE.get(self, 1.0)


class DenseMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x))


class ExpertMlp(DenseMlp):
    """The same parameter names and shapes as ``DenseMlp``, another computation (dense vs MoE layers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 2


class NoGradScale(nn.Module):
    """``tanh`` divided by a parameter read under ``torch.no_grad()``, plus one read only detached: those
    parameters get no gradient, and the block's others still do."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((2 * WIDTH,), 2.0))
        self.shift = nn.Parameter(torch.full((2 * WIDTH,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = self.scale.abs().max()
        return torch.tanh(x) / s + self.shift.detach()


def _factory(k: float) -> type[nn.Module]:
    class Scaled(DenseMlp):
        def forward(self, x: torch.Tensor, k: float = k) -> torch.Tensor:
            return self.fc(x) * k

    return Scaled


class Net(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 3


# name -> (change before the first step, change after the first step); each takes the model.
Change = Callable[[Net], object]
PATTERNS: dict[str, tuple[Change | None, Change | None]] = {
    "alike": (None, None),
    "activation-class": (lambda m: setattr(m.blocks[1], "act", nn.ReLU()), None),
    "mlp-class-alternates": (lambda m: [setattr(b, "mlp", ExpertMlp()) for b in m.blocks[1::2]], None),
    "factory-default-argument": (lambda m: [setattr(b, "mlp", _factory(1.0 + i)()) for i, b in enumerate(m.blocks)],
                                 None),
    "hook-on-a-submodule": (lambda m: m.blocks[2].up.register_forward_hook(_hook), None),
    "negative-zero": (lambda m: setattr(m.blocks[2], "shift", -0.0), None),
    "table-keyed-by-block": (lambda m: TABLE.__setitem__(m.blocks[1], 2.0), None),
    # parameters read under no_grad or only detached, or never read: no gradient, as eagerly (weight decay
    # would move them)
    "parameters-read-without-grad": (lambda m: setattr(m.blocks[1], "act", NoGradScale()), None),
    "a-parameter-never-read": (lambda m: m.blocks[2].register_parameter("spare", nn.Parameter(torch.ones(WIDTH))),
                               None),
    "later-float-attribute": (None, lambda m: setattr(m.blocks[3], "scale", 1.5)),
    "later-dropout-p": (None, lambda m: setattr(m.blocks[3].drop, "p", 1.0)),
    "later-submodule-class": (None, lambda m: setattr(m.blocks[3], "act", nn.ReLU())),
    "later-config-field": (None, lambda m: setattr(m.blocks[3].cfg, "gain", 0.5)),
    "later-list-item": (None, lambda m: m.blocks[3].coeffs.__setitem__(1, 2.0)),
    "table-later-value": (lambda m: TABLE.__setitem__(m.blocks[1], 2.0),
                          lambda m: TABLE.__setitem__(m.blocks[1], -1.0)),
    # (Dynamo guards hooks added later only with torch._dynamo.config.skip_nnmodule_hook_guards=False,
    # for plain torch.compile too: the test sets it for this pattern)
    "later-hook": (None, lambda m: m.blocks[3].mlp.register_forward_hook(_hook)),
}


@dataclass
class Run:
    pattern: str
    steps: int = 3
    inductor: bool = False
    backend_kw: dict[str, Any] = field(default_factory=dict)


def _apply(change: Change | None, *models: Net) -> None:
    if change is not None:
        for model in models:
            change(model)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def train_pattern(run: Run, groups: FsdpGroups) -> dict[str, Any]:
    """Train ``run.pattern`` sharded (default backend) and eagerly, ``run.steps`` SGD steps with weight
    decay on one batch; the largest relative difference of outputs and of parameters, the parameters that
    have a gradient in one and not the other after some step, and for each forward compiled, how many
    blocks call each of its outlined bodies."""
    TABLE.clear()
    before, after = PATTERNS[run.pattern]
    torch.manual_seed(0)
    reference = Net()
    _apply(before, reference)
    model = copy.deepcopy(reference)
    if run.pattern.startswith("table"):
        _apply(before, model)  # (keyed by the block: the copy's own entry)
    for block in model.blocks:
        fully_shard(block, groups=groups)
    fully_shard(model, groups=groups)
    compiled = torch.compile(model, backend=make_backend(inductor=run.inductor, **run.backend_kw))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, weight_decay=0.1)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    worst, calls, grads_differ = 0.0, [], set()
    for step in range(run.steps):
        if step == 1:
            _apply(after, reference, model)
        with observe_graphs() as seen:
            out, ref = compiled(x), reference(x)
        calls += [_calls(gm) for kind, gm in seen if kind == "forward"]
        worst = max(worst, _relative(out.detach(), ref.detach()))
        out.square().mean().backward()
        ref.square().mean().backward()
        has_grad = {n.replace("parametrizations.", "").replace(".original", "") for n, p in model.named_parameters()
                    if p.grad is not None}
        grads_differ |= has_grad ^ {n for n, p in reference.named_parameters() if p.grad is not None}
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = get_full_model_state_dict(model, rank0_only=False)
    for name, p in reference.named_parameters():
        worst = max(worst, _relative(full[name], p.detach()))
    return {"worst": worst, "calls": calls, "grads_differ": sorted(grads_differ)}


def _calls(gm: torch.fx.GraphModule) -> list[int]:
    """How many blocks call each outlined body of a graph (NOTE [outlining by proof])."""
    per_body: dict[str, int] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        per_body[str(node.args[1])] = per_body.get(str(node.args[1]), 0) + 1
    return sorted(per_body.values())


def train_patterns(rank: int, world: int, runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Every run of ``runs`` on this rank (one process group for all of them)."""
    groups = FsdpGroups.create()
    out = {}
    for run in runs:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=run.pattern != "later-hook"):
            out[run.pattern + ("-inductor" if run.inductor else "")] = train_pattern(run, groups)
    dist.barrier()
    return out


def _llama() -> tuple[nn.Module, nn.Module]:
    """A 4-block Llama (outlined: one body) and its unsharded copy."""
    torch.manual_seed(0)
    reference = Transformer(TINY.with_(n_layers=4))
    return reference, copy.deepcopy(reference)


def _shard(model: nn.Module, groups: FsdpGroups) -> nn.Module:
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, groups=groups)
    return fully_shard(model, groups=groups)


def _grad_error(model: nn.Module, reference: nn.Module) -> float:
    """The largest relative difference of the sharded model's gradients against the reference's."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    full = get_full_model_state_dict(model, rank0_only=False)
    return max(_relative(full[name], p.grad) for name, p in reference.named_parameters())


# Capture paths of a model of two blocks: name -> (the model, whether its blocks are units, backend options).
CAPTURE_PATHS: dict[str, tuple[Callable[[Any], nn.Module], bool, dict[str, Any]]] = {
    "outlined": (Transformer, True, {}),  # one body for both blocks (NOTE [outlined units])
    "inline": (Transformer, True, {"outline": False}),
    "stacked": (stacked_llama, True, {}),  # one BlockStack (NOTE [stacked blocks])
    "whole-graph": (Transformer, False, {}),  # the root is the only unit
    "outlined-fx": (Transformer, True, {"inductor": False}),
}


def backward_twice(rank: int, world: int, paths: list[str]) -> dict[str, dict[str, Any]]:
    """``loss.backward(retain_graph=True); loss.backward()`` on each capture path of ``CAPTURE_PATHS``,
    after a plain ``backward()`` compiled the backward, and again after a warm start (Dynamo reset, the
    graphs loaded from AOTAutograd's cache: NOTE [no donated buffers]): gradients accumulate five
    times, as eagerly. By path: the largest relative gradient difference, AOTAutograd's cache counters."""
    groups = FsdpGroups.create()
    tokens = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    with fresh_cache():  # one for every path: each path's graphs are its own, the kernels they share are not
        for path in paths:
            build, blocks, backend_kw = CAPTURE_PATHS[path]
            torch._dynamo.reset()
            counters["aot_autograd"].clear()
            torch.manual_seed(0)
            reference = build(TINY)
            model = copy.deepcopy(reference)
            for block in model.layers if blocks else ():
                fully_shard(block, groups=groups)
            fully_shard(model, groups=groups)
            for retain, warm_start in ((False, False), (True, False), (True, True)):
                if warm_start:
                    torch._dynamo.reset()
                if warm_start or not retain:
                    compiled = torch.compile(model, backend=make_backend(**backend_kw))
                for run in (compiled, reference):
                    loss = loss_fn(run(tokens), tokens)
                    if retain:
                        loss.backward(retain_graph=True)
                    loss.backward()
            out[path] = {"error": _grad_error(model, reference),
                         "cache": {k.removeprefix("autograd_cache_"): int(v)
                                   for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache_")}}
    dist.barrier()
    return out


def lengths_per_rank(rank: int, world: int, inductor: bool) -> float:
    """``torch.compile(..., dynamic=True)`` with sequence lengths that differ per rank and per step."""
    reference, model = _llama()
    compiled = torch.compile(_shard(model, FsdpGroups.create()), backend=make_backend(inductor=inductor),
                             dynamic=True)

    def tokens(r: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * r + step)
        return torch.randint(0, TINY.vocab_size, (2, 3 + r + 2 * step), generator=g)

    for step in range(3):
        batch = tokens(rank, step)
        loss_fn(compiled(batch), batch).backward()
        for r in range(world):  # the reference: every rank's batch, the loss averaged over ranks
            batch = tokens(r, step)
            (loss_fn(reference(batch), batch) / world).backward()
    return _grad_error(model, reference)
