"""Flat markers (NOTE [flat markers]): ``group_markers_pass`` makes one marker of the markers of one piece
an outlined call, or a unit's inline code, reads of a flat unit, and leaves a unit not laid out flat its
markers; ``lower_markers_pass`` (NOTE [one lowering]) lowers a flat marker to its unit's bucket: the flat
gathered as it is, the reduce-scatter's output the flat's gradient, each as the markers' eager bodies
compute on two simulated ranks. Small hand-built graphs, no process group."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from expecttest import TestCase
from torch import Tensor, fx

from fsdp_compile.passes.capture.group_markers import group_markers_pass
from fsdp_compile.passes.graph_ops import NAMES_SEP, REDUCE_GRAD_ARGS, UNSHARD_ARGS, arg_names, flatten_shapes
from fsdp_compile.passes.lower.markers import lower_markers_pass
from fsdp_compile.passes.predicates import fsdp_meta, is_reduce_grad, is_unshard, marker_args

from .pass_graphs import (
    WIDTH,
    assert_same,
    gathers,
    ints,
    launches,
    ops,
    run,
    scatters,
    trace,
    unshard,
    valid,
)

UNITS = 3


def _shapes(world: int) -> tuple[list[list[int]], list[list[int]]]:
    """A unit's (shard shapes, full shapes): w (WIDTH, WIDTH) and b (WIDTH,), its flat their shards in turn."""
    rows = -(-WIDTH // world)
    return [[rows, WIDTH], [rows]], [[WIDTH, WIDTH], [WIDTH]]


def _flats(world: int) -> list[Tensor]:
    return [ints(sum(torch.Size(s).numel() for s in _shapes(world)[0])) for _ in range(UNITS)]


def _gather_flat(flat: Tensor, unit: int, world: int, param_dtype: torch.dtype | None = None) -> list[Tensor]:
    shard, full = _shapes(world)
    return torch.ops.fsdp.unshard(flat, *flatten_shapes(shard), *flatten_shapes(full),
                                  NAMES_SEP.join([f"w{unit}", f"b{unit}"]), world, unit, "ag", "rs", "", 1, True,
                                  param_dtype, None)


def _reduce_flat(grads: list[Tensor], unit: int, world: int, reduce_dtype: torch.dtype | None = None) -> Tensor:
    shard, _ = _shapes(world)
    return torch.ops.fsdp.reduce_grad(grads, *flatten_shapes(shard), NAMES_SEP.join([f"w{unit}", f"b{unit}"]),
                                      world, unit, "ag", "rs", "", 1, reduce_dtype, torch.float32)


def _forward(world: int = 2, *, loose: bool = False, unread: bool = False, param_dtype: torch.dtype | None = None,
             ) -> fx.GraphModule:
    """Per unit k one flat gather of w_k and b_k, then ``x = relu(x @ w_k + b_k)``. ``loose``: unit 1
    also gathers its w by a marker of its piece of the flat (and reads both); ``unread``:
    unit 2's b is never read."""
    torch.manual_seed(0)  # each call, the same example inputs
    rows = _shapes(world)[0][0][0]

    def fn(x: Tensor, *flats: Tensor) -> Tensor:
        for k in range(UNITS):
            w, b = _gather_flat(flats[k], k, world, param_dtype)
            if loose and k == 1:
                piece = flats[k].narrow(0, 0, rows * WIDTH).view(rows, WIDTH)
                w = w + unshard(piece, [WIDTH, WIDTH], k, "w1_again", world=world, param_dtype=param_dtype)
            x = torch.relu(x.to(w.dtype) @ w + (0 if unread and k == 2 else b)).to(x.dtype)
        return x

    gm = trace(fn, ints(2, WIDTH), *_flats(world))
    gm.graph.eliminate_dead_code()  # (an output nothing reads has no getitem, as in AOTAutograd's graphs)
    return valid(gm)


def _backward(world: int = 2, reduce_dtype: torch.dtype | None = None) -> fx.GraphModule:
    """Units in reverse: each re-gathers its w and b (flat), computes their full gradients and reduces
    them with one ``reduce_grad`` to its flat's gradient."""
    torch.manual_seed(0)

    def fn(g: Tensor, acts: Tensor, *flats: Tensor) -> list[Tensor]:
        out: list[Tensor] = []
        for k in reversed(range(UNITS)):
            w, _ = _gather_flat(flats[k], k, world)
            gw, gb = acts[k].t() @ g, g.sum(0)
            out.append(_reduce_flat([gw, gb], k, world, reduce_dtype))
            g = g @ w.t()
        return [g, *out]

    return trace(fn, ints(2, WIDTH), ints(UNITS, 2, WIDTH), *_flats(world))


def _lowered(gm: fx.GraphModule, **options: object) -> fx.GraphModule:
    return valid(lower_markers_pass(gm, **options))  # type: ignore[arg-type]


def _markers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_unshard(n) or is_reduce_grad(n)]


def _flat_markers(gm: fx.GraphModule) -> list[fx.Node]:
    """The markers of several pieces."""
    return [n for n in _markers(gm) if len(marker_args(n).shard_ranks) > 1]


