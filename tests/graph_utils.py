"""Compile a model under the fake process group and collect the graphs handed to Inductor."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from expecttest import TestCase
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compile import FsdpGroups, fully_shard, make_backend
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.inspection.schedule import group_labels, listing
from fsdp_compile.examples.models import ModelConfig
import fsdp_compile.passes.graph_ops  # noqa: F401  (registers torch.ops.fsdp.copy_out_rows)
from fsdp_compile.passes.predicates import is_all_gather, is_reduce_scatter, is_wait

SMALL = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=16, max_seq_len=8)


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0) -> Iterator[None]:
    """A fake default process group (no communication) of ``world_size`` ranks, this process ``rank``."""
    assert not dist.is_initialized()
    torch._dynamo.reset()  # every test compiles new module instances: start below the recompile limit
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class FakeWorldTestCase(TestCase):
    """A test case run inside ``fake_process_group(world_size)``."""

    world_size = 2

    def setUp(self) -> None:
        self.enterContext(fake_process_group(self.world_size))


class ThreeUnits(nn.Module):
    """Three linear units: the model the schedule snapshots are taken on."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def shard_blocks_then_root(model: nn.Module, groups: FsdpGroups, **kw: Any) -> nn.Module:
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, groups=groups, **kw)
    fully_shard(model, groups=groups, **kw)
    return model


def capture(model: nn.Module, example: torch.Tensor, **backend_kw: Any) -> dict[str, fx.GraphModule]:
    """Run one forward+backward of ``model`` compiled with our backend; return its graphs by kind."""
    backend_kw.setdefault("inductor", False)
    compiled = torch.compile(model, backend=make_backend(**backend_kw), fullgraph=True)
    with observe_graphs() as seen:
        out = compiled(example)
        if out.requires_grad:
            out.float().sum().backward()
    return dict(seen)


class ScheduleCase(FakeWorldTestCase):
    """Compiles ``ThreeUnits`` (three ``Linear(8, 8)`` units) and lists the forward and backward schedules."""

    def schedule(self, dedicated: str = "reduce_scatter", shard_kw: dict[str, Any] | None = None,
                 no_sync: bool = False, **backend_kw: Any) -> tuple[str, str]:
        groups = FsdpGroups.create(dedicated=dedicated)
        torch.manual_seed(0)
        model = shard_blocks_then_root(ThreeUnits(), groups, **(shard_kw or {}))
        if no_sync:
            model.set_requires_gradient_sync(False)
        graphs = capture(model, torch.randn(4, 8), **backend_kw)
        labels = group_labels(groups)
        return listing(graphs["forward"], labels), listing(graphs["backward"], labels)


def collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_all_gather(n) or is_reduce_scatter(n)]


def gathered_values(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value is (a view or cast of) an all-gather's result."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if is_wait(n) and is_all_gather(n.args[0]):
            out.add(n)
        elif n.op == "call_function" and any(isinstance(a, fx.Node) and a in out for a in n.args) and _is_view(n):
            out.add(n)
    return out


def _is_view(n: fx.Node) -> bool:
    target = getattr(n.target, "overloadpacket", None)
    return target in {
        torch.ops.aten.view, torch.ops.aten.slice, torch.ops.aten.reshape, torch.ops.aten.permute,
        torch.ops.aten.t, torch.ops.aten._unsafe_view, torch.ops.aten.expand, torch.ops.aten.clone,
        torch.ops.aten.split_with_sizes, torch.ops.aten.select, torch.ops.prims.convert_element_type,
        torch.ops.aten._to_copy, torch.ops.aten.as_strided,
        torch.ops.fsdp.copy_out_rows,  # a bucket's members, copied out (NOTE [bucket copies])
    } or n.target is operator.getitem
