"""Unit tests of each graph pass on small hand-built graphs (see ``pass_graphs``): no process group."""

from __future__ import annotations

import logging

import pytest
import torch
from expecttest import TestCase
from torch import Tensor, fx

from passes import NamedPass, run_passes
from passes.lower import lower_unshard_pass
from passes.order import reorder
from passes.predicates import fsdp_meta, wait_of
from passes.prefetch import prefetch_pass
from passes.reduce_scatter import reduce_scatter_pass
from passes.streams import check_streams, streams_pass

from .pass_graphs import (
    PIPELINE, WIDTH, abcd, assert_same, backward_graph, bucketed, forward_graph, gather_chain, gathers, ints, launches,
    lowered, names, one_param, ops, reduce_grad, run, scatters, sched, show, trace, units_of, unshard, val, valid, waits,
)


class TestLower(TestCase):
    def test_unshard_is_gather_and_wait(self) -> None:
        gm = valid(lower_unshard_pass(trace(lambda s: unshard(s, [6, 4], 0, "w0"), ints(3, 4))))
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
            cat = ag.args[0]
            self.assertIs(cat.target, torch.ops.aten.cat.default)
            self.assertEqual([i.args[0] for i in cat.args[0]], shards[2 * k: 2 * k + 2])  # views of w_k, b_k
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


class TestPrefetch(TestCase):
    def test_depth_0_launches_right_before_wait(self) -> None:
        gm = valid(prefetch_pass(bucketed(forward_graph()), depth=0))
        self.assertEqual(show(gm), show(bucketed(forward_graph())))  # snapshot in TestBucket
        for ag in gathers(gm):
            self.assertIs(ag.next, wait_of(ag))

    def test_depth_1(self) -> None:
        gm = valid(prefetch_pass(bucketed(forward_graph()), depth=1))
        self.assertExpectedInline(show(gm), """\
0  pack            unit 0  ag
1  all_gather      unit 0  ag                     288 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag                     288 B
4  wait            unit 0  ag
5  unpack          unit 0  ag
6  compute         mm add relu  (3 nodes)
7  pack            unit 2  ag
8  all_gather      unit 2  ag                     288 B
9  wait            unit 1  ag
10 unpack          unit 1  ag
11 compute         mm add relu  (3 nodes)
12 wait            unit 2  ag
13 unpack          unit 2  ag
14 compute         mm add relu  (3 nodes)""")

    def test_depth_2(self) -> None:
        gm = valid(prefetch_pass(bucketed(forward_graph()), depth=2))
        self.assertExpectedInline(show(gm), """\
0  pack            unit 0  ag
1  all_gather      unit 0  ag                     288 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag                     288 B
4  pack            unit 2  ag
5  all_gather      unit 2  ag                     288 B
6  wait            unit 0  ag
7  unpack          unit 0  ag
8  compute         mm add relu  (3 nodes)
9  wait            unit 1  ag
10 unpack          unit 1  ag
11 compute         mm add relu  (3 nodes)
12 wait            unit 2  ag
13 unpack          unit 2  ag
14 compute         mm add relu  (3 nodes)""")

    def test_backward_depth_1(self) -> None:
        gm = valid(prefetch_pass(bucketed(backward_graph(gathers=True)), depth=1))
        self.assertEqual(sched(gm), "AG2 AG1 wAG2 RS2 wRS2 AG0 wAG1 RS1 wRS1 wAG0 RS0 wRS0")

    def test_byte_cap_below_two_buckets_means_depth_0(self) -> None:
        bucket = WIDTH * (WIDTH + 1) * 4  # one unit's gathered w and b, fp32
        capped = valid(prefetch_pass(bucketed(forward_graph()), depth=2, max_bytes=2 * bucket - 1))
        depth0 = valid(prefetch_pass(bucketed(forward_graph()), depth=0))
        self.assertEqual(show(capped), show(depth0))
        two = valid(prefetch_pass(bucketed(forward_graph()), depth=2, max_bytes=2 * bucket))
        self.assertEqual(show(two), show(valid(prefetch_pass(bucketed(forward_graph()), depth=1))))

    def test_launch_order_is_first_use_order(self) -> None:
        for depth, cap in [(0, None), (1, None), (2, None), (2, 700), (1, 1)]:
            gm = bucketed(forward_graph(gather_order=(2, 0, 1)))
            self.assertEqual(units_of(gathers(gm)), [2, 0, 1])
            gm = valid(prefetch_pass(gm, depth=depth, max_bytes=cap))
            self.assertEqual(units_of(gathers(gm)), [0, 1, 2], (depth, cap))

    def test_negative_depth(self) -> None:
        with self.assertRaisesRegex(ValueError, "depth must be >= 0"):
            prefetch_pass(bucketed(forward_graph()), depth=-1)


