"""Unit tests of the scheduling passes (``prefetch``, ``reduce_scatter``, ``streams``) on small hand-built
graphs (see ``pass_graphs``): no process group."""

from __future__ import annotations

from expecttest import TestCase

from fsdp_compile.passes.predicates import fsdp_meta, wait_of
from fsdp_compile.passes.schedule.prefetch import prefetch_pass
from fsdp_compile.passes.schedule.reduce_scatter import reduce_scatter_pass
from fsdp_compile.passes.schedule.streams import check_streams, streams_pass

from .pass_graphs import (
    WIDTH, backward_graph, bucketed, forward_graph, gather_chain, gathers, launches, scatters, sched, show,
    units_of, valid, waits,
)


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

    def test_first_group_launches_before_the_graph_s_first_compute(self) -> None:
        # Each unit's own gradients come before it propagates through its gathered weight: unit 2's
        # (mm sum) need no all-gather, so at depth 1 its all-gather runs under them; at depth 0 it waits.
        graph = lambda: bucketed(backward_graph(gathers=True, grads_first=True))  # noqa: E731
        self.assertEqual(sched(valid(prefetch_pass(graph(), depth=0))),
                         "RS2 wRS2 AG2 wAG2 RS1 wRS1 AG1 wAG1 RS0 wRS0 AG0 wAG0")
        gm = valid(prefetch_pass(graph(), depth=1))
        self.assertEqual(sched(gm), "AG2 RS2 wRS2 AG1 wAG2 RS1 wRS1 AG0 wAG1 RS0 wRS0 wAG0")
        self.assertEqual(show(gm).splitlines()[2], "2  compute         mm sum  (4 nodes)")

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

    def test_auto_is_one_unit_in_flight(self) -> None:
        # (NOTE [one unit in flight]) A unit's reduce-scatter is waited just before the next unit's launch,
        # as a cap of one bucket does when the buckets are alike
        auto = valid(reduce_scatter_pass(bucketed(backward_graph()), max_bytes="auto"))
        one = valid(reduce_scatter_pass(bucketed(backward_graph()), max_bytes=self.bucket))
        self.assertEqual(show(auto), show(one))
        self.assertEqual(sched(auto), "RS2 wRS2 RS1 wRS1 RS0 wRS0")

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
