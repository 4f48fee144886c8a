"""Small hand-built graphs for the pass unit tests: marker ops traced with ``make_fx``, no process group.

The functional collectives' fake kernels only need a group *name*, so every graph here names the groups
``"ag"`` and ``"rs"`` (or one shared name) and is traced under fake tensors: each node has ``meta["val"]``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_compile.api.markers as fsdp_ops
import fsdp_compile.passes.graph_ops as bucket_copies
from fsdp_compile.passes.graph_ops import flatten_shapes
from fsdp_compile.inspection.schedule import listing
from fsdp_compile.passes import NamedPass
from fsdp_compile.passes.lower.markers import lower_markers_pass
from fsdp_compile.passes.predicates import fsdp_meta, is_all_gather, is_collective, is_reduce_scatter, is_wait
from fsdp_compile.passes.schedule.prefetch import prefetch_pass
from fsdp_compile.passes.schedule.reduce_scatter import reduce_scatter_pass
from fsdp_compile.passes.schedule.streams import streams_pass

c10d = torch.ops._c10d_functional

LABELS = {"ag": "ag", "rs": "rs"}
WIDTH = 8  # every unit: w (WIDTH, WIDTH) and b (WIDTH,), so each unit gathers 2 params
UNITS = 3


def unshard(shard: Tensor, full_shape: list[int], unit: int, name: str, *, world: int = 2,
            param_dtype: torch.dtype | None = None, ag: str = "ag", rs: str = "rs") -> Tensor:
    """The marker of one parameter's read (NOTE [one marker spec])."""
    (full,) = torch.ops.fsdp.unshard(shard, *flatten_shapes([list(shard.shape)]), *flatten_shapes([full_shape]), name,
                                     world, unit, ag, rs, "", 1, True, param_dtype, None)
    return full


def reduce_grad(grad: Tensor, shard_shape: list[int], unit: int, name: str, *, world: int = 2,
                reduce_dtype: torch.dtype | None = None, out_dtype: torch.dtype = torch.float32,
                ag: str = "ag", rs: str = "rs") -> Tensor:
    """The marker of one parameter's gradient."""
    return torch.ops.fsdp.reduce_grad([grad], *flatten_shapes([shard_shape]), name, world, unit, ag, rs, "", 1,
                                      reduce_dtype, out_dtype)


def trace(fn: Callable[..., object], *examples: Tensor) -> fx.GraphModule:
    """``make_fx`` under fake tensors: every node carries ``meta["val"]``; ``gm.meta["inputs"]`` keeps
    the (real) example inputs for numerical checks."""
    gm = make_fx(fn, tracing_mode="fake")(*examples)
    gm.meta["inputs"] = examples
    return gm


