"""Stacked blocks (NOTE [stacked blocks] in fsdp_compile/api/stack.py, NOTE [unrolled stacks] in
passes/capture/unroll.py): a ``BlockStack`` computes what its blocks compute; Dynamo traces one block for all of
them; the backend unrolls that trace into one call of one body per block, so the schedule is the
outlined model's, block for block; the blocks stay ordinary units (names, state dicts, accumulation);
misuse is refused with the fix.

Numerics on gloo with 2 ranks against a single-process reference are in tests/test_numerics.py
(``stacked``, ``stacked-no-sync``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import re
import warnings
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code

from fsdp_compile import FsdpGroups, fully_shard, get_model_state_dict, make_backend
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.examples.models import Transformer, loss_fn
from fsdp_compile.inspection.schedule import group_labels, listing
from fsdp_compile.api.stack import BlockStack, stack_of
from fsdp_compile.api.units import unit_of
from fsdp_compile.passes.capture.unroll import unroll_scans_pass

from .graph_utils import SMALL, FakeWorldTestCase, capture, fake_process_group, shard_blocks_then_root
from .test_inductor_order import emitted_order, fx_order
from .test_outline import MlpBlock, calls

CFG = SMALL.with_(n_layers=3, dim=24, hidden_dim=40)


def _llama(stacked: bool, cfg: Any = CFG) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    if stacked:
        model.layers = BlockStack(model.layers)  # type: ignore[assignment]
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(tokens[:, :-1]), tokens[:, 1:])


def _dynamo_graphs(backend: Any) -> tuple[Any, list[fx.GraphModule]]:
    """``backend`` wrapped so that a copy of each graph Dynamo hands it is kept (the wrapper is still
    recognised as the backend the trace is for: NOTE [regions for our backend only])."""
    seen: list[fx.GraphModule] = []

    @functools.wraps(backend)
    def spy(gm: fx.GraphModule, example: Any) -> Any:
        seen.append(copy.deepcopy(gm))  # (the backend rewrites its graph in place)
        return backend(gm, example)

    return spy, seen


class Stacks(nn.Module):
    """``MlpBlock``s (big enough to stay calls) after a linear layer: as a ``BlockStack``, called as one
    module, or (``stacked=False``) as an ``nn.ModuleList`` walked in a loop."""

    def __init__(self, n_layers: int = 3, width: int = 8, stacked: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        blocks = [MlpBlock(width) for _ in range(n_layers)]
        self.layers = BlockStack(blocks) if stacked else nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if isinstance(self.layers, BlockStack):
            return self.layers(x)
        for layer in self.layers:
            x = layer(x)
        return x


# --- The stack computes what the blocks compute ---


@pytest.mark.parametrize("run", ["eager", "other-backend", "fsdp-backend"])
def test_a_stack_computes_what_its_blocks_compute(run: str) -> None:
    plain, stacked = _llama(False), _llama(True)
    assert [n for n, _ in stacked.named_parameters()] == [n for n, _ in plain.named_parameters()]
    backend = {"eager": None, "other-backend": "aot_eager", "fsdp-backend": make_backend(inductor=False)}[run]
    model = stacked if backend is None else torch.compile(stacked, backend=backend, fullgraph=True)
    tokens = _tokens()
    loss, ref = _loss(model, tokens), _loss(plain, tokens)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    grads = dict(plain.named_parameters())
    for name, p in stacked.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, name=name: f"{name}: {m}")


def test_dynamo_traces_one_block_and_the_backend_calls_it_per_block() -> None:
    """(NOTE [stacked blocks]) Dynamo's graph holds one loop over the stacked parameters, whose body is
    one block; the backend unrolls it (NOTE [unrolled stacks]) into a call of that body per block,
    each reading its own block's parameters, with no stack left to build."""
    stacked = _llama(True)
    backend, seen = _dynamo_graphs(make_backend(inductor=False))
    torch.compile(stacked, backend=backend, fullgraph=True)(_tokens()[:, :-1])
    (gm,) = seen
    scans = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)
    assert len(scans) == 1 and not calls(gm)
    assert len(gm.graph.find_nodes(op="call_function", target=torch.stack)) == 9  # one per parameter role
    unrolled = unroll_scans_pass(gm)
    assert not unrolled.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)
    assert not unrolled.graph.find_nodes(op="call_function", target=torch.stack)
    invokes = calls(unrolled)
    assert len(invokes) == 3 and len({n.args[0].target for n in invokes}) == 1
    placeholders = {n.name: i for i, n in enumerate(unrolled.graph.find_nodes(op="placeholder"))}
    for block, call in enumerate(invokes):  # each call reads its own block's weights (graph inputs)
        read = [a.name for a in call.args[3:] if isinstance(a, fx.Node) and a.name in placeholders
                and "layers" in a.name]
        assert len(read) == 9 and all(f"layers_modules_{block}_" in name for name in read), read


