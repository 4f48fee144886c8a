"""Stamped blocks (NOTE [stamped blocks] in fsdp_compile/stamp.py, NOTE [stamped calls] in passes/stamp.py):
Dynamo traces the first outlined block and stamps the alike ones out of that trace, on every torch where
this is forced on (the default on torch 2.11, whose Dynamo traces every block). What is checked: later
blocks are one op each in Dynamo's graph, the backend's graphs are those of tracing every block, a block
that is not alike (an attribute its forward reads, its mode, a call's constant argument) is traced on its
own, and a change to one block after compiling recompiles, with eager numbers each time."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from fsdp_compile import FsdpGroups, _compat, make_backend, stamp
from fsdp_compile.backend import observe_graphs
from fsdp_compile.models import Transformer
from fsdp_compile.module import OUTLINES
from fsdp_compile.stamp_guards import source_name
from passes.stamp import stamp_out_pass

from .graph_utils import SMALL, fake_process_group, shard_blocks_then_root
from .workers import force_stamping, sharded_grads

invoke_subgraph = torch.ops.higher_order.invoke_subgraph


@pytest.fixture(autouse=True)
def stamping() -> Iterator[None]:
    """Stamping forced on (on torch 2.13 too, with its Dynamo's inlining of bodies called once off)."""
    with force_stamping():
        yield


def _stamped(gm: fx.GraphModule) -> int:
    return sum(n.op == "call_function" and str(n.target) == "fsdp.stamped.default" for n in gm.graph.nodes)


def _calls(gm: fx.GraphModule) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=invoke_subgraph))


def _counting(counts: list[tuple[int, int]], **backend_kw: object) -> object:
    """Our backend, first noting each graph's calls of a body and stamped calls as Dynamo hands it over."""
    ours = make_backend(**backend_kw)

    def backend(gm: fx.GraphModule, example: list[torch.Tensor]) -> object:
        counts.append((_calls(gm), _stamped(gm)))
        return ours(gm, example)

    setattr(backend, OUTLINES, True)  # (it is ours: NOTE [regions for our backend only])
    return backend


def _dynamo_graphs(model: nn.Module, *inputs: torch.Tensor) -> list[tuple[int, int, fx.GraphModule]]:
    """For each graph Dynamo hands a backend for ``model(*inputs)``: its calls of a body and its stamped
    calls, then the graph after ``stamp_out_pass``."""
    graphs: list[tuple[int, int, fx.GraphModule]] = []

    def keep(gm: fx.GraphModule, example: list[torch.Tensor]) -> object:
        counts = _calls(gm), _stamped(gm)
        graphs.append((*counts, stamp_out_pass(gm)))  # (a stamped op only runs as its template's body)
        return gm.forward

    setattr(keep, OUTLINES, True)  # trace as for fsdp_backend (NOTE [regions for our backend only])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=keep, fullgraph=True)(*inputs)
    return graphs


def test_later_blocks_are_one_op_each_and_the_backend_sees_every_call() -> None:
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
    with fake_process_group(2):
        torch.manual_seed(0)
        model = shard_blocks_then_root(Transformer(SMALL.with_(n_layers=4)), FsdpGroups.create())
        ((traced, stamped, gm),) = _dynamo_graphs(model, tokens)
        assert (traced, stamped) == (1, 3)  # block 0 traced; 1, 2, 3 stamped out of its trace
        assert (_calls(gm), _stamped(gm)) == (4, 0)
        assert len({n.args[0].target for n in gm.graph.find_nodes(op="call_function", target=invoke_subgraph)}) == 1


def _scheduled(stamp: bool) -> list[str]:
    _compat.STAMP_REGIONS = stamp
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with fake_process_group(2):
        torch.manual_seed(0)
        model = shard_blocks_then_root(Transformer(SMALL.with_(n_layers=3)), FsdpGroups.create())
        with observe_graphs() as seen, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(model, backend=make_backend(inductor=False), fullgraph=True)(tokens).sum().backward()
        return [f"{kind}\n{gm.code}" for kind, gm in seen]


def test_the_scheduled_graphs_are_those_of_tracing_every_block() -> None:
    """The forward and backward graphs the passes hand to Inductor are the same text either way."""
    assert _scheduled(True) == _scheduled(False)


class Gate(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.shift = 0  # read by the forward: blocks with another shift are not alike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.proj(x)) * torch.roll(x, self.shift, dims=-1)
        return h * 2.0 if self.training else h


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.gate = Gate(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, tanh: bool = True) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.gate(x)))
        h = self.down(h) * scale
        return x + (torch.tanh(h) if tanh else torch.relu(h)) * 0.5