class TestReduceScatter(TestCase):
    bucket = WIDTH * (WIDTH + 1) * 4  # one unit's full w and b grads, fp32

    def test_eager(self) -> None:
        gm = valid(reduce_scatter_pass(bucketed(backward_graph()), max_bytes=None))
        self.assertExpectedInline(show(gm), """\
0  compute         relu mm sum  (5 nodes)
1  pack            unit 2  rs
2  reduce_scatter  unit 2  rs                     288 B
3  compute         relu mm sum  (5 nodes)
4  pack            unit 1  rs
5  reduce_scatter  unit 1  rs                     288 B
6  compute         relu mm sum  (5 nodes)
7  pack            unit 0  rs
8  reduce_scatter  unit 0  rs                     288 B
9  wait            unit 2  rs
10 wait            unit 1  rs
11 wait            unit 0  rs
12 unpack          unit 2  rs
13 unpack          unit 1  rs
14 unpack          unit 0  rs""")

    def test_cap_of_one_bucket(self) -> None:
        gm = valid(reduce_scatter_pass(bucketed(backward_graph()), max_bytes=self.bucket))
        self.assertExpectedInline(show(gm), """\
0  compute         relu mm sum  (5 nodes)
1  pack            unit 2  rs
2  reduce_scatter  unit 2  rs                     288 B
3  compute         relu mm sum  (5 nodes)
4  wait            unit 2  rs
5  unpack          unit 2  rs
6  pack            unit 1  rs
7  reduce_scatter  unit 1  rs                     288 B
8  compute         relu mm sum  (5 nodes)
9  wait            unit 1  rs
10 unpack          unit 1  rs
11 pack            unit 0  rs
12 reduce_scatter  unit 0  rs                     288 B
13 wait            unit 0  rs
14 unpack          unit 0  rs""")

    def test_auto_cap_is_two_buckets(self) -> None:
        auto = valid(reduce_scatter_pass(bucketed(backward_graph()), max_bytes="auto"))
        two = valid(reduce_scatter_pass(bucketed(backward_graph()), max_bytes=2 * self.bucket))
        self.assertEqual(show(auto), show(two))
        self.assertEqual(sched(auto), "RS2 RS1 wRS2 RS0 wRS1 wRS0")

    def test_delayed(self) -> None:
        gm = valid(reduce_scatter_pass(bucketed(backward_graph(gathers=True)), schedule="delayed", max_bytes=None))
        self.assertExpectedInline(show(gm), """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag                     256 B
2  wait            unit 2  ag
3  unpack          unit 2  ag
4  compute         mm sum  (6 nodes)
5  pack            unit 1  ag
6  all_gather      unit 1  ag                     256 B
7  wait            unit 1  ag
8  unpack          unit 1  ag
9  pack            unit 2  rs
10 reduce_scatter  unit 2  rs                     288 B
11 compute         mm sum  (6 nodes)
12 pack            unit 0  ag
13 all_gather      unit 0  ag                     256 B
14 wait            unit 0  ag
15 unpack          unit 0  ag
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs                     288 B
18 compute         mm sum  (6 nodes)
19 pack            unit 0  rs
20 reduce_scatter  unit 0  rs                     288 B
21 wait            unit 2  rs
22 wait            unit 1  rs
23 wait            unit 0  rs
24 unpack          unit 2  rs
25 unpack          unit 1  rs
26 unpack          unit 0  rs""")

    def test_invalid_settings(self) -> None:
        with self.assertRaisesRegex(ValueError, "schedule must be one of"):
            reduce_scatter_pass(bucketed(backward_graph()), schedule="lazy")
        with self.assertRaisesRegex(ValueError, "max_bytes must be"):
            reduce_scatter_pass(bucketed(backward_graph()), max_bytes="lots")


