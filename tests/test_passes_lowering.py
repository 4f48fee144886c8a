"""Unit tests of the lowering pass (``lower/markers.py``: each parameter alone, or a unit's bucket) on small
hand-built graphs (see ``pass_graphs``): no process group."""

from __future__ import annotations

import torch
from expecttest import TestCase
from torch import Tensor

from fsdp_compile.passes.predicates import fsdp_meta

from .pass_graphs import (
    WIDTH, assert_same, backward_graph, bucketed, forward_graph, gathers, ints, launches, lowered, one_param, ops,
    reduce_grad, run, scatters, show, trace, units_of, unshard, val, waits,
)


class TestLower(TestCase):
    def test_unshard_is_gather_and_wait(self) -> None:
        gm = lowered(trace(lambda s: unshard(s, [6, 4], 0, "w0"), ints(3, 4)))
        self.assertEqual(ops(gm), ["view", "all_gather_into_tensor", "wait_tensor", "view", "view"])
        (ag,) = gathers(gm)
        self.assertEqual(ag.args[1:], (2, "ag"))
        self.assertEqual(fsdp_meta(ag)["unit"], 0)
        self.assertEqual(val(ag), ((24,), torch.float32))
        self.assertEqual(val(gm.graph.output_node().args[0]), ((6, 4), torch.float32))

    def test_padded_dim0_is_narrowed(self) -> None:
        gm = lowered(one_param([5, 4], 3))
        self.assertEqual(ops(gm), [
            "view", "all_gather_into_tensor", "wait_tensor", "view", "slice", "view",  # unshard
            "view", "constant_pad_nd", "reduce_scatter_tensor", "wait_tensor", "div", "view",  # reduce_grad
        ])
        sl = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor)
        self.assertEqual(sl.args[1:], (0, 0, 5))
        (rs,) = scatters(gm)
        self.assertEqual(rs.args[1:], ("sum", 2, "rs"))
        self.assertEqual(val(rs.args[0]), ((24,), torch.float32))  # 20 elements padded to 2 x 12
        div = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.div.Tensor)
        self.assertEqual(div.args[1], 2)
        self.assertEqual([val(o) for o in gm.graph.output_node().args[0]],
                         [((5, 4), torch.float32), ((3, 4), torch.float32)])

    def test_world_size_one_has_no_collective(self) -> None:
        for gm in (forward_graph(world=1), backward_graph(world=1, gathers=True), one_param([5, 4], 5, world=1)):
            gm = lowered(gm)
            self.assertEqual(launches(gm) + waits(gm), [])
            self.assertNotIn("div", ops(gm))

    def test_param_dtype_cast_before_gather(self) -> None:
        gm = lowered(one_param([5, 4], 3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                               out_dtype=torch.bfloat16))
        self.assertEqual(ops(gm)[:3], ["convert_element_type", "view", "all_gather_into_tensor"])
        ag, rs = launches(gm)
        self.assertEqual(val(ag), ((24,), torch.bfloat16))
        self.assertEqual(val(rs.args[0]), ((24,), torch.float32))  # bf16 grad reduced in fp32
        outs = gm.graph.output_node().args[0]
        self.assertEqual([val(o) for o in outs], [((5, 4), torch.bfloat16), ((3, 4), torch.bfloat16)])

    def test_numerics_world_one(self) -> None:
        gm = one_param([5, 4], 5, world=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                       out_dtype=torch.bfloat16)
        want = run(gm, ranks=False)  # the markers' eager implementation
        assert_same(run(lowered(gm), ranks=False), want)

    def test_numerics_world_two_simulated(self) -> None:
        gm = one_param([5, 4], 3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, out_dtype=torch.bfloat16)
        want = run(gm)
        shard, grad = gm.meta["inputs"]
        assert_same(want, [torch.cat([shard, shard + 100])[:5].bfloat16(),  # rank 1 holds shard + 100
                           (grad[:3].float() * (1 + 2) / 2).bfloat16()])  # rank 1's grad is 2 * grad
        assert_same(run(lowered(gm)), want)


