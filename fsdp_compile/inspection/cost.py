"""The cost of one node, one collective and one optimizer step on a ``Hardware`` model.

::

    hw = load_hardware("h200", "benchmarks/calibration/h200x2.json")
    node_seconds(mm_node, hw)                              # max(FLOPs / rate(shape), bytes / bandwidth)
    collective_seconds("all_gather", 64 << 20, 8, hw)      # latency + (w-1)/w * bytes / busbw (topology.py)
    optimizer_seconds([(numel, 2)], hw, "adamw")           # the foreach kernels' passes over the state

How the model reads a GPU, and what it leaves out:

- Matmuls run at ``matmul_fraction`` of the dtype's peak, less for small dimensions (``Hardware``'s
  ``matmul_half_mn`` / ``matmul_half_k``: fewer tiles, fewer waves).
- Attention is costed as the fused kernel the GPU runs (flash / cuDNN): its FLOPs (the causal half when
  causal) at ``attention_fraction`` (backward: ``attention_backward_fraction``) of peak, less for short
  sequences. ``explain`` traces attention as that kernel (``fused_attention.py``); a graph that holds the
  math path instead (scores materialised) is costed as the ops it holds.
- Everything else is memory-bound. Alone (``node_seconds``) a node reads its inputs and writes its
  output; in a graph, ``fusion.graph_seconds`` groups what Inductor fuses and counts each group's
  traffic once.
- Each kernel costs at least ``kernel_latency``.

The estimates rank schedules and show where communication is exposed (``fsdp_compile.inspection.timeline``);
how close they come to real steps: docs/performance.md, ``benchmarks/calibration/check_explain.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from fsdp_compile.passes.predicates import (
    collective_kind,
    is_all_gather,
    is_collective,
    is_reduce_scatter,
    is_wait,
    op_name,
    tensor_bytes,
)

from fsdp_compile._compat import resolve_group
from fsdp_compile.inspection.hardware import HARDWARE, Hardware, detect_hardware, load_hardware, write_calibration
from fsdp_compile.inspection.topology import Topology, ring_seconds

__all__ = [
    "Hardware",
    "HARDWARE",
    "ZERO_COST_OPS",
    "MATMUL_OPS",
    "ATTENTION_OPS",
    "OPTIMIZER_PASSES",
    "load_hardware",
    "write_calibration",
    "detect_hardware",
    "collective_seconds",
    "launch_seconds",
    "node_seconds",
    "node_flops",
    "node_bytes",
    "read_bytes",
    "matmul_efficiency",
    "optimizer_seconds",
    "collective_bytes",
    "collective_world",
    "graph_world",
    "launch_ranks",
]


# --- collectives --------------------------------------------------------------------------------


def collective_seconds(kind: str, full_bytes: int, world: int, hw: Hardware, *, hosts: int | None = None) -> float:
    """Seconds one collective over a ``full_bytes`` (unsharded) buffer among all ``world`` ranks takes
    alone: the ring estimate of NOTE [collective time] (``topology.py``),
    ``latency + (world-2) * hop_latency + (world-1)/world * full_bytes / busbw``, twice that for an
    all-reduce. ``hosts``: the hosts the world spans (default ``Topology.of``'s: hosts of
    ``hw.ranks_per_node`` GPUs); a group on more than one is bound by the inter-host links throughout.
    """
    spans = world > 1 and Topology.of(world, hw, hosts).hosts > 1
    return ring_seconds(kind, full_bytes, world, hw, spans_hosts=spans)


def collective_bytes(launch: fx.Node) -> int:
    """Bytes of the full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's."""
    inp = launch.args[0]
    out = tensor_bytes(launch)
    return max(tensor_bytes(inp) if isinstance(inp, fx.Node) else 0, out)


def collective_world(launch: fx.Node) -> int:
    """Ranks in the launch's group: the ``group_size`` argument, or the group itself (all-reduce)."""
    if is_all_gather(launch):
        return int(launch.args[1])  # type: ignore[arg-type]
    if is_reduce_scatter(launch):
        return int(launch.args[2])  # type: ignore[arg-type]
    try:
        return resolve_group(str(launch.args[-1])).size()
    except Exception:  # group gone (graph read after the run): an emitted all-reduce has >= 2 ranks
        return 2


def _replicates(launch: fx.Node) -> bool:
    return (launch.meta.get("fsdp") or {}).get("stream") == "replicate"


