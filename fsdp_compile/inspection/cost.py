"""The cost of one node, one collective and one optimizer step on a ``Hardware`` model.

- Matmuls run at ``matmul_fraction`` of the dtype's peak, less for small dimensions.
- Attention is costed as the fused kernel a GPU runs (``fused_attention.py``): its FLOPs (the causal half
  when causal) at ``attention_fraction`` / ``attention_backward_fraction`` of peak, less for short sequences.
- Everything else is memory-bound; ``fusion.graph_seconds`` counts a fused group's traffic once.
- Each kernel costs at least ``kernel_latency``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from fsdp_compile.passes.predicates import (
    collective_kind, is_all_gather, is_collective, is_reduce_scatter, is_wait, op_name, tensor_bytes,
)

from fsdp_compile._compat import resolve_group
from fsdp_compile.inspection.hardware import HARDWARE, Hardware, detect_hardware, load_hardware, write_calibration
from fsdp_compile.inspection.topology import Topology, ring_seconds

__all__ = [
    "Hardware", "HARDWARE", "ZERO_COST_OPS", "MATMUL_OPS", "ATTENTION_OPS", "OPTIMIZER_PASSES", "load_hardware",
    "write_calibration", "detect_hardware", "collective_seconds", "launch_seconds", "node_seconds", "node_flops",
    "node_bytes", "read_bytes", "matmul_efficiency", "optimizer_seconds", "collective_bytes", "collective_world",
    "graph_world", "launch_ranks",
]


def collective_seconds(kind: str, full_bytes: int, world: int, hw: Hardware, *, hosts: int | None = None) -> float:
    """Seconds one collective over a ``full_bytes`` (unsharded) buffer among ``world`` ranks takes alone
    (NOTE [collective time]); ``hosts``: the hosts the world spans (default: ``Topology.of``'s)."""
    spans = world > 1 and Topology.of(world, hw, hosts).hosts > 1
    return ring_seconds(kind, full_bytes, world, hw, spans_hosts=spans)


def collective_bytes(launch: fx.Node) -> int:
    """Bytes of the full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's."""
    inp = launch.args[0]
    return max(tensor_bytes(inp) if isinstance(inp, fx.Node) else 0, tensor_bytes(launch))


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
    """The global ranks of a launch's group in a (replicas x shards) mesh: an HSDP all-reduce takes every
    ``world // n``-th rank, any other collective the first ``n``."""
    n = collective_world(launch)
    return range(0, world, max(world // n, 1)) if _replicates(launch) else range(min(n, world))


def graph_world(gm: fx.GraphModule) -> int:
    """The ranks a graph's collectives span: its largest group, times the replicas of an HSDP graph."""
    launches = [n for n in gm.graph.nodes if is_collective(n)]
    shards = max((collective_world(n) for n in launches if not _replicates(n)), default=1)
    return shards * max((collective_world(n) for n in launches if _replicates(n)), default=1)


def launch_seconds(launch: fx.Node, topology: Topology) -> float:
    """Seconds a launch takes alone on ``topology`` (NOTE [collective time])."""
    ranks = launch_ranks(launch, topology.world)
    return topology.solo_seconds(collective_kind(launch), collective_bytes(launch), ranks)


# Ops that relabel memory or only allocate: no time.
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
    """A hashable stand-in for an argument: tensors by shape and dtype."""
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


def node_flops(node: fx.Node) -> int:
    """FLOPs of ``node`` from ``torch.utils.flop_counter``'s formulas (0 for ops it has none for); causal
    attention counts half."""
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
    # (_efficient_attention_*: custom_mask_type 1 = causal from the top left)
    if op_name(node) in ATTENTION_OPS and (_argument(node, "is_causal") is True
                                           or _argument(node, "custom_mask_type") == 1):
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


# Ops that read the rows of their first input picked by an index: as many bytes as they write.
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
    at least ``kernel_latency``; 0 for views, non-call nodes, collectives and waits."""
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
        dtype = next((t.dtype for i in node.all_input_nodes for t in _tensors(i.meta.get("val"))), None)
        peak = hw.peak_flops_bf16 if dtype in _MATMUL_DTYPES_FAST else hw.peak_flops_fp32
        seconds = max(seconds, flops / (peak * eff))
    return max(seconds, hw.kernel_latency)


# Reads + writes per element of parameter-sized state in one step of torch.optim's foreach kernels:
# AdamW: decay (2), lerp exp_avg (3), exp_avg_sq (2 + 4), sqrt, div, add eps (2 + 2 + 2), addcdiv (4); Adam
# without the decay; SGD with momentum (2 + 3 + 3). AdamW(fused=True): 4 reads and 3 writes.
OPTIMIZER_PASSES: dict[str, int] = {"adamw": 21, "adam": 19, "sgd": 8, "adamw-fused": 7}


def optimizer_seconds(shards: Iterable[torch.Tensor | tuple[int, int]], hw: Hardware,
                      optimizer: str = "adamw") -> float:
    """Seconds of one optimizer step over this rank's ``shards`` (tensors, or ``(numel, element_size)``
    pairs): ``OPTIMIZER_PASSES`` passes at ``foreach_fraction`` of the memory bandwidth."""
    if optimizer not in OPTIMIZER_PASSES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_PASSES)} or None")
    total = 0
    for s in shards:
        numel, size = (s.numel(), s.element_size()) if isinstance(s, torch.Tensor) else s
        total += int(numel) * int(size)
    return OPTIMIZER_PASSES[optimizer] * total / (hw.memory_bandwidth * hw.foreach_fraction)