class TestBucket(TestCase):
    def test_one_gather_per_unit(self) -> None:
        gm = bucketed(forward_graph())
        self.assertExpectedInline(show(gm), """\
0  pack            unit 0  ag
1  all_gather      unit 0  ag                     288 B
2  wait            unit 0  ag
3  unpack          unit 0  ag
4  compute         mm add relu  (3 nodes)
5  pack            unit 1  ag
6  all_gather      unit 1  ag                     288 B
7  wait            unit 1  ag
8  unpack          unit 1  ag
9  compute         mm add relu  (3 nodes)
10 pack            unit 2  ag
11 all_gather      unit 2  ag                     288 B
12 wait            unit 2  ag
13 unpack          unit 2  ag
14 compute         mm add relu  (3 nodes)""")
        shards = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
        for ag, k in zip(gathers(gm), range(3)):
            pack = ag.args[0]  # NOTE [bucket copies]: the shards themselves go into one op
            self.assertIs(pack.target, torch.ops.fsdp.pack_shards.default)
            self.assertEqual(pack.args[0], shards[2 * k: 2 * k + 2])  # w_k, b_k
            self.assertEqual(fsdp_meta(ag)["params"], [f"w{k}", f"b{k}"])
        for mm in (n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default):
            self.assertEqual(val(mm.args[1])[0], (WIDTH, WIDTH))
            self.assertEqual(val(next(iter(mm.users)).args[1])[0], (WIDTH,))

    def test_bucketed_numerics(self) -> None:
        for gm in (forward_graph(), backward_graph(gathers=True)):
            want = run(gm)
            assert_same(run(bucketed(gm)), want)

    def test_units_not_merged_and_graph_order(self) -> None:
        fwd, bwd = bucketed(forward_graph()), bucketed(backward_graph(gathers=True))
        self.assertEqual(units_of(gathers(fwd)), [0, 1, 2])
        self.assertEqual(units_of(gathers(bwd)), [2, 1, 0])
        self.assertEqual(units_of(scatters(bwd)), [2, 1, 0])
        self.assertEqual([fsdp_meta(n)["params"] for n in scatters(bwd)], [["w2", "b2"], ["w1", "b1"], ["w0", "b0"]])

    def test_dtypes_not_merged(self) -> None:
        def fn(w: Tensor, b: Tensor, gw: Tensor, gb: Tensor) -> list[Tensor]:
            return [unshard(w, [4, 4], 0, "w", param_dtype=torch.bfloat16), unshard(b, [4], 0, "b"),
                    reduce_grad(gw, [2, 4], 0, "w", reduce_dtype=torch.bfloat16), reduce_grad(gb, [2], 0, "b")]

        gm = trace(fn, ints(2, 4), ints(2), ints(4, 4), ints(4))
        want = run(gm)
        gm = bucketed(gm)
        self.assertEqual([val(n.args[0])[1] for n in launches(gm)], [torch.bfloat16, torch.float32] * 2)
        assert_same(run(gm), want)

    def test_in_place_gather_packs_into_its_output(self) -> None:
        # (NOTE [in-place all-gather]) Rank r's members are copied into out[r*N:(r+1)*N], gathered in place.
        gm = forward_graph()
        want = run(gm)
        gm = bucketed(gm, rank_of=lambda group: 0)
        self.assertEqual(len(gathers(gm)), 3)
        for ag in gathers(gm):
            self.assertIs(ag.target, torch.ops._c10d_functional.all_gather_into_tensor_out.default)
            mine, out = ag.args[0], ag.kwargs["out"]
            self.assertIs(out.target, torch.ops.fsdp.pack_shards.default)  # shards packed into out's slice 0
            self.assertEqual(out.args[1:], (2, 0, torch.float32))
            self.assertIs(mine.target, torch.ops.aten.slice.Tensor)  # narrow(out, 0, 0, N)
            self.assertIs(mine.args[0], out)
            self.assertEqual(val(out), ((2 * 36,), torch.float32))  # 2 ranks x (32 + 4)
        assert_same(run(gm), want)

    def test_large_params_alone(self) -> None:
        # (NOTE [large params alone]) The 256 B weights keep their own collectives; a bias is what is left
        # of its unit's bucket, so it is alone too; nothing is packed.
        for make in (forward_graph, lambda: backward_graph(gathers=True)):
            gm, per_param = make(), len(launches(lowered(make())))
            want = run(gm)
            gm = bucketed(gm, rank_of=lambda group: 0, alone_bytes=200)
            self.assertEqual(len(launches(gm)), per_param)
            self.assertFalse([n for n in gm.graph.nodes if n.target is torch.ops.fsdp.pack_shards.default])
            assert_same(run(gm), want)
        gm = bucketed(forward_graph(), alone_bytes=260)  # weights 256 B: all bucketed
        self.assertEqual(len(gathers(gm)), 3)

    def test_a_gradient_whose_reduction_casts_is_never_alone(self) -> None:
        # (NOTE [large params alone]) The cast writes it into the bucket at no extra copy, so the 512 B
        # fp32 gradient shares it; its weight's all-gather (bf16, 256 B gathered) keeps its own collective.
        def fn(w: Tensor, b: Tensor, gw: Tensor, gb: Tensor) -> list[Tensor]:
            return [unshard(w, [16, 8], 0, "w", param_dtype=torch.bfloat16), unshard(b, [8], 0, "b", param_dtype=torch.bfloat16),
                    reduce_grad(gw, [8, 8], 0, "w", reduce_dtype=torch.float32), reduce_grad(gb, [4], 0, "b", reduce_dtype=torch.float32)]

        gm = trace(fn, ints(8, 8), ints(4), ints(16, 8).bfloat16(), ints(8).bfloat16())
        want = run(gm)
        gm = bucketed(gm, rank_of=lambda group: 0, alone_bytes=200)
        self.assertEqual(len(gathers(gm)), 2)  # w alone; b alone, what is left of the bucket
        (rs,) = scatters(gm)  # one bucket of both gradients, in fp32
        self.assertEqual(val(rs.args[0]), ((2 * (64 + 4),), torch.float32))
        assert_same(run(gm), want)

    def test_scatter_bucket_pads_each_member(self) -> None:
        def fn(gw: Tensor, gb: Tensor) -> list[Tensor]:
            return [reduce_grad(gw, [3, 4], 0, "w"), reduce_grad(gb, [2], 0, "b")]

        gm = trace(fn, ints(5, 4), ints(3))
        want = run(gm)
        gm = bucketed(gm)
        (rs,) = scatters(gm)
        self.assertEqual(val(rs.args[0]), ((28,), torch.float32))  # 2 ranks x (12 + 2)
        self.assertEqual(val(rs), ((14,), torch.float32))
        assert_same(run(gm), want)
