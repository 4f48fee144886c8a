"""Stacked blocks (NOTE [stacked blocks] in fsdp_compile/stack.py): a ``BlockStack`` computes what its
blocks compute, compiled as one loop; sharded, the loop body gathers its block and reduce-scatters
its gradients, the forward keeps only shards, the schedule and the order in Inductor's code are
pinned, a warm start loads it, and misuse is refused with the fix.

Numerics on gloo with 2 ranks against a single-process reference are in tests/test_numerics.py
(``stacked``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile import FsdpGroups, fully_shard, get_model_state_dict, make_backend, set_requires_gradient_sync
from fsdp_compile.backend import observe_graphs
from fsdp_compile.models import Transformer, loss_fn
from fsdp_compile.schedule import group_labels, listing
from fsdp_compile.stack import BlockStack
from passes.loops import loop_bodies, loop_bodies_pass

from .graph_utils import SMALL, FakeWorldTestCase, capture, fake_process_group
from .test_inductor_order import emitted_order, fx_order

# Widths that differ from every activation's, so a saved gathered weight shows in the outputs' shapes.
CFG = SMALL.with_(n_layers=3, dim=24, hidden_dim=40)


def _stacked(cfg: Any = CFG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.layers = BlockStack(model.layers)  # type: ignore[assignment]
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(tokens[:, :-1]), tokens[:, 1:])


# --- The stack computes what the blocks compute ---


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_stack_computes_what_its_blocks_compute(compiled: bool) -> None:
    torch.manual_seed(0)
    plain = Transformer(CFG)
    stacked = _stacked()
    assert [n for n, _ in stacked.layers.block.named_parameters()] == list(stacked.layers.names)
    run = torch.compile(stacked, backend="aot_eager", fullgraph=True) if compiled else stacked
    tokens = _tokens()
    loss, ref = _loss(run, tokens), _loss(plain, tokens)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    for name, p in stacked.layers.block.named_parameters():
        want = torch.stack([blk.get_parameter(name).grad for blk in plain.layers])
        torch.testing.assert_close(p.grad, want, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(stacked.tok_embeddings.weight.grad, plain.tok_embeddings.weight.grad)


def test_a_carry_that_needs_no_grad_still_gets_every_block_its_gradient() -> None:
    """torch 2.11 drops the carry's gradient when the first carry does not require grad
    (SCAN_NEEDS_FIRST_CARRY_GRAD in _compat_loops.py): every block but the last would get a wrong gradient."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
    h = torch.randn(4, 6)  # an input, not an activation: no grad
    ref = h
    for blk in blocks:
        ref = blk(ref)
    ref.sum().backward()
    want = torch.stack([b[0].weight.grad for b in blocks])
    stack = BlockStack(blocks)
    torch.compile(stack, backend="aot_eager", fullgraph=True)(h).sum().backward()
    torch.testing.assert_close(stack.block[0].weight.grad, want)


# --- Misuse ---


class _Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Shrinks(_Other):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, :2]


def test_blocks_one_loop_cannot_stand_for_are_refused() -> None:
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


class StackMisuse(FakeWorldTestCase):
    def test_sharding_refusals_name_the_fix(self) -> None:
        groups = FsdpGroups.create()
        blocks = [_Other(), _Other()]
        fully_shard(blocks[0], groups=groups)
        with self.assertRaisesRegex(ValueError, "build the BlockStack from plain blocks first"):
            BlockStack(blocks)
        stack = BlockStack([_Other(), _Other()])
        with self.assertRaisesRegex(ValueError, "already runs its blocks as one loop"):
            fully_shard(stack, groups=groups, outline=True)
        fully_shard(stack, groups=groups)
        with self.assertRaisesRegex(ValueError, "cannot accumulate full gradients without sync"):
            set_requires_gradient_sync(stack, False)
        with self.assertRaisesRegex(ValueError, "checkpoint functions do not convert them"):
            get_model_state_dict(stack)

    def test_each_shard_holds_its_rows_of_every_block(self) -> None:
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        blocks = [nn.Linear(5, 3) for _ in range(2)]  # weights of 3 rows: 2 per rank, the last one padding
        full = torch.stack([b.weight.detach().clone() for b in blocks])
        stack = fully_shard(BlockStack(blocks), groups=groups)
        shard = stack.block.weight
        assert shard.shape == (2, 2, 5)  # blocks, ceil(3 / 2) rows, columns
        torch.testing.assert_close(shard, full[:, :2])  # rank 0's rows of each block


# --- The schedule: collectives inside the loop body, the forward keeps shards ---