class TestStreams(TestCase):
    def test_dedicated_groups(self) -> None:
        gm = streams_pass(bucketed(backward_graph(gathers=True, units=1)))
        check_streams(gm)
        self.assertEqual([fsdp_meta(n)["stream"] for n in launches(gm)], ["all_gather", "reduce_scatter"])
        self.assertEqual([fsdp_meta(n)["stream"] for n in waits(gm)], ["compute", "compute"])
        self.assertEqual([fsdp_meta(n)["waits_on"] for n in waits(gm)], ["all_gather", "reduce_scatter"])
        others = {fsdp_meta(n)["stream"] for n in gm.graph.nodes if n.op == "call_function" and n not in launches(gm)}
        self.assertEqual(others, {"compute"})

    def test_shared_group(self) -> None:
        gm = streams_pass(bucketed(backward_graph(gathers=True, units=1, ag="pg", rs="pg")))
        self.assertEqual([fsdp_meta(n)["stream"] for n in launches(gm)], ["comm", "comm"])
        self.assertEqual([fsdp_meta(n)["waits_on"] for n in waits(gm)], ["comm", "comm"])

    def test_check_streams_catches_tampering(self) -> None:
        gm = streams_pass(bucketed(backward_graph(units=1)))
        fsdp_meta(scatters(gm)[0])["stream"] = "all_gather"
        with self.assertRaisesRegex(AssertionError, "annotated stream 'all_gather'.*'reduce_scatter'"):
            check_streams(gm)


class TestReorder(TestCase):
    def test_default_keeps_order(self) -> None:
        gm, _ = abcd()
        before = names(gm)
        reorder(gm.graph)
        self.assertEqual(names(gm), before)

    def test_keys_move_earlier_but_not_before_inputs(self) -> None:
        gm, n = abcd()
        reorder(gm.graph, {n["b"]: -1})
        self.assertEqual(names(gm), ["x_1", "y_1", "mul", "add", "add_1", "relu", "output"])
        reorder(gm.graph, {n["d"]: -10, n["c"]: -5})  # wanted first: placed right after their inputs
        self.assertEqual(names(valid(gm)), ["x_1", "y_1", "mul", "add", "add_1", "relu", "output"])

    def test_before_mapping(self) -> None:
        gm, n = abcd()
        reorder(gm.graph, before={n["b"]: n["a"]})
        self.assertEqual(names(gm), ["x_1", "y_1", "mul", "add", "add_1", "relu", "output"])

    def test_placeholders_first_output_last(self) -> None:
        gm = trace(lambda x: x.relu() + torch.ones(2), ints(2))
        self.assertEqual(names(gm), ["x_1", "relu", "ones", "add", "output"])
        ones, add = list(gm.graph.nodes)[2:4]
        reorder(gm.graph, {ones: -100, add: 1e9})
        self.assertEqual(names(valid(gm)), ["x_1", "ones", "relu", "add", "output"])

    def test_repairs_dependency_order(self) -> None:
        gm, n = abcd()
        n["a"].prepend(n["d"])  # relu before everything it reads
        n["a"].prepend(n["c"])
        with self.assertRaises(RuntimeError):
            gm.graph.lint()
        reorder(gm.graph)
        self.assertEqual(names(valid(gm)), ["x_1", "y_1", "add", "mul", "add_1", "relu", "output"])
        self.assertEqual(gm(torch.ones(2), torch.ones(2)).tolist(), [4.0, 4.0])