def _joint_graphs_built(run: Any) -> int:
    """How many joint graphs scan's autograd kernel builds while ``run()`` runs."""
    from torch._higher_order_ops.partitioner import HopGraphMinCutPartitioner

    built = []
    original = HopGraphMinCutPartitioner.create_partitioned_graph

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HopGraphMinCutPartitioner, "create_partitioned_graph", staticmethod(counting))
        run()
    return len(built)


def test_dynamo_gets_the_stacks_values_without_its_joint_graph() -> None:
    """(NOTE [scan example values]) For our backend, Dynamo's fake run of the stack's loop builds no joint
    graph (the backend unrolls the loop before AOTAutograd), and the loop's value still says it needs a
    gradient (the loss's backward reaches every block); another backend's trace of a scan that needs
    gradients still gets torch's own kernel."""
    stacked = _llama(True)
    backend, seen = _dynamo_graphs(make_backend(inductor=False))
    model = torch.compile(stacked, backend=backend, fullgraph=True)
    out: list[torch.Tensor] = []
    assert _joint_graphs_built(lambda: out.append(_loss(model, _tokens()))) == 0
    (gm,) = seen
    (scan,) = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)
    assert scan.meta["example_value"][0].requires_grad
    out[0].backward()
    assert all(p.grad is not None for p in stacked.layers.parameters())

    def cumulative(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return torch._higher_order_ops.scan(lambda c, x: (c * w + x, c * 2.0), torch.zeros(3), xs)[0]

    w = torch.ones(3, requires_grad=True)
    assert _joint_graphs_built(lambda: torch.compile(cumulative, backend="eager")(w, torch.randn(5, 3))) > 0


def test_a_scan_over_a_tensor_it_did_not_stack_stays_a_loop() -> None:
    """A user's own loop over time steps reads no sharded parameter: the pass leaves it alone."""
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def cumulative(xs: torch.Tensor) -> torch.Tensor:
        out, _ = torch._higher_order_ops.scan(lambda c, x: (c + x, c.sum()), torch.zeros(3), xs)
        return out

    torch.compile(cumulative, backend=keep, fullgraph=True)(torch.randn(5, 3))
    (gm,) = graphs
    unroll_scans_pass(gm)
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)) == 1


# --- Misuse ---


class _Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _Shrinks(_Other):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, :2]


def test_blocks_one_trace_cannot_stand_for_are_refused() -> None:
    with pytest.raises(ValueError, match="no blocks"):
        BlockStack([])
    with pytest.raises(ValueError, match="one kind of block"):
        BlockStack([_Other(), nn.Sequential(nn.Linear(4, 4))])
    wide = _Other()
    wide.lin = nn.Linear(4, 8)
    with pytest.raises(ValueError, match="parameters differ"):
        BlockStack([_Other(), wide])
    frozen = _Other()
    frozen.lin.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="Freeze or unfreeze whole roles"):
        BlockStack([_Other(), frozen])
    hooked = _Other()
    hooked.lin.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="has hooks"):
        BlockStack([_Other(), hooked])
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="is tied to another"):
        BlockStack([tied])
    with pytest.raises(TypeError, match="must return a tensor like its first argument"):
        BlockStack([_Shrinks(), _Shrinks()])(torch.randn(2, 4))
    with pytest.raises(TypeError, match="blocks are fixed"):
        BlockStack([_Other(), _Other()]).append(_Other())


