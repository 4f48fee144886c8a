"""Unit tests of the pass machinery (``order.reorder``, ``runner.run_passes``, absent patterns) on small
hand-built graphs (see ``pass_graphs``): no process group."""

from __future__ import annotations

import logging

import pytest
import torch
from expecttest import TestCase
from torch import fx

from fsdp_compile.passes import NamedPass, run_passes
from fsdp_compile.passes.order import reorder
from fsdp_compile.passes.predicates import gathers_needed

from .pass_graphs import (
    PIPELINE, abcd, backward_graph, forward_graph, gathers, ints, lowered, names, one_param, ops, show, trace,
    valid,
)


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
14 wait            unit 2  rs     reduce_scatter
15 unpack          unit 2  rs
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 wait            unit 0  ag     all_gather
19 unpack          unit 0  ag
20 compute         mm sum  (6 nodes)
21 wait            unit 1  rs     reduce_scatter
22 unpack          unit 1  rs
23 pack            unit 0  rs
24 reduce_scatter  unit 0  rs     reduce_scatter  288 B
25 wait            unit 0  rs     reduce_scatter
26 unpack          unit 0  rs""")

    def test_disabled_pass_is_skipped(self) -> None:
        gm = run_passes(forward_graph(), PIPELINE, disabled=["prefetch"])
        self.assertEqual(len(gathers(gm)), 3)
        self.assertEqual(ops(gm), ops(run_passes(forward_graph(), [p for p in PIPELINE if p.name != "prefetch"])))

    def test_unknown_disabled_name(self) -> None:
        with self.assertRaisesRegex(ValueError, r"\['nope'\].*known passes: \['lower', .*'streams'\]"):
            run_passes(forward_graph(), PIPELINE, disabled=["prefetch", "nope"])

    def test_broken_graph_names_the_pass(self) -> None:
        def breaker(gm: fx.GraphModule) -> fx.GraphModule:
            first, second = [n for n in gm.graph.nodes if n.op == "call_function"][:2]
            first.prepend(second)  # second reads first
            return gm

        passes = [PIPELINE[0], NamedPass("breaker", breaker)]
        with self.assertRaisesRegex(RuntimeError, "pass 'breaker' left a malformed graph"):
            run_passes(forward_graph(), passes)


def test_log_diff(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fsdp_compile.passes.runner"):
        run_passes(forward_graph(units=1), PIPELINE[:3], log_diff=True)
    diffs = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "fsdp_compile.passes.runner"]
    assert len(diffs) == 3
    assert "--- before lower" in diffs[0].getMessage()
    assert "+    pack_shards = torch.ops.fsdp.pack_shards.default" in diffs[0].getMessage()
    assert "+    all_gather_into_tensor = " in diffs[0].getMessage()
    assert diffs[1].getMessage() == ""  # one unit: nothing to prefetch


@pytest.mark.parametrize("name", [p.name for p in PIPELINE])
def test_absent_pattern_leaves_graph_unchanged(name: str) -> None:
    plain = trace(lambda x, w: torch.relu(x @ w).sum(0), ints(2, 4), ints(4, 4))
    fn = next(p.fn for p in PIPELINE if p.name == name)
    code = plain.code
    assert fn(plain) is plain
    assert valid(plain).code == code
    # and on a graph that has only the other kind of marker or collective, or nothing to merge
    other = {"lower": lambda: lowered(one_param([4, 4], 2)), "prefetch": lambda: lowered(backward_graph()),
             "reduce_scatter": lambda: lowered(forward_graph())}
    if name in other:
        gm = valid(other[name]())
        code = gm.code
        assert valid(fn(gm)).code == code


def test_gathers_needed_follows_inputs_in_any_order() -> None:
    """``predicates.gathers_needed`` (NOTE [gradients in stretches]): each node's all-gather waits, through
    its inputs, also in a graph not yet in dependency order (``bucket_pass`` splices before it reorders)."""
    c10d = torch.ops._c10d_functional
    graph = fx.Graph()
    x = graph.placeholder("x")
    gathered = graph.call_function(c10d.wait_tensor.default, (graph.call_function(
        c10d.all_gather_into_tensor.default, (x, 2, "ag")),))
    alone = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    needs = graph.call_function(torch.ops.aten.mul.Tensor, (gathered, alone))
    graph.output((needs,))
    alone.prepend(needs)  # a user before its inputs
    masks = gathers_needed(fx.GraphModule(torch.nn.Module(), graph))
    assert (masks[x], masks[alone], masks[gathered], masks[needs]) == (0, 0, 1, 1)
