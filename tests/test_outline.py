"""Outlined units (NOTE [outlined units] in fsdp_compile/api/module.py): identical blocks are one
``invoke_subgraph`` body, compiled once; their markers move out to the calls (passes/capture/hoist.py), so the
schedule still sees every unit's collectives; backward gathers again; nothing compiles after step 1."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch import fx, nn

from fsdp_compile import FsdpGroups, make_backend
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.examples.models import Transformer, loss_fn
from fsdp_compile.api.module import is_outline_candidate
from fsdp_compile.inspection.schedule import graph_group_labels, group_labels, listing
from fsdp_compile.passes.capture.hoist import hoist_unshards_pass
from fsdp_compile.passes.capture.inline import inline_subgraphs_pass
from fsdp_compile.passes.capture.outline import outline_blocks_pass
from fsdp_compile.passes.predicates import marker_args, is_all_gather, is_collective, is_unshard

from .workers import MODELS, TINY
from .graph_utils import SMALL, FakeWorldTestCase, ThreeUnits, capture, gathered_values, shard_blocks_then_root

invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def dynamo_graph(model: nn.Module, *inputs: torch.Tensor) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The graph Dynamo hands a backend for ``model(*inputs)`` with alike blocks outlined (the backend's
    first pass, NOTE [outlining by proof]), and its example inputs."""
    graphs: list[tuple[fx.GraphModule, list[torch.Tensor]]] = []

    def keep(gm: fx.GraphModule, example: list[torch.Tensor]) -> object:
        gm = outline_blocks_pass(gm, is_block=is_outline_candidate)
        graphs.append((gm, list(example)))
        return gm.forward

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the markers run eagerly here: the slow-path warning
        torch.compile(model, backend=keep, fullgraph=True)(*inputs)
    (out,) = graphs
    return out


def calls(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=invoke_subgraph))