class TestRunner(TestCase):
    def test_full_pipeline_on_backward(self) -> None:
        gm = run_passes(backward_graph(gathers=True), PIPELINE)
        self.assertExpectedInline(show(gm), """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag     all_gather      256 B
4  wait            unit 2  ag     all_gather
5  unpack          unit 2  ag
6  compute         mm sum  (6 nodes)
7  pack            unit 2  rs
8  reduce_scatter  unit 2  rs     reduce_scatter  288 B
9  pack            unit 0  ag
10 all_gather      unit 0  ag     all_gather      256 B
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 pack            unit 1  rs
15 reduce_scatter  unit 1  rs     reduce_scatter  288 B
16 wait            unit 0  ag     all_gather
17 unpack          unit 0  ag
18 compute         mm sum  (6 nodes)
19 wait            unit 2  rs     reduce_scatter
20 unpack          unit 2  rs
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 1  rs     reduce_scatter
24 wait            unit 0  rs     reduce_scatter
25 unpack          unit 1  rs
26 unpack          unit 0  rs""")

    def test_disabled_pass_is_skipped(self) -> None:
        gm = run_passes(forward_graph(), PIPELINE, disabled=["bucket", "prefetch"])
        self.assertEqual(len(gathers(gm)), 6)
        self.assertEqual(ops(gm), ops(lowered(forward_graph())))

    def test_unknown_disabled_name(self) -> None:
        with self.assertRaisesRegex(ValueError, r"\['nope'\].*known passes: \['lower_unshard', .*'streams'\]"):
            run_passes(forward_graph(), PIPELINE, disabled=["bucket", "nope"])

    def test_broken_graph_names_the_pass(self) -> None:
        def breaker(gm: fx.GraphModule) -> fx.GraphModule:
            first, second = [n for n in gm.graph.nodes if n.op == "call_function"][:2]
            first.prepend(second)  # second reads first
            return gm

        passes = [PIPELINE[0], NamedPass("breaker", breaker)]
        with self.assertRaisesRegex(RuntimeError, "pass 'breaker' left a malformed graph"):
            run_passes(forward_graph(), passes)


def test_log_diff(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="passes.runner"):
        run_passes(forward_graph(units=1), PIPELINE[:3], log_diff=True)
    diffs = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "passes.runner"]
    assert len(diffs) == 3
    assert "--- before lower_unshard" in diffs[0].getMessage()
    assert "+    all_gather_into_tensor = " in diffs[0].getMessage()
    assert diffs[1].getMessage() == ""  # no reduce_grad in a forward graph: no change
    assert "+    cat = torch.ops.aten.cat.default" in diffs[2].getMessage()


@pytest.mark.parametrize("name", [p.name for p in PIPELINE])
def test_absent_pattern_leaves_graph_unchanged(name: str) -> None:
    plain = trace(lambda x, w: torch.relu(x @ w).sum(0), ints(2, 4), ints(4, 4))
    fn = next(p.fn for p in PIPELINE if p.name == name)
    code = plain.code
    assert fn(plain) is plain
    assert valid(plain).code == code
    # and on a graph that has only the other kind of marker or collective, or nothing to merge
    other = {"lower_unshard": lambda: lowered(backward_graph()), "lower_reduce_grad": forward_graph,
             "bucket": lambda: lowered(one_param([4, 4], 2)), "prefetch": lambda: lowered(backward_graph()),
             "reduce_scatter": lambda: lowered(forward_graph())}
    if name in other:
        gm = valid(other[name]())
        code = gm.code
        assert valid(fn(gm)).code == code


def test_prefetch_depth_holds_for_many_units() -> None:
    gm = valid(prefetch_pass(gather_chain(520), depth=1))
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    uses = [next(iter(wait_of(ag).users)) for ag in gathers(gm)]  # x * w_k
    late = [k for k, ag in enumerate(gathers(gm)) if k > 0 and pos[ag] > pos[uses[k - 1]]]
    assert late == []  # a fixed per-unit tie-break once pushed units 500.. past the gap


def test_delayed_waits_for_the_next_unit() -> None:
    gm = bucketed(backward_graph(gathers=True, grads_first=True))  # each unit reads its w after its grads
    gm = valid(reduce_scatter_pass(gm, schedule="delayed", max_bytes=None))
    # as with propagation first (test_delayed): RS2 after AG1's wait, RS1 after AG0's, RS0 at the end
    assert sched(gm) == "AG2 wAG2 AG1 wAG1 RS2 AG0 wAG0 RS1 RS0 wRS2 wRS1 wRS0"
