"""A roofline cost model for the nodes of a scheduled graph, and ring estimates for its collectives.

``Hardware`` holds the handful of numbers the model needs; ``HARDWARE`` has presets (H100, H200, a
2-core CPU running gloo), and ``load_hardware`` overlays a calibration file of measured numbers::

    hw = load_hardware("h200", "benchmarks/calibration/example.json")
    node_seconds(mm_node, hw)                              # max(FLOPs / rate, bytes / bandwidth)
    collective_seconds("all_gather", 64 << 20, 8, hw)      # latency + (w-1)/w * bytes / busbw

The estimates are first-order: they rank schedules and show where communication is exposed (see
``fsdp_compile.timeline``); they do not predict a step time to the percent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from passes.predicates import (
    collective_kind,
    is_all_gather,
    is_collective,
    is_reduce_scatter,
    is_wait,
    op_name,
    tensor_bytes,
)

from ._compat import resolve_group

__all__ = [
    "Hardware",
    "HARDWARE",
    "ZERO_COST_OPS",
    "load_hardware",
    "write_calibration",
    "collective_seconds",
    "launch_seconds",
    "node_seconds",
    "node_flops",
    "collective_bytes",
    "collective_world",
]


@dataclass(frozen=True)
class Hardware:
    """What one rank can do, in SI units (FLOP/s, bytes/s, seconds)."""

    name: str
    peak_flops_bf16: float  # dense FLOP/s of bf16/fp16 matmuls (also used for fp8/int8: a lower bound)
    peak_flops_fp32: float  # FLOP/s of fp32 matmuls without TF32 (PyTorch's default)
    matmul_fraction: float  # share of peak a large matmul reaches
    memory_bandwidth: float  # bytes/s of device memory
    memory_fraction: float  # share of it a streaming kernel (copy, pointwise) reaches
    intra_node_busbw: float  # bytes/s per rank, NCCL "busbw", ranks within a node
    inter_node_busbw: float  # bytes/s per rank when a group spans nodes
    ranks_per_node: int
    collective_latency: float  # s, fixed cost of one collective (launch + first step)
    hop_latency: float = 0.0  # s, each further ring step (world - 2 of them)
    # op name -> fraction of peak FLOP/s and of memory bandwidth for that op, e.g. (("mm", 0.6),)
    op_fraction: tuple[tuple[str, float], ...] = ()

    def fraction_of(self, op: str, default: float) -> float:
        """The achievable fraction for ``op`` (an overload packet name), or ``default``."""
        for name, frac in self.op_fraction:
            if name == op:
                return frac
        return default


# H100 SXM5 (NVIDIA H100 datasheet): 989 TFLOP/s dense bf16 (1979 with sparsity), 67 TFLOP/s fp32,
# 3.35 TB/s HBM3. NVLink4: 900 GB/s bidirectional = 450 GB/s per direction; nccl-tests all-gather /
# reduce-scatter on 8 GPUs report a busbw of about 350-380 GB/s. Inter-node: one 400 Gb/s NDR
# InfiniBand NIC per GPU = 50 GB/s, about 40 GB/s achieved. NCCL's base latency is ~10-20 us per
# collective; its tuning model (src/graph/tuning.cc, hwLat) charges ~0.5-3.4 us per NVLink ring step.
# Fractions: large bf16 GEMMs reach ~75-80% of peak (cuBLAS); streaming copies ~90% of HBM.
_H100 = Hardware(
    name="h100",
    peak_flops_bf16=989e12,
    peak_flops_fp32=67e12,
    matmul_fraction=0.75,
    memory_bandwidth=3.35e12,
    memory_fraction=0.9,
    intra_node_busbw=360e9,
    inter_node_busbw=40e9,
    ranks_per_node=8,
    collective_latency=15e-6,
    hop_latency=1e-6,
)

# H200 SXM (NVIDIA H200 datasheet): the H100's GH100 compute (989 / 67 TFLOP/s) with 4.8 TB/s HBM3e,
# same NVLink4 and networking. Measured on this workplace's H200: a bf16 matmul on random data runs at
# ~790 TFLOP/s (790 / 989 = 0.80), a device-to-device copy at ~4.3 TB/s read+write (4.3 / 4.8 = 0.9).
_H200 = dataclasses.replace(
    _H100, name="h200", memory_bandwidth=4.8e12, matmul_fraction=0.8, memory_fraction=0.9,
)

# A 2-core x86 CPU running gloo over loopback (rough, for the CI machine): AVX2 FMA peaks near
# 100 GFLOP/s fp32 for 2 cores, MKL/oneDNN GEMMs reach ~30% of it under load (a few tens of GFLOP/s);
# bf16 has no native units there, so it is slower; ~10 GB/s achieved memory bandwidth; gloo ring
# collectives move ~1-2 GB/s through loopback TCP, with ~50 us per collective and ~10 us per step.
# All ranks share one host: ranks_per_node is large and both bandwidths are the loopback one.
_CPU = Hardware(
    name="cpu",
    peak_flops_bf16=50e9,
    peak_flops_fp32=100e9,
    matmul_fraction=0.3,
    memory_bandwidth=20e9,
    memory_fraction=0.5,
    intra_node_busbw=1.5e9,
    inter_node_busbw=1.5e9,
    ranks_per_node=64,
    collective_latency=50e-6,
    hop_latency=10e-6,
)

HARDWARE: dict[str, Hardware] = {"h100": _H100, "h200": _H200, "cpu": _CPU}

_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware))


def load_hardware(name: str | Hardware = "h200", calibration: str | Path | Mapping[str, Any] | None = None) -> Hardware:
    """A preset (or ``name`` itself, if a ``Hardware``) with measured numbers from ``calibration``.

    ``calibration`` is a JSON file or a dict holding any subset of ``Hardware``'s fields;
    ``op_fraction`` may be a dict ``{"mm": 0.6}``. Unknown fields raise ``ValueError``.
    """
    if isinstance(name, Hardware):
        base = name
    elif name in HARDWARE:
        base = HARDWARE[name]
    else:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(sorted(HARDWARE))}")
    if calibration is None:
        return base
    values = calibration if isinstance(calibration, Mapping) else json.loads(Path(calibration).read_text())
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown calibration field(s) {unknown}; valid fields: {', '.join(_FIELDS)}")
    kw = dict(values)
    if "op_fraction" in kw:
        kw["op_fraction"] = _op_fraction(kw["op_fraction"])
    hw = dataclasses.replace(base, **kw)
    _validate(hw)
    return hw


def write_calibration(hw: Hardware, path: str | Path) -> None:
    """Write every field of ``hw`` as a calibration JSON that ``load_hardware`` reads back."""
    data = dataclasses.asdict(hw)
    data["op_fraction"] = dict(hw.op_fraction)
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _op_fraction(value: object) -> tuple[tuple[str, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), float(v)) for k, v in items))  # type: ignore[union-attr]


def _validate(hw: Hardware) -> None:
    for f in _FIELDS:
        v = getattr(hw, f)
        if f in ("name", "op_fraction"):
            continue
        if not isinstance(v, (int, float)) or v < 0 or (v == 0 and f not in ("hop_latency", "collective_latency")):
            raise ValueError(f"hardware field {f} must be a positive number, got {v!r}")
    for op, frac in [("matmul_fraction", hw.matmul_fraction), ("memory_fraction", hw.memory_fraction),
                     *hw.op_fraction]:
        if not 0 < frac <= 1:
            raise ValueError(f"fraction for {op} must be in (0, 1], got {frac}")


# --- collectives --------------------------------------------------------------------------------

_KINDS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}  # ring passes over the buffer


def collective_seconds(kind: str, full_bytes: int, world: int, hw: Hardware) -> float:
    """Ring estimate of one collective over a ``full_bytes`` (unsharded) buffer across ``world`` ranks.

    All-gather and reduce-scatter send (world-1)/world of the buffer through each rank:
    ``latency + (world-2) * hop_latency + (world-1)/world * full_bytes / busbw``; an all-reduce is a
    reduce-scatter followed by an all-gather, twice that. Simplification: a group of at most
    ``ranks_per_node`` ranks is taken to sit in one node (NVLink bandwidth), a larger one to be bound
    by the inter-node links throughout (a ring is as fast as its slowest link); placement of ranks and
    NCCL's tree/NVLS algorithms are not modelled.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(_KINDS)}")
    if world <= 1:
        return 0.0
    busbw = hw.intra_node_busbw if world <= hw.ranks_per_node else hw.inter_node_busbw
    one = hw.collective_latency + (world - 2) * hw.hop_latency + (world - 1) / world * full_bytes / busbw
    return _KINDS[kind] * one




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