class MlpBlock(nn.Module):
    """A block big enough to stay outlined (8 ops or more, see ``backend._MIN_BODY_OPS``)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        h = self.down(h) * torch.sigmoid(h[..., : x.shape[-1]])
        return torch.tanh(x + h).clamp(-3.0, 3.0) * 0.5 + x


class Mlp(nn.Module):
    def __init__(self, n_layers: int = 3, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MlpBlock(width) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SplitBlock(nn.Module):
    """A block whose forward splits a weight into pieces (a fused projection's, read as three)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wq, wk, wv = self.qkv.weight.split([x.shape[-1]] * 3)
        h = torch.sigmoid(nn.functional.linear(x, wq)) * (x * wk[0])  # (backward reads part of the weight)
        h = self.out(h + nn.functional.linear(x, wv).relu())
        return (x + h).clamp(-3.0, 3.0) * 0.5 + x


class OutlineTest(FakeWorldTestCase):
    def sharded_small(self, layers: int = 3, **kw: object) -> nn.Module:
        torch.manual_seed(0)
        return shard_blocks_then_root(Transformer(SMALL.with_(n_layers=layers)), FsdpGroups.create(), **kw)

    def test_blocks_are_outlined_and_the_root_is_not(self) -> None:
        model = self.sharded_small()
        self.assertEqual([type(b).__name__ for b in model.layers], ["FsdpBlock"] * 3)
        self.assertTrue(all(b.forward.__func__ is model.layers[0].forward.__func__ for b in model.layers))
        self.assertIsNot(type(model).forward, type(model.layers[0]).forward)
        # Being a candidate changes nothing eagerly: the model still runs uncompiled.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertEqual(model(torch.randint(0, SMALL.vocab_size, (2, 8))).shape, (2, 8, SMALL.vocab_size))

    def test_dynamo_traces_one_body_and_hoisting_moves_every_marker_out(self) -> None:
        tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
        gm, example = dynamo_graph(self.sharded_small(), tokens)
        invokes = calls(gm)
        self.assertEqual(len(invokes), 3)  # one per block
        self.assertEqual(len({n.args[0].target for n in invokes}), 1)  # ... of one body
        body = getattr(gm, invokes[0].args[0].target)
        # Inside the body the markers carry no unit and no name: every block traces alike.
        inside = [marker_args(n) for n in body.graph.nodes if is_unshard(n)]
        self.assertEqual({(a.unit, a.names) for a in inside}, {(-1, "")})
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = gm(*example)
        out = hoist_unshards_pass(gm)
        self.assertFalse(any(is_unshard(n) for n in getattr(out, calls(out)[0].args[0].target).graph.nodes))
        for call in calls(out):  # each call gathers its own block's 9 params before it
            self.assertEqual(sum(isinstance(a, fx.Node) and a.target is operator.getitem and is_unshard(a.args[0])
                                 for a in call.args[2:]), 9)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(out(*example), expected)
        # Inlining gives back a whole-model graph with the same result and no call left.
        whole = inline_subgraphs_pass(out)
        self.assertEqual(calls(whole), [])
        self.assertEqual(sum(map(is_unshard, whole.graph.nodes)), 9 * 3 + 3)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(whole(*example), expected)

    def test_other_backends_get_the_whole_graph(self) -> None:
        # (NOTE [regions for our backend only]) No region unless the backend keeps outlined bodies.
        graphs: list[fx.GraphModule] = []

        def plain(gm: fx.GraphModule, example: list[torch.Tensor]) -> object:
            graphs.append(gm)
            return gm.forward

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(self.sharded_small(), backend=plain)(torch.randint(0, SMALL.vocab_size, (2, 8)))
        (gm,) = graphs
        self.assertEqual(calls(gm), [])
        self.assertEqual(sum(map(is_unshard, gm.graph.nodes)), 9 * 3 + 3)

    def test_outlined_schedule(self) -> None:
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        model = shard_blocks_then_root(Mlp(), groups)
        graphs = capture(model, torch.randn(4, 8, requires_grad=True))
        labels = group_labels(groups)
        fwd, bwd = listing(graphs["forward"], labels), listing(graphs["backward"], labels)
        # Forward: each block is one call of one body; the collectives stay in the outer graph, scheduled
        # across calls as for inline units (unit 1's all-gather issued before unit 0's call). The call
        # takes the gathered bucket: the copies out of it run inside (NOTE [copies inside bodies]).
        self.assertExpectedInline(fwd, """\
0  all_gather      unit 0  ag     all_gather      1120 B
1  all_gather      unit 1  ag     all_gather      1120 B
2  wait            unit 0  ag     all_gather
3  compute         call fw_fsdp_block_0_0  (5 nodes)
4  all_gather      unit 2  ag     all_gather      1120 B
5  wait            unit 1  ag     all_gather
6  compute         call fw_fsdp_block_0_0  (5 nodes)
7  wait            unit 2  ag     all_gather
8  compute         call fw_fsdp_block_0_0  (5 nodes)""")
        # Backward: every unit is gathered again (the body saved no view of a gathered param), the next
        # unit prefetched under each call, and each reduce-scatter issued right after its call, on the
        # packed gradients the call returns.
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      1024 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag     all_gather      1024 B
4  wait            unit 2  ag     all_gather
5  compute         call bw_fsdp_block_0_0  (3 nodes)
6  reduce_scatter  unit 2  rs     reduce_scatter  1120 B
7  pack            unit 0  ag
8  all_gather      unit 0  ag     all_gather      1024 B
9  wait            unit 1  ag     all_gather
10 compute         call bw_fsdp_block_0_0  (3 nodes)
11 wait            unit 2  rs     reduce_scatter
12 unpack          unit 2  rs
13 reduce_scatter  unit 1  rs     reduce_scatter  1120 B
14 wait            unit 0  ag     all_gather
15 compute         call bw_fsdp_block_0_0  (3 nodes)
16 wait            unit 1  rs     reduce_scatter
17 unpack          unit 1  rs
18 reduce_scatter  unit 0  rs     reduce_scatter  1120 B
19 wait            unit 0  rs     reduce_scatter
20 unpack          unit 0  rs""")

        fw_body = getattr(graphs["forward"], calls(graphs["forward"])[0].args[0].target)
        bw_body = getattr(graphs["backward"], calls(graphs["backward"])[0].args[0].target)
        self.assertTrue(any(n.target is torch.ops.fsdp.copy_out_rows.default for n in fw_body.graph.nodes))
        self.assertTrue(any(n.target is torch.ops.fsdp.pack_rows.default for n in bw_body.graph.nodes))
        self.assertTrue(all(n.target is not torch.ops.fsdp.pack_rows.default for n in graphs["backward"].graph.nodes))

    def test_small_bodies_stay_inline(self) -> None:
        # ThreeUnits' blocks are one linear layer each: below the minimum, inlined as before.
        graphs = capture(shard_blocks_then_root(ThreeUnits(), FsdpGroups.create()), torch.randn(4, 8))
        self.assertEqual(calls(graphs["forward"]), [])
        self.assertEqual(calls(graphs["backward"]), [])

    def saved_gathered(self, model: nn.Module | None = None, **shard_kw: object
                       ) -> tuple[dict[str, fx.GraphModule], list[fx.Node]]:
        """Compile and step the 3-block model (or ``model``, sharded, on a (4, 8) input) with Inductor;
        return its graphs and the forward outputs (what backward reads) that are gathered params or views
        of them, looking through calls."""
        compiled = torch.compile(model if model is not None else self.sharded_small(**shard_kw), backend=make_backend())
        tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
        with observe_graphs() as seen:
            if model is None:
                loss_fn(compiled(tokens), tokens).backward()
            else:
                compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()
        graphs = dict(seen)
        fw = graphs["forward"]
        gathered = gathered_values(fw)
        for call in calls(fw):
            body = getattr(fw, call.args[0].target)
            inputs = body.graph.find_nodes(op="placeholder")
            (results,) = body.graph.find_nodes(op="output")[0].args
            for user in call.users:
                source = results[user.args[1]]
                while source.op == "call_function" and (source.target in _VIEWS or source.target is operator.getitem
                                                        or source.target is torch.ops.fsdp.copy_out_rows.default):
                    source = source.args[0]  # (a param copied out of the gathered bucket is a gathered one too)
                if source in inputs and call.args[2 + inputs.index(source)] in gathered:
                    gathered.add(user)
        (outputs,) = fw.graph.find_nodes(op="output")[0].args
        return graphs, [o for o in outputs if o in gathered]

    def test_outlined_units_reshard_after_forward(self) -> None:
        # (NOTE [reshard through outlined bodies]) No gathered param, nor a view of one, is saved for
        # backward; backward gathers every unit again.
        graphs, saved = self.saved_gathered()
        self.assertEqual(len(calls(graphs["forward"])), 3)
        self.assertEqual(len(calls(graphs["backward"])), 3)
        self.assertEqual(saved, [])
        gathered = [n.meta["fsdp"]["unit"] for n in graphs["backward"].graph.nodes if is_all_gather(n)]
        self.assertEqual(sorted(gathered), [0, 1, 2, 3])

    def test_a_block_splitting_its_weight_reshards_too(self) -> None:
        # The pieces of a split weight are views of the gathered param: recomputed in backward, not saved.
        model = Mlp()
        model.layers = nn.ModuleList(SplitBlock() for _ in range(3))
        graphs, saved = self.saved_gathered(shard_blocks_then_root(model, FsdpGroups.create()))
        self.assertEqual(len(calls(graphs["backward"])), 3)
        self.assertEqual(saved, [])
        gathered = [n.meta["fsdp"]["unit"] for n in graphs["backward"].graph.nodes if is_all_gather(n)]
        self.assertEqual(sorted(gathered), [0, 1, 2])

    def test_outlined_units_without_reshard_keep_their_params(self) -> None:
        graphs, saved = self.saved_gathered(reshard_after_forward=False)
        self.assertEqual(len(calls(graphs["forward"])), 3)
        self.assertEqual([n for n in graphs["backward"].graph.nodes if is_all_gather(n)], [])
        self.assertTrue(saved)

    def test_switching_outlining_off(self) -> None:
        # fully_shard(outline=False): the block's forward is no region; make_backend(outline=False):
        # the backend inlines the regions Dynamo made. Either way, the same whole-model schedule.
        tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
        plain = capture(self.sharded_small(outline=False), tokens)
        torch._dynamo.reset()
        inlined = capture(self.sharded_small(), tokens, outline=False)
        for kind in ("forward", "backward"):
            self.assertEqual(calls(plain[kind]), [])
            self.assertEqual(listing(plain[kind], graph_group_labels(plain[kind])),
                             listing(inlined[kind], graph_group_labels(inlined[kind])))
            self.assertEqual([n.meta["fsdp"]["unit"] for n in plain[kind].graph.nodes if is_collective(n)],
                             [n.meta["fsdp"]["unit"] for n in inlined[kind].graph.nodes if is_collective(n)])

    def test_training_compiles_once(self) -> None:
        model = self.sharded_small(layers=2)
        compiled = torch.compile(model, backend=make_backend())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
        counts = []
        for _ in range(4):
            with observe_graphs() as seen:
                loss_fn(compiled(tokens), tokens).backward()
                opt.step()
                opt.zero_grad()
            counts.append(len(seen))
        self.assertEqual(counts, [2, 0, 0, 0])  # forward and backward at step 1, nothing after


_VIEWS = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.permute.default,
          torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default,
          torch.ops.prims.convert_element_type.default, torch.ops.aten.select.int, torch.ops.aten.slice.Tensor,
          torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor}


def test_what_reads_as_a_view_comes_from_the_op_schema() -> None:
    """(NOTE [reshard through outlined bodies]) The ops whose results a body recomputes from its inputs rather
    than save are read off their schemas (an alias returned, nothing written), plus the casts and copies."""
    from fsdp_compile.compiler.partition import _reads_as_view

    aten = torch.ops.aten
    views = [aten.view.default, aten.t.default, aten.split_with_sizes.default, aten.unbind.int, aten.narrow.default,
             aten.squeeze.dims, aten.unflatten.int, aten.as_strided.default, aten.expand.default,
             aten.clone.default, aten._to_copy.default, torch.ops.prims.convert_element_type.default]
    others = [aten.mm.default, aten.add_.Tensor, aten.index_put_.default, aten.add.Tensor, operator.getitem,
              torch.ops._c10d_functional.wait_tensor.default, torch.ops.fsdp.unshard.default]
    assert [op for op in views if not _reads_as_view(op)] == []
    assert [op for op in others if _reads_as_view(op)] == []


@pytest.mark.parametrize(("name", "calls"), [("llama", [4]), ("llama-alternating", [2, 2]), ("hf-mistral", [4])])
def test_which_blocks_share_a_body(fake_world: int, name: str, calls: list[int]) -> None:
    """(NOTE [outlining by proof]) Alike blocks share one body, in forward and backward; blocks of one
    class whose feed-forward classes alternate get two; Hugging Face Mistral's blocks (a sliding window
    shorter than the sequence) one."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = shard_blocks_then_root(MODELS[name](TINY.with_(n_layers=4)), FsdpGroups.create())
    graphs = capture(model, torch.randint(0, TINY.vocab_size, (2, 8)))
    for kind in ("forward", "backward"):
        per_body: dict[str, int] = {}
        for call in graphs[kind].graph.find_nodes(op="call_function", target=invoke_subgraph):
            per_body[call.args[1]] = per_body.get(call.args[1], 0) + 1
        assert sorted(per_body.values()) == calls, kind


def test_bodies_that_fail_to_compile_fall_back_inline(fake_world: int, caplog: pytest.LogCaptureFixture) -> None:
    """(NOTE [outlining by proof]) Where AOTAutograd cannot take the shared bodies, the graph is compiled
    with every block inline, with one INFO line, never a crash."""
    import contextlib
    from unittest import mock

    @contextlib.contextmanager
    def failing() -> object:
        raise RuntimeError("a body AOTAutograd cannot take")
        yield  # pragma: no cover

    torch.manual_seed(0)
    model = shard_blocks_then_root(Mlp(4), FsdpGroups.create())
    with mock.patch("fsdp_compile.compiler.backend.region_schemas_once", failing), caplog.at_level("INFO", "fsdp_compile"):
        graphs = capture(model, torch.randn(4, 8, requires_grad=True))
    assert calls(graphs["forward"]) == [] and calls(graphs["backward"]) == []
    lines = [r.getMessage() for r in caplog.records if "compiling them inline" in r.getMessage()]
    assert len(lines) == 1 and "a body AOTAutograd cannot take" in lines[0]