def _one_piece(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in _markers(gm) if len(marker_args(n).shard_ranks) == 1]


class TestLowerFlat(TestCase):
    def _as_eager(self, make: Callable[[], fx.GraphModule], **options: object) -> fx.GraphModule:
        """Lowered: no marker left, the numbers of the markers' eager bodies on the simulated ranks."""
        got = _lowered(make(), **options)
        self.assertEqual(_markers(got), [])
        assert_same(run(got), run(make()))
        return got

    def test_a_flat_is_gathered_as_it_is(self) -> None:
        """(NOTE [a flat gathers as it is]) One all-gather of the flat itself per unit; in bf16 the cast
        packs it (in place, given the rank)."""
        for world in (1, 2):
            for rank_of in (None, lambda group: 0):
                gm = self._as_eager(lambda world=world: _forward(world), rank_of=rank_of, elide_single_rank=False)
                flats = [n for n in gm.graph.nodes if n.op == "placeholder"][1:]
                self.assertEqual([ag.args[0] for ag in gathers(gm)], flats)
                self.assertEqual([fsdp_meta(ag)["params"] for ag in gathers(gm)], [[f"w{k}", f"b{k}"] for k in range(UNITS)])
        gm = self._as_eager(lambda: _forward(param_dtype=torch.bfloat16), rank_of=lambda group: 0)
        self.assertEqual(ops(gm).count("pack_shards"), UNITS)

    def test_the_flat_gradient_is_the_reduce_scatter_output_whole(self) -> None:
        for world, reduce_dtype in ((1, None), (2, None), (2, torch.bfloat16)):
            gm = self._as_eager(lambda: _backward(world, reduce_dtype), rank_of=lambda group: 0,
                                elide_single_rank=False)
            self.assertNotIn("cat", ops(gm))
            self.assertEqual(len(scatters(gm)), UNITS)
            outputs = gm.graph.output_node().args[0][1:]
            self.assertTrue(all(o.target in (torch.ops.aten.div.Tensor, torch.ops._c10d_functional.wait_tensor.default,
                                             torch.ops.prims.convert_element_type.default) for o in outputs))

    def test_no_per_parameter_collective_is_made(self) -> None:
        gm = _lowered(_backward(), rank_of=lambda group: 0)
        self.assertEqual((len(gathers(gm)), len(scatters(gm))), (UNITS, UNITS))
        self.assertEqual([fsdp_meta(n)["params"] for n in launches(gm)],
                         [["w2", "b2"], ["w2", "b2"], ["w1", "b1"], ["w1", "b1"], ["w0", "b0"], ["w0", "b0"]])
        names = ops(gm)
        unit = names[: len(names) // UNITS]
        self.assertEqual(names, unit * UNITS)
        self.assertExpectedInline(" ".join(unit), """\
all_gather_into_tensor wait_tensor copy_out_rows getitem getitem select t mm sum pack_rows reduce_scatter_tensor \
wait_tensor div t mm""")

    def test_every_flat_marker_is_lowered_here(self) -> None:
        cases: dict[str, tuple[Callable[[], fx.GraphModule], dict[str, object], int]] = {
            "unit 1 has a marker of its own too": (lambda: _forward(loose=True), {}, UNITS + 1),
            "unit 2's b is never read: its w alone is packed": (lambda: _forward(unread=True), {}, UNITS),
            "a world of one, its collectives elided": (lambda: _forward(1), {}, 0),
            "the weights keep collectives of their own": (_forward, {"alone_bytes": 200}, 2 * UNITS),
        }
        for why, (make, options, collectives) in cases.items():
            with self.subTest(why):
                gm = self._as_eager(make, **options)
                self.assertEqual(len(gathers(gm)), collectives)
        gm = _lowered(_forward(unread=True))
        self.assertEqual([fsdp_meta(ag)["params"] for ag in gathers(gm)][-1], ["w2"])
        gm = self._as_eager(lambda: _backward(reduce_dtype=None), alone_bytes=200)  # pieces alone, joined
        self.assertEqual((len(scatters(gm)), ops(gm).count("cat")), (2 * UNITS, UNITS))


def _outlined_call(flat: bool, inline: bool = False, twice: bool = False) -> fx.GraphModule:
    """One outlined call as Dynamo hands it on, its markers hoisted out of the body::

        w = unshard(s_w, ...)[0]; b = unshard(s_b, ...)[0]; invoke_subgraph(body, "block", x, w, b)

    ``flat``: the shards are pieces of one flat graph input, ``narrow`` (and ``view``) of it, as a flat
    unit's are read; else each a graph input of its own, as a unit not laid out flat has them."""
    (shard_w, shard_b), _ = _shapes(2)
    graph = fx.Graph()

    def valued(node: fx.Node, shape: list[int]) -> fx.Node:
        node.meta["example_value"] = torch.zeros(shape)
        return node

    x = valued(graph.placeholder("x"), [2, WIDTH])
    n_w, n_b = shard_w[0] * shard_w[1], shard_b[0]
    if flat:
        base = valued(graph.placeholder("flat"), [n_w + n_b])
        s_w = valued(graph.call_method("view", (valued(graph.call_method("narrow", (base, 0, 0, n_w)), [n_w]),
                                                *shard_w)), shard_w)
        s_b = valued(graph.call_method("narrow", (base, 0, n_w, n_b)), shard_b)
    else:
        s_w, s_b = valued(graph.placeholder("s_w"), shard_w), valued(graph.placeholder("s_b"), shard_b)
    def read(s: fx.Node, shard: list[int], full: list[int], name: str) -> fx.Node:
        marker = graph.call_function(torch.ops.fsdp.unshard.default, (
            s, *flatten_shapes([shard]), *flatten_shapes([full]), name, 2, 0, "ag", "rs", "", 1, True, None, None))
        marker.meta["example_value"] = [torch.zeros(full)]
        return valued(graph.call_function(operator.getitem, (marker, 0)), full)

    w, b = read(s_w, shard_w, [WIDTH, WIDTH], "w"), read(s_b, shard_b, [WIDTH], "b")
    if inline:  # the unit's code in the graph itself (``twice``: w read by a second marker too)
        if twice:
            w = graph.call_function(torch.add, (w, read(s_w, shard_w, [WIDTH, WIDTH], "w")))
        call = graph.call_function(torch.add, (graph.call_function(torch.matmul, (x, w)), b))
    else:
        call = graph.call_function(torch.ops.higher_order.invoke_subgraph, (graph.get_attr("body"), "block", x, w, b))
    graph.output((call,))
    root = torch.nn.Module()
    root.body = fx.symbolic_trace(lambda x, w, b: (torch.relu(x @ w + b),))  # type: ignore[assignment]
    return fx.GraphModule(root, graph)


class TestGroupMarkers(TestCase):
    def test_an_outlined_call_reads_a_flat_unit_through_one_flat_marker(self) -> None:
        gm = group_markers_pass(_outlined_call(flat=True))
        (marker,) = _flat_markers(gm)
        self.assertFalse(_one_piece(gm) + [n for n in gm.graph.nodes if n.op == "call_method"])  # pieces erased
        self.assertEqual(marker.args[0].name, "flat")
        (call,) = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
        self.assertEqual([(a.args[0], a.args[1]) for a in call.args[3:]], [(marker, 0), (marker, 1)])
        self.assertEqual(marker.args[5], NAMES_SEP.join(["w", "b"]))

    def test_inline_reads_of_a_flat_unit_become_one_flat_marker(self) -> None:
        gm = group_markers_pass(_outlined_call(flat=True, inline=True))
        (marker,) = _flat_markers(gm)
        self.assertEqual(marker.args[0].name, "flat")
        self.assertFalse(_one_piece(gm))
        gm = group_markers_pass(_outlined_call(flat=True, inline=True, twice=True))  # w's piece read twice
        self.assertEqual((_flat_markers(gm), len(_one_piece(gm))), ([], 3))
        gm = _outlined_call(flat=True, inline=True)  # NOTE [grad mode of a flat marker]: b read under no_grad
        next(n for n in gm.graph.nodes if is_unshard(n) and marker_args(n).names == "b").meta["example_value"] = \
            [torch.zeros(WIDTH)]
        next(n for n in gm.graph.nodes if is_unshard(n) and marker_args(n).names == "w").meta["example_value"] = \
            [torch.zeros(WIDTH, WIDTH, requires_grad=True)]
        self.assertEqual(_flat_markers(group_markers_pass(gm)), [])

    def test_a_unit_not_laid_out_flat_keeps_its_per_parameter_markers(self) -> None:
        before = [str(n.format_node()) for n in _outlined_call(flat=False).graph.nodes]
        gm = group_markers_pass(_outlined_call(flat=False))
        self.assertEqual([str(n.format_node()) for n in gm.graph.nodes], before)
        self.assertEqual([marker_args(n).names for n in gm.graph.nodes if is_unshard(n)], ["w", "b"])


def test_every_marker_follows_the_one_marker_spec() -> None:
    """(NOTE [one marker spec]) The markers' schemas name the arguments of ``UNSHARD_ARGS`` /
    ``REDUCE_GRAD_ARGS``, in order and with those types; the reader ``marker_args`` and the arguments
    ``fully_shard`` builds for a read use those names."""
    def spelled(spec: tuple[tuple[str, str], ...]) -> str:
        return ", ".join(f"{type_} {name}" for name, type_ in spec)

    assert str(torch.ops.fsdp.unshard.default._schema).replace("=None", "") == (
        f"fsdp::unshard({spelled(UNSHARD_ARGS)}) -> Tensor[]")
    assert str(torch.ops.fsdp.reduce_grad.default._schema) == f"fsdp::reduce_grad({spelled(REDUCE_GRAD_ARGS)}) -> Tensor"
    gm = _outlined_call(flat=False)
    marker = next(n for n in gm.graph.nodes if is_unshard(n))
    assert tuple(vars(marker_args(marker))) == arg_names(UNSHARD_ARGS)