class StackSchedule(FakeWorldTestCase):
    def _graphs(self, **backend_kw: Any) -> tuple[dict[str, Any], dict[str, str]]:
        groups = FsdpGroups.create()
        model = _stacked()
        fully_shard(model.layers, groups=groups)
        fully_shard(model, groups=groups)
        return capture(model, _tokens()[:, :-1], **backend_kw), group_labels(groups)

    def _listing(self, gm: Any, labels: dict[str, str]) -> str:
        parts = [listing(gm, labels)]
        parts += [f"loop body:\n{listing(body, labels)}" for body in loop_bodies(gm)]
        return "\n".join(parts)

    def test_each_iteration_gathers_its_block_and_reduce_scatters_its_gradients(self) -> None:
        graphs, labels = self._graphs()
        self.assertExpectedInline(self._listing(graphs["forward"], labels), """\
0  pack            unit 1  ag
1  all_gather      unit 1  ag     all_gather      6240 B
2  wait            unit 1  ag     all_gather
3  unpack          unit 1  ag
4  compute         embedding scan pow mean add rsqrt mul mm  (30 nodes)
loop body:
0  pack            unit 0  ag
1  all_gather      unit 0  ag                     20928 B
2  wait            unit 0  ag
3  unpack          unit 0  ag
4  compute         pow mean add rsqrt mul mm slice_copy sub _scaled_dot_product_flash_attention_for_cpu neg exp div  (86 nodes)""")
        self.assertExpectedInline(self._listing(graphs["backward"], labels), """\
0  compute         mm  (3 nodes)
1  pack            unit 1  ag
2  all_gather      unit 1  ag     all_gather      3168 B
3  wait            unit 1  ag     all_gather
4  unpack          unit 1  ag
5  compute         mm mul sum pow div add countdown scan rev ge lt bitwise_and ne _unsafe_masked_index_put_accumulate  (51 nodes)
6  pack            unit 1  rs
7  reduce_scatter  unit 1  rs     reduce_scatter  6240 B
8  wait            unit 1  rs     reduce_scatter
9  unpack          unit 1  rs
loop body:
0  compute         _local_scalar_dense ge _assert_scalar le lt mm  (36 nodes)
1  pack            unit 0  ag
2  all_gather      unit 0  ag                     20928 B
3  wait            unit 0  ag
4  unpack          unit 0  ag
5  compute         mm neg exp add div mul sigmoid sub sum pow _scaled_dot_product_flash_attention_for_cpu_backward slice_scatter  (131 nodes)
6  pack            unit 0  rs
7  reduce_scatter  unit 0  rs                     20928 B
8  wait            unit 0  rs
9  unpack          unit 0  rs""")

    def test_the_forward_keeps_each_blocks_shards_not_its_gathered_weights(self) -> None:
        """NOTE [stacked blocks]: the body's unshards are recomputed in backward (resharding after
        forward), so no (blocks, *full weight shape) tensor is saved."""
        graphs, _ = self._graphs()
        (out,) = graphs["forward"].graph.find_nodes(op="output")
        saved = {tuple(o.meta["val"].shape) for o in out.args[0] if isinstance(o, torch.fx.Node)}
        d, f, n = CFG.dim, CFG.ffn_dim, CFG.n_layers
        assert not saved & {(n, d, d), (n, f, d), (n, d, f)}, saved
        assert {(n, d // 2, d), (n, f // 2, d), (n, d // 2, f)} <= saved  # each block's shards

    def test_the_backward_loop_reads_each_blocks_saved_values_in_place(self) -> None:
        """NOTE [a loop's backward in place]: nothing the forward saves is reversed (torch's own scan
        backward flips each saved stack); the backward loop runs over the block numbers from the last
        down and views each saved stack's row, and only the shards' gradients are flipped, once."""
        graphs, _ = self._graphs()
        flips = {torch.ops.aten.flip.default, torch.ops.prims.rev.default}

        def count(gm: Any, targets: set[Any]) -> int:
            return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)

        assert count(graphs["forward"], flips) == 0
        backward = graphs["backward"]
        assert count(backward, flips) == len(_stacked().layers.names)  # the gradient of each shard stack
        assert count(backward, {torch.ops.fsdp_loop.countdown.default}) == 1
        (body,) = loop_bodies(backward)
        assert count(body, flips) == 0
        assert count(body, {torch.ops.aten._local_scalar_dense.default}) == 1  # the block number, on the host
        rows = [n for n in body.graph.nodes if n.target is torch.ops.aten.select.int
                and n.args[0].op == "placeholder" and isinstance(n.args[2], torch.fx.Node)]
        assert len(rows) > len(_stacked().layers.names)  # every saved stack, shards included

    def test_inductor_keeps_the_bodys_collectives_in_order(self) -> None:
        """The order in Inductor's code, of the loop body's function and of the graph around the loop,
        is the scheduled FX graphs' (NOTE [pinning the schedule])."""
        groups = FsdpGroups.create()
        model = _stacked()
        fully_shard(model.layers, groups=groups)
        fully_shard(model, groups=groups)
        compiled = torch.compile(model, backend=make_backend(check_agreement=False), fullgraph=True)
        with fresh_cache(), observe_graphs() as seen:
            _, (forward, backward) = run_and_get_code(lambda: _loss(compiled, _tokens()).backward())
        graphs = dict(seen)
        for code, kind in ((forward, "forward"), (backward, "backward")):
            parts = _functions(code)
            (body,) = [name for name in parts if name.startswith("while_loop_body")]
            # Inductor decomposed the observed graph's scan in place: a while_loop's condition and body
            (fx_body,) = [b for b in loop_bodies(graphs[kind]) if fx_order(b)]
            self.assertEqual(emitted_order(parts[body]), fx_order(fx_body), kind)
            self.assertEqual(emitted_order(parts["call"]), fx_order(graphs[kind]), kind)
            assert "while should_loop" in parts["call"], "the blocks run as one loop"
        self.assertEqual(emitted_order(_functions(backward)[body]),
                         ["all_gather", "wait all_gather", "reduce_scatter", "wait reduce_scatter"])


def _functions(code: str) -> dict[str, str]:
    """Inductor's generated module by function: each ``def name(`` at the top level, and ``call``."""
    out: dict[str, list[str]] = {}
    current = "(module)"
    for line in code.splitlines():
        m = re.match(r"^def (\w+)\(|^    def (call)\(", line)
        if m:
            current = m.group(1) or m.group(2)
        out.setdefault(current, []).append(line)
    return {name: "\n".join(lines) for name, lines in out.items()}


def test_loop_bodies_pass_runs_each_pass_in_each_body_only() -> None:
    """The pass on a graph traced without any process group: one scan, whose body the passes see."""
    seen: list[torch.fx.GraphModule] = []

    def note(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        seen.append(gm)
        return gm

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    stack = BlockStack([nn.Linear(4, 4) for _ in range(3)])
    torch.compile(stack, backend=keep, fullgraph=True)(torch.randn(2, 4))
    (gm,) = graphs
    bodies = list(loop_bodies(gm))
    assert len(bodies) == 1 and bodies[0] is not gm
    assert loop_bodies_pass(gm, passes=[note, note]) is gm
    assert seen == [bodies[0], bodies[0]]


def _efficient_attention_step(dropout: float) -> torch.fx.GraphModule:
    """An attention forward and backward as a loop body's joint graph holds them (CUDA's kernel; traced
    with fake tensors, so no GPU is needed)."""
    aten = torch.ops.aten

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Any:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout)
        return aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, lse, seed, offset, dropout, [True, True, True, False]
        )

    return make_fx(step, tracing_mode="fake")(*[torch.randn(1, 2, 8, 4) for _ in range(4)])


