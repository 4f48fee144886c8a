"""``lower_grouped_pass`` (NOTE [grouped lowering]): a grouped marker lowered straight to its unit's bucket
gives the graph that expanding, lowering each parameter and bucketing give, node for node; and it is left
alone wherever that path would give something else. Small hand-built graphs, no process group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from expecttest import TestCase
from torch import Tensor, fx

from passes.graph_ops import (
    NAMES_SEP,
    REDUCE_GRAD_ARGS,
    REDUCE_GRAD_SHARED,
    UNSHARD_ARGS,
    UNSHARD_SHARED,
    arg_names,
    flatten_shapes,
)
from passes.lower.bucket import bucket_pass
from passes.lower.expand_markers import expand_markers_pass
from passes.lower.grouped import lower_grouped_pass
from passes.lower.per_param import lower_reduce_grad_pass, lower_unshard_pass
from passes.predicates import (
    ReduceGradArgs,
    UnshardArgs,
    fsdp_meta,
    is_grouped_reduce_grad,
    is_grouped_unshard,
    is_reduce_grad,
    is_unshard,
)

from .pass_graphs import WIDTH, assert_same, gathers, ints, launches, ops, run, scatters, trace, valid

UNITS = 3


def _gather_many(shards: list[Tensor], shapes: list[list[int]], unit: int, names: list[str], world: int,
                 param_dtype: torch.dtype | None = None) -> list[Tensor]:
    ranks, dims = flatten_shapes(shapes)
    return torch.ops.fsdp.unshard_many(shards, ranks, dims, NAMES_SEP.join(names), world, unit, "ag", "rs", "", 1,
                                       True, param_dtype, None)


def _reduce_many(grads: list[Tensor], shapes: list[list[int]], unit: int, names: list[str], world: int,
                 reduce_dtype: torch.dtype | None = None) -> list[Tensor]:
    ranks, dims = flatten_shapes(shapes)
    return torch.ops.fsdp.reduce_grad_many(grads, ranks, dims, NAMES_SEP.join(names), world, unit, "ag", "rs", "", 1,
                                           reduce_dtype, torch.float32)


def _forward(world: int = 2, *, loose: bool = False, unread: bool = False, param_dtype: torch.dtype | None = None,
             ) -> fx.GraphModule:
    """Per unit k one grouped gather of w_k (WIDTH, WIDTH) and b_k (WIDTH,), then ``x = relu(x @ w_k + b_k)``.
    ``loose``: unit 1 also gathers its w by a marker of its own (and reads both); ``unread``: unit 2's b is never read."""
    torch.manual_seed(0)  # each call, the same example inputs
    rows = -(-WIDTH // world)

    def fn(x: Tensor, *ss: Tensor) -> Tensor:
        for k in range(UNITS):
            w, b = _gather_many([ss[2 * k], ss[2 * k + 1]], [[WIDTH, WIDTH], [WIDTH]], k, [f"w{k}", f"b{k}"], world,
                                param_dtype)
            if loose and k == 1:
                w = w + torch.ops.fsdp.unshard(ss[2 * k], [WIDTH, WIDTH], world, k, "w1_again", "ag", "rs", "", 1, True,
                                           param_dtype, None)
            x = torch.relu(x.to(w.dtype) @ w + (0 if unread and k == 2 else b)).to(x.dtype)
        return x

    shards = [t for _ in range(UNITS) for t in (ints(rows, WIDTH), ints(rows))]
    gm = trace(fn, ints(2, WIDTH), *shards)
    gm.graph.eliminate_dead_code()  # (an output nothing reads has no getitem, as in AOTAutograd's graphs)
    return valid(gm)


def _backward(world: int = 2, reduce_dtype: torch.dtype | None = None) -> fx.GraphModule:
    """Units in reverse: each re-gathers its w and b (grouped), computes their full gradients and reduces
    them with one grouped ``reduce_grad_many``."""
    torch.manual_seed(0)
    rows = -(-WIDTH // world)

    def fn(g: Tensor, acts: Tensor, *ss: Tensor) -> list[Tensor]:
        out: list[Tensor] = []
        for k in reversed(range(UNITS)):
            w, _ = _gather_many([ss[2 * k], ss[2 * k + 1]], [[WIDTH, WIDTH], [WIDTH]], k, [f"w{k}", f"b{k}"], world)
            gw, gb = acts[k].t() @ g, g.sum(0)
            out += _reduce_many([gw, gb], [[rows, WIDTH], [rows]], k, [f"w{k}", f"b{k}"], world, reduce_dtype)
            g = g @ w.t()
        return [g, *out]

    shards = [t for _ in range(UNITS) for t in (ints(rows, WIDTH), ints(rows))]
    return trace(fn, ints(2, WIDTH), ints(UNITS, 2, WIDTH), *shards)


def _per_parameter(gm: fx.GraphModule, *, elide_single_rank: bool = True, **bucket: object) -> fx.GraphModule:
    """The path without the shortcut: expand, lower each parameter, bucket."""
    gm = valid(expand_markers_pass(gm))
    gm = valid(lower_unshard_pass(gm, elide_single_rank=elide_single_rank))
    gm = valid(lower_reduce_grad_pass(gm, elide_single_rank=elide_single_rank))
    return valid(bucket_pass(gm, **bucket))  # type: ignore[arg-type]


def _direct(gm: fx.GraphModule, **options: object) -> fx.GraphModule:
    return _per_parameter(valid(lower_grouped_pass(gm, **options)), **options)  # type: ignore[arg-type]


def _normal(gm: fx.GraphModule) -> list[str]:
    """Every node with its inputs by position, fake value and annotations: equal lists are the same graph
    up to node names."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = []
    for n in gm.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        v = n.meta.get("val")
        shape = (tuple(v.shape), v.dtype) if isinstance(v, Tensor) else None
        rows.append(f"{n.op} {n.target} {args} {shape} {sorted(fsdp_meta(n).items())}")
    return rows


def _grouped(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_grouped_unshard(n) or is_grouped_reduce_grad(n)]


class TestLowerGrouped(TestCase):
    def _same_as_per_parameter(self, make: Callable[[], fx.GraphModule], **options: object) -> fx.GraphModule:
        want = _per_parameter(make(), **options)  # type: ignore[arg-type]
        got = _direct(make(), **options)
        self.assertEqual(_normal(got), _normal(want))
        reference = valid(expand_markers_pass(make()))  # the markers' eager bodies, on the simulated ranks
        assert_same(run(got), run(reference))
        return got

    def test_the_bucket_is_what_lowering_and_bucketing_give(self) -> None:
        for world in (1, 2):
            for rank_of in (None, lambda group: 0):
                self._same_as_per_parameter(lambda: _forward(world), rank_of=rank_of, elide_single_rank=False)
                self._same_as_per_parameter(lambda: _backward(world), rank_of=rank_of, elide_single_rank=False)
        self._same_as_per_parameter(lambda: _forward(param_dtype=torch.bfloat16))
        self._same_as_per_parameter(lambda: _backward(reduce_dtype=torch.bfloat16))

    def test_no_per_parameter_collective_is_made(self) -> None:
        gm = valid(lower_grouped_pass(_backward(), rank_of=lambda group: 0))
        self.assertEqual(_grouped(gm), [])
        self.assertFalse([n for n in gm.graph.nodes if is_unshard(n) or is_reduce_grad(n)])
        self.assertEqual((len(gathers(gm)), len(scatters(gm))), (UNITS, UNITS))
        self.assertEqual([fsdp_meta(n)["params"] for n in launches(gm)],
                         [["w2", "b2"], ["w2", "b2"], ["w1", "b1"], ["w1", "b1"], ["w0", "b0"], ["w0", "b0"]])
        names = ops(gm)
        unit = names[: len(names) // UNITS]
        self.assertEqual(names, unit * UNITS)
        self.assertExpectedInline(" ".join(unit), """\
pack_shards slice all_gather_into_tensor_out wait_tensor copy_out_rows getitem getitem select t mm sum pack_rows \
reduce_scatter_tensor wait_tensor div as_strided as_strided t mm""")

    def test_left_alone_where_the_per_parameter_path_gives_something_else(self) -> None:
        cases: dict[str, tuple[Callable[[], fx.GraphModule], dict[str, object], int]] = {
            "unit 1 has a marker of its own too": (lambda: _forward(loose=True), {}, 1),
            "unit 2's b is never read": (lambda: _forward(unread=True), {}, 1),
            "a world of one, its collectives elided": (lambda: _forward(1), {}, UNITS),
            "the weights keep collectives of their own": (_forward, {"alone_bytes": 200}, UNITS),
        }
        for why, (make, bucket, left) in cases.items():
            with self.subTest(why):
                kept = lower_grouped_pass(make(), **bucket)  # type: ignore[arg-type]
                self.assertEqual(len(_grouped(kept)), left)
                self._same_as_per_parameter(make, **bucket)


def test_every_marker_follows_the_one_marker_spec() -> None:
    """NOTE [one marker spec]: the markers' Python signatures (fsdp_compile/api/markers.py, which
    ``torch.library.custom_op`` needs) and the readers ``UnshardArgs`` / ``ReduceGradArgs`` name the
    arguments of ``UNSHARD_ARGS`` / ``REDUCE_GRAD_ARGS``, in order and with those schema types; the
    grouped markers end with the shared ones."""
    def spelled(spec: tuple[tuple[str, str], ...]) -> str:
        return ", ".join(f"{type_} {name}" for name, type_ in spec)

    assert str(torch.ops.fsdp.unshard.default._schema).replace("=None", "") == (
        f"fsdp::unshard({spelled(UNSHARD_ARGS)}) -> Tensor")
    assert str(torch.ops.fsdp.reduce_grad.default._schema) == f"fsdp::reduce_grad({spelled(REDUCE_GRAD_ARGS)}) -> Tensor"
    assert tuple(UnshardArgs.__dataclass_fields__) == arg_names(UNSHARD_ARGS)
    assert tuple(ReduceGradArgs.__dataclass_fields__) == arg_names(REDUCE_GRAD_ARGS)
    for op, shared in [(torch.ops.fsdp.unshard_many, UNSHARD_SHARED), (torch.ops.fsdp.unshard_flat, UNSHARD_SHARED),
                       (torch.ops.fsdp.reduce_grad_many, REDUCE_GRAD_SHARED),
                       (torch.ops.fsdp.reduce_grad_flat, REDUCE_GRAD_SHARED)]:
        assert str(op.default._schema).split(") -> ")[0].endswith(spelled(shared)), op