def ints(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Small integers: exact in bf16 and under the +100 of ``TwoRanks``."""
    return torch.randint(-4, 5, shape).to(dtype)


def shards(world: int = 2, units: int = UNITS) -> list[Tensor]:
    """Distinct (make_fx dedupes identical tensors) w and b shards per unit."""
    rows = -(-WIDTH // world)
    out: list[Tensor] = []
    for _ in range(units):
        out += [ints(rows, WIDTH), ints(rows)]
    return out


def forward_graph(world: int = 2, units: int = UNITS, ag: str = "ag", rs: str = "rs",
                  gather_order: Sequence[int] | None = None) -> fx.GraphModule:
    """Per unit k: gather w_k and b_k, then ``x = relu(x @ w_k + b_k)``.

    With ``gather_order`` every unit's params are gathered up front, in that order of units.
    """

    def fn(x: Tensor, *ss: Tensor) -> Tensor:
        def gather(k: int) -> tuple[Tensor, Tensor]:
            return (unshard(ss[2 * k], [WIDTH, WIDTH], k, f"w{k}", world=world, ag=ag, rs=rs),
                    unshard(ss[2 * k + 1], [WIDTH], k, f"b{k}", world=world, ag=ag, rs=rs))

        early = {k: gather(k) for k in gather_order or ()}
        for k in range(units):
            w, b = early[k] if k in early else gather(k)
            x = torch.relu(x @ w + b)
        return x

    return trace(fn, ints(2, WIDTH), *shards(world, units))


def backward_graph(world: int = 2, units: int = UNITS, gathers: bool = False, ag: str = "ag",
                   rs: str = "rs", grads_first: bool = False) -> fx.GraphModule:
    """Units in reverse: grads of w_k, b_k from the incoming grad, reduce_grad each, then propagate.

    With ``gathers`` each unit first re-gathers its w (as a resharded backward does) and propagates the
    grad through it before computing its own grads (autograd's order for a matmul; ``grads_first``
    swaps the two); otherwise the grad goes through a plain ``relu``.
    """
    rows = -(-WIDTH // world)

    def propagate(g: Tensor, w: Tensor | None) -> Tensor:
        return g @ w.t() if w is not None else torch.relu(g)

    def fn(g: Tensor, acts: Tensor, *ws: Tensor) -> list[Tensor]:
        out: list[Tensor] = []
        for k in reversed(range(units)):
            w = unshard(ws[k], [WIDTH, WIDTH], k, f"w{k}", world=world, ag=ag, rs=rs) if gathers else None
            g_in = None if grads_first else propagate(g, w)
            gw = acts[k].t() @ g
            gb = g.sum(0)
            out.append(reduce_grad(gw, [rows, WIDTH], k, f"w{k}", world=world, ag=ag, rs=rs))
            out.append(reduce_grad(gb, [rows], k, f"b{k}", world=world, ag=ag, rs=rs))
            g = propagate(g, w) if g_in is None else g_in
        return [g, *out]

    ws = [ints(rows, WIDTH) for _ in range(units)]
    return trace(fn, ints(2, WIDTH), ints(units, 2, WIDTH), *ws)


def gather_chain(units: int) -> fx.GraphModule:
    """An already-lowered graph, cheap to build for many units: per unit k one tagged all-gather of a
    (2,) shard and its wait, then ``x = x * w_k``."""

    def fn(x: Tensor, *ss: Tensor) -> Tensor:
        for s in ss:
            x = x * c10d.wait_tensor(c10d.all_gather_into_tensor(s, 2, "ag"))
        return x

    gm = trace(fn, ints(4), *[ints(2) for _ in range(units)])
    for k, ag in enumerate(gathers(gm)):
        for n in (ag, next(iter(ag.users))):
            fsdp_meta(n).update(unit=k, kind="all_gather", ag_group="ag", rs_group="rs")
    return gm


def ops(gm: fx.GraphModule) -> list[str]:
    """The short op names of the call nodes, in graph order."""
    return [getattr(n.target, "__name__", str(n.target)).split(".")[0] for n in gm.graph.nodes
            if n.op == "call_function"]


def launches(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_collective(n)]


def gathers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_all_gather(n)]


def scatters(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_reduce_scatter(n)]


def waits(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_wait(n)]


def units_of(nodes: list[fx.Node]) -> list[object]:
    return [fsdp_meta(n).get("unit") for n in nodes]


def valid(gm: fx.GraphModule) -> fx.GraphModule:
    """Lint (every input defined before use) and recompile; return ``gm``."""
    gm.graph.lint()
    gm.recompile()
    return gm


def lowered(gm: fx.GraphModule, **options: Any) -> fx.GraphModule:
    """Every parameter's collectives its own (each large enough to go alone)."""
    return valid(lower_markers_pass(gm, alone_bytes=1, **options))


def bucketed(gm: fx.GraphModule, **options: Any) -> fx.GraphModule:
    """One bucket per unit, as the backend lowers by default."""
    return valid(lower_markers_pass(gm, **options))


class TwoRanks(TorchDispatchMode):
    """Rank 0 of a simulated world, on real tensors: no process group.

    Rank r's all-gather input is ``x + 100 r`` and its reduce-scatter input ``(r + 1) x``, so a wrong
    rank-major layout (of a padded param, or of a bucket) changes the numbers. The markers run their
    eager implementation, whose collectives land here too.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is c10d.all_gather_into_tensor.default:
            x, n, _ = args
            return torch.cat([x + 100 * r for r in range(n)])
        if func is c10d.all_gather_into_tensor_out.default:  # x is rank 0's slice of out
            x, n, _ = args
            return kwargs["out"].copy_(torch.cat([x + 100 * r for r in range(n)]))
        if func is c10d.reduce_scatter_tensor.default:
            x, _, n, _ = args
            return (x * sum(range(1, n + 1))).chunk(n)[0].clone()
        if func is c10d.wait_tensor.default:
            return args[0]
        if func.namespace == "fsdp":  # the marker's (or bucket copy's) eager body, with this mode still on
            module = fsdp_ops if hasattr(fsdp_ops, func._opname) else bucket_copies
            body = getattr(module, func._opname)
            with self:
                return getattr(body, "_init_fn", body)(*args, **kwargs)
        return func(*args, **kwargs)


def run(gm: fx.GraphModule, *, ranks: bool = True) -> list[Tensor]:
    """Run ``gm`` on its example inputs, as rank 0 of ``TwoRanks`` (or plainly, for world size 1)."""
    with warnings.catch_warnings(), (TwoRanks() if ranks else contextlib.nullcontext()):
        warnings.simplefilter("ignore")  # the markers' eager slow-path warning
        out = gm(*gm.meta["inputs"])
    return list(out) if isinstance(out, (list, tuple)) else [out]


def show(gm: fx.GraphModule) -> str:
    """The schedule listing (``fsdp_compile.inspection.schedule``) with the group labels of these graphs."""
    return listing(gm, LABELS)


def sched(gm: fx.GraphModule) -> str:
    """Launches and waits in graph order, on one line: ``AG0`` an all-gather of unit 0, ``wAG0`` its wait."""
    out = []
    for n in gm.graph.nodes:
        if is_collective(n) or is_wait(n):
            launch = n if is_collective(n) else n.args[0]
            kind = "AG" if is_all_gather(launch) else "RS"
            out.append(f"{'' if n is launch else 'w'}{kind}{fsdp_meta(launch).get('unit')}")
    return " ".join(out)


def assert_same(got: list[Tensor], want: list[Tensor]) -> None:
    """Bitwise equal, same dtypes and shapes."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def one_param(full: list[int], shard_rows: int, *, world: int = 2, param_dtype: torch.dtype | None = None,
              reduce_dtype: torch.dtype | None = None, out_dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    """One unshard of a ``full``-shaped param stored as ``shard_rows`` rows, and one reduce_grad of it."""

    def fn(shard: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        return (unshard(shard, full, 0, "w0", world=world, param_dtype=param_dtype),
                reduce_grad(grad, [shard_rows, *full[1:]], 0, "w0", world=world, reduce_dtype=reduce_dtype,
                            out_dtype=out_dtype))

    return trace(fn, ints(shard_rows, *full[1:]), ints(*full, dtype=param_dtype or torch.float32))


def val(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a node's fake value."""
    return tuple(node.meta["val"].shape), node.meta["val"].dtype


def abcd() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """``a = x + 1; b = y * 2; c = a + b; d = c.relu()``."""
    gm = trace(lambda x, y: ((x + 1) + (y * 2)).relu(), ints(2), ints(2))
    add, mul, add2, relu = (n for n in gm.graph.nodes if n.op == "call_function")
    return gm, {"a": add, "b": mul, "c": add2, "d": relu}


def names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


# The backend's pass list (fsdp_compile.compiler.backend), with its default settings.
PIPELINE = [
    NamedPass("lower", lower_markers_pass),
    NamedPass("prefetch", functools.partial(prefetch_pass, depth=1)),
    NamedPass("reduce_scatter", reduce_scatter_pass),
    NamedPass("streams", streams_pass),
]