def launch_ranks(launch: fx.Node, world: int) -> range:
    """The global ranks of a launch's group in a ``world`` laid out as a 2-D mesh (replicas x shards):
    an HSDP all-reduce across replicas (stream ``replicate``) takes every ``world // n``-th rank, any
    other collective the first ``n`` (FSDP's groups: the whole world, or one replica's shards)."""
    n = collective_world(launch)
    return range(0, world, max(world // n, 1)) if _replicates(launch) else range(min(n, world))


def graph_world(gm: fx.GraphModule) -> int:
    """The ranks a graph's collectives span: its largest group, times the replicas of an HSDP graph."""
    launches = [n for n in gm.graph.nodes if is_collective(n)]
    shards = max((collective_world(n) for n in launches if not _replicates(n)), default=1)
    return shards * max((collective_world(n) for n in launches if _replicates(n)), default=1)


def launch_seconds(launch: fx.Node, topology: Topology) -> float:
    """Seconds a launch takes alone on ``topology`` (NOTE [collective time]): its kind, bytes and
    group read from the graph, its ranks by ``launch_ranks``."""
    ranks = launch_ranks(launch, topology.world)
    return topology.solo_seconds(collective_kind(launch), collective_bytes(launch), ranks)


# --- compute ------------------------------------------------------------------------------------

# Ops that relabel memory (views, aliases, indexing a tuple) or only allocate: no time.
ZERO_COST_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "t", "transpose", "expand",
    "expand_as", "slice", "select", "narrow", "alias", "detach", "lift_fresh", "squeeze", "unsqueeze",
    "as_strided", "split", "split_with_sizes", "unbind", "chunk", "diagonal", "unfold", "movedim",
    "view_as", "view_as_real", "view_as_complex", "getitem", "empty", "empty_like", "empty_strided",
    "sym_size", "sym_numel", "sym_stride",
})
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
_ATTENTION_FORWARD = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
})
ATTENTION_OPS = _ATTENTION_FORWARD | {f"{name}_backward" for name in _ATTENTION_FORWARD}
_SEQ_DIM_1 = ("_flash_attention", "_efficient_attention")  # (batch, seq, heads, dim) layouts; the rest (b, h, s, d)

_MATMUL_DTYPES_FAST = {torch.bfloat16, torch.float16, torch.int8,
                       *(getattr(torch, d) for d in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, d))}
_flops_cache: dict[tuple[object, ...], int] = {}