def test_an_attribute_the_body_would_read_wrong_is_refused_unless_ignored() -> None:
    """The compiled stack runs block 0's attributes for every block: one that differs is refused, named."""
    scaled = _Other()
    scaled.scale = 2.0
    with pytest.raises(ValueError, match=r"attribute scale is 2.0, block 0's 1.0.*ignore_attributes=\['scale'\]"):
        BlockStack([_Other(), scaled])
    indexed = [_Other(), _Other()]
    for i, block in enumerate(indexed):
        block.lin.layer_idx = i  # read by a cache, not by this forward
    BlockStack(indexed, ignore_attributes=["layer_idx"])


class StackSharding(FakeWorldTestCase):
    def test_each_block_is_a_unit_of_its_own_with_the_plain_models_names(self) -> None:
        groups = FsdpGroups.create()
        plain, stacked = shard_blocks_then_root(_llama(False), groups), shard_blocks_then_root(_llama(True), groups)
        units = [unit_of(block) for block in stacked.layers]
        assert all(u is not None and u.stacked and not u.outlined for u in units)
        assert [u.index for u in units] == [0, 1, 2]  # type: ignore[union-attr]
        assert list(get_model_state_dict(stacked)) == list(get_model_state_dict(plain))

    def test_a_copy_of_a_stack_owns_its_blocks(self) -> None:
        stack = BlockStack(MlpBlock() for _ in range(2))
        twin = copy.deepcopy(stack)
        assert stack_of(twin[1]) is twin and stack_of(stack[1]) is stack
        fully_shard(twin, groups=FsdpGroups.create())
        assert all(unit_of(b).stacked for b in twin) and all(s is not None for s in twin.shards)  # type: ignore[union-attr]

    def test_fully_shard_of_the_stack_shards_each_block(self) -> None:
        groups = FsdpGroups.create()
        stack = BlockStack(MlpBlock() for _ in range(2))
        assert fully_shard(stack, groups=groups) is stack
        assert unit_of(stack) is None and all(unit_of(b) is not None for b in stack)

    def test_sharding_refusals_name_the_fix(self) -> None:
        groups = FsdpGroups.create()
        blocks = [_Other(), _Other()]
        fully_shard(blocks[0], groups=groups)
        with self.assertRaisesRegex(ValueError, "build the BlockStack from plain blocks first"):
            BlockStack(blocks)
        stack = BlockStack([_Other(), _Other()])
        with self.assertRaisesRegex(ValueError, "compiled as one body already"):
            fully_shard(stack[0], groups=groups, outline=True)
        root = nn.Sequential(nn.Linear(4, 4), stack)
        with self.assertRaisesRegex(ValueError, "block 1.0 of a BlockStack is not sharded yet"):
            fully_shard(root, groups=groups)
        inner = BlockStack([_Other(), _Other()])
        fully_shard(inner[0].lin, groups=groups)
        with self.assertRaisesRegex(ValueError, "call fully_shard on the block, not on modules inside it"):
            fully_shard(inner[0], groups=groups)
        unlike = BlockStack([_Other(), _Other()])
        fully_shard(unlike[0], groups=groups)
        with self.assertRaisesRegex(ValueError, "sharded unlike an earlier block"):
            fully_shard(unlike[1], groups=groups, reshard_after_forward=False)


# --- The schedule: the outlined model's, block for block ---


def _without_copies(listings: tuple[str, ...]) -> tuple[list[str], ...]:
    """Schedule listings without their line numbers, bucket copies (``pack``, ``unpack``) and body names."""
    return tuple([re.sub(r"call \w+", "call", line.split(None, 1)[1]) for line in text.splitlines()
                  if not line.split(None, 1)[1].startswith(("pack", "unpack"))] for text in listings)