def test_a_loop_body_does_not_carry_the_attention_seed_to_backward() -> None:
    """NOTE [attention seeds in a loop]: without dropout, the backward reads a CPU zero made in place of
    the seed and offset (never saved: the loop would stack them with a GPU copy of a CPU scalar); with
    dropout the compile stops with the fix."""
    from fsdp_compile.partition import tag_loop_body

    joint = _efficient_attention_step(0.0)
    tag_loop_body(joint)
    (backward,) = joint.graph.find_nodes(
        op="call_function", target=torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    )
    seeds = backward.args[7:9]
    assert [s.target for s in seeds] == [torch.ops.aten.zeros.default] * 2  # type: ignore[union-attr]
    assert all(s.kwargs["device"] == torch.device("cpu") for s in seeds)  # type: ignore[union-attr]
    assert all(s.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE for s in seeds)  # type: ignore[union-attr]
    (forward,) = joint.graph.find_nodes(
        op="call_function", target=torch.ops.aten._scaled_dot_product_efficient_attention.default
    )
    assert sorted(u.args[1] for u in forward.users) == [0, 1]
    with pytest.raises(ValueError, match="set the attention's dropout to 0"):
        tag_loop_body(_efficient_attention_step(0.1))


# --- Warm start (NOTE [caching loops]) ---


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
    counters["aot_autograd"].clear()
    model = _stacked(cfg)
    fully_shard(model.layers, groups=groups)
    fully_shard(model, groups=groups)
    _loss(torch.compile(model, backend=make_backend(), fullgraph=True), _tokens()).backward()
    return {k.removeprefix("autograd_cache_"): int(v) for k, v in counters["aot_autograd"].items()
            if k.startswith("autograd_cache_")}


def test_a_warm_start_loads_the_loop_and_a_different_body_compiles_again() -> None:
    with fresh_cache(), _world() as groups:
        assert _cached_step(groups) == {"miss": 1, "saved": 1}
        assert _cached_step(groups) == {"hit": 1}
        # Only the body differs (its norm's epsilon): the key must see inside the loop.
        assert _cached_step(groups, CFG.with_(norm_eps=1e-3)) == {"miss": 1, "saved": 1}


def test_the_demo_trains_the_same_with_its_blocks_stacked() -> None:
    """``python -m fsdp_compile demo --stack``: 2 gloo ranks, Inductor, the same losses as the outlined demo."""
    from fsdp_compile.demo import DemoArgs, train
    from fsdp_compile.launch import run_ranks

    args = DemoArgs(preset="tiny", steps=3, batch=2, seq=16)
    outlined = run_ranks(train, 2, args, timeout=600)[0]
    stacked = run_ranks(train, 2, dataclasses.replace(args, stack=True), timeout=600)[0]
    torch.testing.assert_close(torch.tensor(stacked), torch.tensor(outlined), rtol=1e-5, atol=0)