class Stack(nn.Module):
    def __init__(self, n: int = 5, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)  # (every block's input then requires grad, as in a transformer)
        self.layers = nn.ModuleList(Block(width) for _ in range(n))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.tanh = [True] * n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer, tanh in zip(self.layers, self.tanh):
            x = layer(x, self.scale, tanh=tanh)
        return x


def _twins(cls: Callable[[], Stack], alter: Callable[[Stack], None] = lambda m: None) -> tuple[Stack, Stack, nn.Module, list]:
    """A model of ``cls`` sharded (one rank) and compiled by our backend counting its calls, and its
    unsharded reference with the same weights; ``alter`` changes both alike before sharding."""
    torch.manual_seed(0)
    reference, model = cls(), cls()
    model.load_state_dict(reference.state_dict())
    for m in (model, reference):
        alter(m)
    shard_blocks_then_root(model, FsdpGroups.create())
    graphs: list[tuple[int, int]] = []  # (calls traced, calls stamped) of each graph compiled
    return model, reference, torch.compile(model, backend=_counting(graphs)), graphs


def _check(model: nn.Module, reference: nn.Module, compiled: nn.Module, x: torch.Tensor) -> None:
    """``compiled`` (sharded ``model``) gives ``reference``'s output and gradients."""
    for m in (model, reference):
        for p in m.parameters():
            p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(x)
        out.square().sum().backward()
    expected = reference(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    grads = sharded_grads(model)  # (one rank: each shard is its whole parameter)
    assert sorted(grads) == sorted(n for n, _ in reference.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_only_alike_blocks_are_stamped_and_a_change_to_one_recompiles() -> None:
    """One rank (real numbers): blocks differing in an attribute their forward reads, in their mode, or
    in a constant argument of their call are traced on their own; the others are stamped; and changing a
    stamped block afterwards (its attribute, its mode) recompiles instead of running the template's code."""
    x = torch.randn(4, 8)
    with fake_process_group(1):
        def unalike(m: Stack) -> None:
            m.layers[1].gate.shift = 1     # an attribute the forward reads
            m.layers[3].gate.eval()        # its mode
            m.tanh[4] = False              # a constant argument of its call

        model, reference, compiled, graphs = _twins(Stack, unalike)
        _check(model, reference, compiled, x)
        # block 0 traced, 1 traced (shift), 2 stamped, 3 traced (eval), 4 traced (tanh=False)
        assert graphs == [(4, 1)]
        # a stamped block changed after compiling: its moved guards fail, so Dynamo traces again
        for m in (model, reference):
            m.layers[2].gate.shift = 2
        _check(model, reference, compiled, x)
        assert len(graphs) == 2
        for m in (model, reference):
            m.layers[2].train(False)
        _check(model, reference, compiled, x)
        assert len(graphs) == 3
        _check(model, reference, compiled, x)  # and nothing more compiles
        assert len(graphs) == 3


class _Halved(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 0.5


def test_a_stamped_block_whose_weight_gains_a_parametrization_is_traced_again() -> None:
    """A stamped call reads the block's shards from one tuple (``stamp._readers``); a parametrization added
    to one of its weights after compiling takes that weight off the shard's lean read: the block is traced
    again and reads the new weight, its alike neighbours are stamped still."""
    x = torch.randn(4, 8)
    with fake_process_group(1):
        model, reference, compiled, graphs = _twins(lambda: Stack(n=3))
        _check(model, reference, compiled, x)
        assert graphs == [(1, 2)]
        for m in (model, reference):
            parametrize.register_parametrization(m.layers[1].down, "weight", _Halved(), unsafe=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(compiled(x), reference(x))
        assert graphs == [(1, 2), (2, 1)]  # block 0 traced, block 1 traced apart, block 2 stamped


def test_a_stamped_blocks_guards_leave_out_what_sharding_fixed() -> None:
    """NOTE [guards fixed by sharding]: where a read finds its piece (flat, offset, shape, the marker's
    arguments) is checked on each stamped block but not guarded there; what a user can change on one
    block (its reads' entries, ``accumulating``, hooks, attributes) is."""
    moved: list[str] = []
    real = stamp.check_and_move

    def spy(*args: object) -> list:
        guards = real(*args)
        moved.extend(source_name(g.originating_source) for g in guards)
        return guards

    x = torch.randn(4, 8)
    with fake_process_group(1), pytest.MonkeyPatch.context() as mp:
        mp.setattr(stamp, "check_and_move", spy)
        model, reference, compiled, graphs = _twins(lambda: Stack(n=3))
        _check(model, reference, compiled, x)
    assert graphs == [(1, 2)] and moved
    fixed = [g for g in moved if re.search(r"_fsdp_reads\['\w+'\]\.(flat|shard|offset|piece_shape|traced_args)$", g)]
    assert fixed == []
    assert any(g.endswith("_fsdp_reads['weight'].accumulating") for g in moved)
    assert any(g.endswith("_fsdp_reads['weight']") for g in moved)
    assert any(g.endswith("._forward_hooks") for g in moved)


def test_one_block_accumulating_after_compiling_is_traced_apart() -> None:
    """A unit's ``accumulating`` (NOTE [no-sync]) stays guarded on every stamped block: one block
    switched to accumulate after compiling compiles again, traced apart, and gives the same numbers."""
    x = torch.randn(4, 8)
    with fake_process_group(1):
        model, reference, compiled, graphs = _twins(lambda: Stack(n=3))
        _check(model, reference, compiled, x)
        assert graphs == [(1, 2)]
        model.layers[1].set_requires_gradient_sync(False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(compiled(x), reference(x))
        assert graphs == [(1, 2), (2, 1)]  # block 0 traced, block 1 (accumulating) traced apart, 2 stamped


class ScaledBlock(Block):
    """A block holding a parameter itself (a layer scale), not only through its submodules: sharded, the
    block's own class is parametrize's class for it, one per block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__(width)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.0, width))

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, tanh: bool = True) -> torch.Tensor:
        return x + (super().forward(x, scale, tanh=tanh) - x) * self.gamma


class ScaledStack(Stack):
    def __init__(self, n: int = 3, width: int = 8) -> None:
        super().__init__(n, width)
        self.layers = nn.ModuleList(ScaledBlock(width) for _ in range(n))


def test_blocks_holding_a_parameter_themselves_are_stamped() -> None:
    """Each block's class is then one of its own, made alike (``_alike_classes`` compares bases as
    classes made alike too); its stamped calls read its own ``gamma``."""
    x = torch.randn(4, 8)
    with fake_process_group(1):
        model, reference, compiled, graphs = _twins(ScaledStack, lambda m: m.layers[2].gamma.data.mul_(3.0))
        assert type(model.layers[0]) is not type(model.layers[1])
        _check(model, reference, compiled, x)
        assert graphs == [(1, 2)]  # block 0 traced, 1 and 2 stamped (2 with its own gamma)


class Broken(Stack):
    """A graph break between blocks: the blocks after it are another graph, with templates of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers[:2]:
            x = layer(x, self.scale)
        torch._dynamo.graph_break()
        for layer in self.layers[2:]:
            x = layer(x, self.scale)
        return x


def test_a_graph_break_between_blocks_starts_afresh() -> None:
    x = torch.randn(4, 8)
    with fake_process_group(1):
        model, reference, compiled, graphs = _twins(Broken)
        _check(model, reference, compiled, x)
        # before the break: block 0 traced, block 1 stamped; after it: block 2 traced, 3 and 4 stamped
        assert graphs == [(1, 1), (1, 2)], graphs


def test_inspecting_blocks_never_gathers_a_parameter() -> None:
    """Re-reading guards runs on one rank alone: a sharded parameter read there must raise, not gather
    (an eager all-gather the other ranks never make would hang them)."""
    from fsdp_compile.reads import EagerReadRefused, no_eager_reads

    with fake_process_group(2):
        model = shard_blocks_then_root(Stack(n=2), FsdpGroups.create())
        with no_eager_reads(), pytest.raises(EagerReadRefused):
            model.layers[0].up.weight
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the slow path's warning)
            assert model.layers[0].up.weight.shape == (16, 8)  # outside it, an eager read gathers again


def test_blocks_with_hooks_of_their_own_are_stamped() -> None:
    """Mixed precision casts at each block's boundary with forward hooks of its own, whose dict keys (hook
    ids) differ from block to block: the moved guards read each block's own keys."""
    from fsdp_compile import MixedPrecisionPolicy

    tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
    with fake_process_group(2):
        torch.manual_seed(0)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard_blocks_then_root(Transformer(SMALL.with_(n_layers=3)), FsdpGroups.create(), mp_policy=mp)
        assert all(block._forward_pre_hooks for block in model.layers)
        counts: list[tuple[int, int]] = []
        backend = _counting(counts, inductor=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(model, backend=backend)(tokens).float().sum().backward()
        assert counts == [(1, 2)]