class StackSchedule(FakeWorldTestCase):
    def _listings(self, stacked: bool, **backend_kw: Any) -> tuple[str, str]:
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        model = shard_blocks_then_root(Stacks(stacked=stacked), groups)
        graphs = capture(model, torch.randn(4, 8, requires_grad=True), **backend_kw)
        labels = group_labels(groups)
        return listing(graphs["forward"], labels), listing(graphs["backward"], labels)

    def test_the_stack_schedules_its_blocks_as_outlined_units(self) -> None:
        """Every block gathers ahead of its call (prefetch) and reduce-scatters right after its backward
        call, overlapping the next block's, exactly as the outlined blocks of an nn.ModuleList do. Only the
        bucket copies differ: a stack's blocks read rows of stacked parameters, which are packed into
        their all-gather, where an outlined block's flat shard is gathered as it is (NOTE [a flat gathers
        as it is] in passes/lower/bucket.py)."""
        self.assertEqual(_without_copies(self._listings(stacked=True)), _without_copies(self._listings(stacked=False)))
        forward, backward = self._listings(stacked=True)
        self.assertExpectedInline(forward, """\
0  pack            unit 3  ag
1  all_gather      unit 3  ag     all_gather      288 B
2  pack            unit 0  ag
3  all_gather      unit 0  ag     all_gather      1120 B
4  wait            unit 3  ag     all_gather
5  unpack          unit 3  ag
6  compute         addmm  (2 nodes)
7  pack            unit 1  ag
8  all_gather      unit 1  ag     all_gather      1120 B
9  wait            unit 0  ag     all_gather
10 compute         call fw_unrolled_scan_combine_fn_0_0  (5 nodes)
11 pack            unit 2  ag
12 all_gather      unit 2  ag     all_gather      1120 B
13 wait            unit 1  ag     all_gather
14 compute         call fw_unrolled_scan_combine_fn_0_0  (5 nodes)
15 wait            unit 2  ag     all_gather
16 compute         call fw_unrolled_scan_combine_fn_0_0  (5 nodes)""")
        self.assertExpectedInline(backward, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      1024 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag     all_gather      1024 B
4  wait            unit 2  ag     all_gather
5  compute         call bw_unrolled_scan_combine_fn_0_0  (3 nodes)
6  reduce_scatter  unit 2  rs     reduce_scatter  1120 B
7  pack            unit 0  ag
8  all_gather      unit 0  ag     all_gather      1024 B
9  wait            unit 1  ag     all_gather
10 compute         call bw_unrolled_scan_combine_fn_0_0  (3 nodes)
11 wait            unit 2  rs     reduce_scatter
12 unpack          unit 2  rs
13 reduce_scatter  unit 1  rs     reduce_scatter  1120 B
14 pack            unit 3  ag
15 all_gather      unit 3  ag     all_gather      256 B
16 wait            unit 0  ag     all_gather
17 compute         call bw_unrolled_scan_combine_fn_0_0  (3 nodes)
18 wait            unit 1  rs     reduce_scatter
19 unpack          unit 1  rs
20 reduce_scatter  unit 0  rs     reduce_scatter  1120 B
21 wait            unit 3  ag     all_gather
22 unpack          unit 3  ag
23 compute         mm sum  (6 nodes)
24 wait            unit 0  rs     reduce_scatter
25 unpack          unit 0  rs
26 pack            unit 3  rs
27 reduce_scatter  unit 3  rs     reduce_scatter  288 B
28 wait            unit 3  rs     reduce_scatter
29 unpack          unit 3  rs
30 compute         view  (1 nodes)""")

    def test_without_outlining_the_stack_is_the_whole_graph(self) -> None:
        """``make_backend(outline=False)``: the blocks run one by one, inline, as in an nn.ModuleList."""
        stacked = self._listings(stacked=True, outline=False)
        plain = self._listings(stacked=False, outline=False)
        self.assertEqual(_without_copies(stacked), _without_copies(plain))  # (the copies: as above)
        assert "call" not in "".join(stacked)

    def test_a_block_accumulating_without_sync_runs_the_blocks_one_by_one(self) -> None:
        """(NOTE [no-sync]) Each block's reads then pass its own accumulator, which one trace of block 0
        cannot; the stack runs its blocks in turn (no reduce-scatter of the blocks at all)."""
        groups = FsdpGroups.create()
        model = shard_blocks_then_root(_llama(True), groups)
        model.layers[1].set_requires_gradient_sync(False)
        backend, seen = _dynamo_graphs(make_backend(inductor=False))
        with observe_graphs() as graphs:
            _loss(torch.compile(model, backend=backend, fullgraph=True), _tokens()).backward()
        (gm,) = seen
        assert not gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan)
        backward = listing(dict(graphs)["backward"], group_labels(groups))
        assert "unit 1  rs" not in backward and "unit 0  rs" in backward

    def test_inductor_keeps_the_order_of_the_calls_and_collectives(self) -> None:
        """The order in Inductor's code is the scheduled FX graphs' (NOTE [pinning the schedule])."""
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        model = shard_blocks_then_root(Stacks(), groups)
        compiled = torch.compile(model, backend=make_backend(), fullgraph=True)
        with observe_graphs() as seen:
            _, codes = run_and_get_code(lambda: compiled(torch.randn(4, 8, requires_grad=True)).sum().backward())
        fx = [fx_order(gm) for _, gm in seen]
        self.assertEqual([o.count("call") for o in fx], [3, 3])
        self.assertEqual([emitted_order(c) for c in codes], fx)


# --- Warm start ---


@contextlib.contextmanager
def _world() -> Any:
    with fake_process_group(2):
        groups = FsdpGroups.create()
        try:
            yield groups
        finally:
            groups.destroy()


def _cached_step(groups: FsdpGroups, cfg: Any = CFG) -> dict[str, int]:
    torch._dynamo.reset()
    gc.collect()  # the last step's model, as in a new process: its flats' keys free (NOTE [warm start])
    counters["aot_autograd"].clear()
    model = shard_blocks_then_root(_llama(True, cfg), groups)
    _loss(torch.compile(model, backend=make_backend(), fullgraph=True), _tokens()).backward()
    return {k.removeprefix("autograd_cache_"): int(v) for k, v in counters["aot_autograd"].items()
            if k.startswith("autograd_cache_")}


def test_a_warm_start_loads_the_stack_and_a_different_block_compiles_again() -> None:
    with fresh_cache(), _world() as groups, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _cached_step(groups) == {"miss": 1, "saved": 1}
        assert _cached_step(groups) == {"hit": 1}
        # Only the block differs (its norm's epsilon): the key must see inside the body.
        assert _cached_step(groups, CFG.with_(norm_eps=1e-3)) == {"miss": 1, "saved": 1}


def test_the_demo_trains_the_same_with_its_blocks_stacked(capfd: pytest.CaptureFixture[str]) -> None:
    """``python -m fsdp_compile demo --stack``: 2 gloo ranks, Inductor, the same losses as the outlined demo.
    Rank 0 alone prints the step lines (the last step's, here)."""
    from fsdp_compile.examples.demo import DemoArgs, train
    from fsdp_compile.examples.launch import run_ranks

    args = DemoArgs(preset="tiny", steps=3, batch=2, seq=16)
    outlined = run_ranks(train, 2, args, timeout=600)[0]
    assert capfd.readouterr().out.count("step   2  loss") == 1
    stacked = run_ranks(train, 2, dataclasses.replace(args, stack=True), timeout=600)[0]
    torch.testing.assert_close(torch.tensor(stacked), torch.tensor(outlined), rtol=1e-5, atol=0)