def _val(a: object) -> object:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _sig(v: object) -> object:
    """A hashable stand-in for an argument: tensors by shape and dtype, sequences by their items."""
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_sig(x) for x in v)
    if isinstance(v, fx.Node):
        return _sig(v.meta.get("val"))
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def _argument(node: fx.Node, name: str, default: object = None) -> object:
    """The value of the schema argument ``name`` of an aten call, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def _is_causal(node: fx.Node) -> bool:
    if _argument(node, "is_causal") is True:
        return True
    return _argument(node, "custom_mask_type") == 1  # _efficient_attention_*: 1 = causal from the top left


def node_flops(node: fx.Node) -> int:
    """FLOPs of ``node`` from ``torch.utils.flop_counter``'s formulas (0 for ops it has none for).

    Causal attention counts the half of the score matrix it computes (the formulas count all of it).
    """
    packet = getattr(node.target, "overloadpacket", node.target)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    key = (packet, _sig(node.args), _sig(tuple(sorted(node.kwargs.items()))), _sig(node.meta.get("val")))
    if key not in _flops_cache:
        args = tuple(fx.node.map_aggregate(node.args, _val))
        kwargs = {k: fx.node.map_aggregate(v, _val) for k, v in node.kwargs.items()}
        try:
            _flops_cache[key] = int(formula(*args, out_val=node.meta.get("val"), **kwargs))
        except Exception:  # a formula that wants what a fake value lacks: count memory only
            _flops_cache[key] = 0
    flops = _flops_cache[key]
    if op_name(node) in ATTENTION_OPS and _is_causal(node):
        flops //= 2
    return flops


def _tensors(v: object) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _bytes(v: object) -> int:
    total = 0
    for t in _tensors(v):
        try:
            total += int(t.numel()) * t.element_size()
        except Exception:  # unbacked symbolic size: unknown
            pass
    return total


# Ops that read rows of their first input picked by an index: they read as many bytes as they write.
_GATHERS = frozenset({"embedding", "index", "index_select", "gather", "_unsafe_index"})


def read_bytes(node: fx.Node, inp: fx.Node) -> int:
    """Bytes ``node`` reads of its input ``inp`` (all of it, except for gathers: the rows picked)."""
    size = _bytes(inp.meta.get("val"))
    if op_name(node) in _GATHERS and node.args and node.args[0] is inp:
        return min(size, _bytes(node.meta.get("val")))
    return size


def node_bytes(node: fx.Node) -> int:
    """Bytes a node moves alone: each distinct input read once, its output written once."""
    return _bytes(node.meta.get("val")) + sum(read_bytes(node, i) for i in node.all_input_nodes)


def _dtype(node: fx.Node) -> torch.dtype | None:
    return next((t.dtype for i in node.all_input_nodes for t in _tensors(i.meta.get("val"))), None)


def _peak(node: fx.Node, hw: Hardware) -> float:
    return hw.peak_flops_bf16 if _dtype(node) in _MATMUL_DTYPES_FAST else hw.peak_flops_fp32


def _matmul_dims(node: fx.Node) -> tuple[int, int, int] | None:
    """(m, n, k) of an ``mm``/``addmm``/``bmm``/``baddbmm``, a batch folded into m."""
    name = op_name(node)
    a, b = (node.args[1], node.args[2]) if name in ("addmm", "baddbmm") else (node.args[0], node.args[1])
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dim() < 2:
        return None
    batch = int(va.shape[0]) if va.dim() == 3 else 1
    return batch * int(va.shape[-2]), int(vb.shape[-1]), int(va.shape[-1])


def matmul_efficiency(m: int, n: int, k: int, hw: Hardware, op: str = "mm") -> float:
    """Share of peak a ``(m x k) @ (k x n)`` matmul reaches on ``hw`` (see ``Hardware``)."""
    frac = hw.fraction_of(op, hw.matmul_fraction)
    h, hk = hw.matmul_half_mn, hw.matmul_half_k
    return frac * (m / (m + h)) * (n / (n + h)) * (k / (k + hk))


def _attention_efficiency(node: fx.Node, hw: Hardware) -> float:
    name = op_name(node)
    default = hw.attention_backward_fraction if name.endswith("_backward") else hw.attention_fraction
    frac = hw.fraction_of(name, default)
    q = _val(_argument(node, "query"))
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not hw.attention_half_seq:
        return frac
    seq = int(q.shape[1] if name.startswith(_SEQ_DIM_1) else q.shape[2])
    return frac * seq / (seq + hw.attention_half_seq)


def node_seconds(node: fx.Node, hw: Hardware) -> float:
    """Estimated seconds of a compute node alone on ``hw``: ``max(flops / rate, bytes / bandwidth)``,
    at least ``kernel_latency``.

    ``rate`` is the peak of the op's dtype (bf16/fp16, else fp32) times the op's efficiency (matmuls:
    ``matmul_efficiency``; attention: its own fractions; other ops with FLOPs: ``matmul_fraction``);
    ``bytes`` counts tensor inputs and outputs once. Ops in ``ZERO_COST_OPS`` and non-call nodes cost 0,
    and so do collective launches and waits (the timeline charges them to their streams).
    """
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return 0.0
    name = op_name(node)
    if name in ZERO_COST_OPS or not _tensors(node.meta.get("val")):  # a view, or arithmetic on sizes
        return 0.0
    seconds = node_bytes(node) / (hw.memory_bandwidth * hw.fraction_of(name, hw.memory_fraction))
    flops = node_flops(node)
    if flops:
        if name in MATMUL_OPS and (dims := _matmul_dims(node)) is not None:
            eff = matmul_efficiency(*dims, hw, op=name)
        elif name in ATTENTION_OPS:
            eff = _attention_efficiency(node, hw)
        else:
            eff = hw.fraction_of(name, hw.matmul_fraction)
        seconds = max(seconds, flops / (_peak(node, hw) * eff))
    return max(seconds, hw.kernel_latency)


# --- the optimizer step ---------------------------------------------------------------------------

# Passes over one element of parameter-sized state that torch.optim's foreach implementation makes per
# step (reads + writes, counted in torch/optim/adam.py and torch/optim/sgd.py, default settings): AdamW multiplies
# params by 1 - lr*wd (2), lerps exp_avg (3), scales and addcmuls exp_avg_sq (2 + 4), takes its sqrt,
# divides, adds eps (2 + 2 + 2) and addcdivs the params (4). Adam has no decay pass. SGD with momentum:
# buf = momentum * buf + grad (2 + 3), params -= lr * buf (3). AdamW(fused=True) is one multi-tensor kernel
# that reads params, grads, exp_avg and exp_avg_sq once and writes params, exp_avg and exp_avg_sq once (7).
OPTIMIZER_PASSES: dict[str, int] = {"adamw": 21, "adam": 19, "sgd": 8, "adamw-fused": 7}


def optimizer_seconds(shards: Iterable[torch.Tensor | tuple[int, int]], hw: Hardware, optimizer: str = "adamw") -> float:
    """One optimizer step over this rank's ``shards`` (tensors, or ``(numel, element_size)`` pairs),
    its state and gradients in the params' dtype: memory-bound, ``OPTIMIZER_PASSES`` passes at
    ``foreach_fraction`` of the memory bandwidth (the fused kernel applies over tensor lists as the foreach
    ones do)."""
    if optimizer not in OPTIMIZER_PASSES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_PASSES)} or None")
    total = 0
    for s in shards:
        numel, size = (s.numel(), s.element_size()) if isinstance(s, torch.Tensor) else s
        total += int(numel) * int(size)
    return OPTIMIZER_PASSES[optimizer] * total / (hw.memory_bandwidth * hw.foreach_fraction)