def launch_seconds(launch: fx.Node, hw: Hardware) -> float:
    """``collective_seconds`` of a launch node, its kind, bytes and world read from the graph."""
    return collective_seconds(collective_kind(launch), collective_bytes(launch), collective_world(launch), hw)


# --- compute ------------------------------------------------------------------------------------

# Ops that relabel memory (views, aliases, indexing a tuple) or only allocate: no time.
ZERO_COST_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "t", "transpose", "expand",
    "expand_as", "slice", "select", "narrow", "alias", "detach", "lift_fresh", "squeeze", "unsqueeze",
    "as_strided", "split", "split_with_sizes", "unbind", "chunk", "diagonal", "unfold", "movedim",
    "view_as", "view_as_real", "view_as_complex", "getitem", "empty", "empty_like", "empty_strided",
    "sym_size", "sym_numel", "sym_stride",
})

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


def node_flops(node: fx.Node) -> int:
    """FLOPs of ``node`` from ``torch.utils.flop_counter``'s formulas (0 for ops it has none for)."""
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
    return _flops_cache[key]


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


def node_seconds(node: fx.Node, hw: Hardware) -> float:
    """Estimated seconds of a compute node on ``hw``: ``max(flops / rate, bytes / bandwidth)``.

    ``rate`` is the peak of the op's dtype (bf16/fp16, else fp32) times the matmul fraction; ``bytes``
    counts tensor inputs and outputs once. Ops in ``ZERO_COST_OPS`` and non-call nodes cost 0, and so
    do collective launches and waits (the timeline charges them to their streams).
    """
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return 0.0
    name = op_name(node)
    if name in ZERO_COST_OPS:
        return 0.0
    out = node.meta.get("val")
    moved = _bytes(out) + sum(_bytes(i.meta.get("val")) for i in node.all_input_nodes)
    mem_frac = hw.fraction_of(name, hw.memory_fraction)
    seconds = moved / (hw.memory_bandwidth * mem_frac)
    flops = node_flops(node)
    if flops:
        dtype = next((t.dtype for i in node.all_input_nodes for t in _tensors(i.meta.get("val"))), None)
        peak = hw.peak_flops_bf16 if dtype in _MATMUL_DTYPES_FAST else hw.peak_flops_fp32
        seconds = max(seconds, flops / (peak * hw.fraction_of(name, hw.matmul_fraction)))
    return seconds


def detect_hardware() -> Hardware:
    """The preset for this process's device: an H100/H200 by CUDA device name, else the CPU preset."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100"):
            if key in name:
                return HARDWARE[key]
        return HARDWARE["h100"]
    return HARDWARE["cpu"]

