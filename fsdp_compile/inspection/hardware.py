"""What one rank's hardware can do: the numbers behind the cost model, presets, calibration files::

    hw = load_hardware("h200", "benchmarks/calibration/h200x2.json")

The H200's numbers come from ``benchmarks/calibration/measure_kernels.py`` (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Hardware", "HARDWARE", "load_hardware", "write_calibration", "detect_hardware"]


@dataclass(frozen=True)
class Hardware:
    """What one rank can do, in SI units (FLOP/s, bytes/s, seconds)."""

    name: str
    peak_flops_bf16: float  # dense FLOP/s of bf16/fp16 matmuls (also used for fp8/int8: a lower bound)
    peak_flops_fp32: float  # FLOP/s of fp32 matmuls without TF32 (PyTorch's default)
    matmul_fraction: float  # share of peak a large matmul reaches
    memory_bandwidth: float  # bytes/s of device memory
    memory_fraction: float  # share of it a streaming kernel (copy, fused pointwise) reaches
    intra_node_busbw: float  # bytes/s per rank, NCCL "busbw", ranks within a node
    inter_node_busbw: float  # bytes/s per rank when a group spans nodes
    ranks_per_node: int
    collective_latency: float  # s, fixed cost of one collective (launch + first step)
    hop_latency: float = 0.0  # s, each further ring step (world - 2 of them)
    op_fraction: tuple[tuple[str, float], ...] = ()  # per op, its share of peak FLOP/s and bandwidth: (("mm", 0.6),)
    # A (m x k) @ (k x n) matmul runs at matmul_fraction * m/(m+h) * n/(n+h) * k/(k+hk) of peak
    matmul_half_mn: float = 0.0  # h
    matmul_half_k: float = 0.0  # hk
    # Fused attention runs at these fractions of peak, times s/(s + attention_half_seq) for sequence length s
    attention_fraction: float = 0.5
    attention_backward_fraction: float = 0.4
    attention_half_seq: float = 0.0
    kernel_latency: float = 0.0  # s, the least time one kernel takes (launch, ramp-up, tail)
    foreach_fraction: float = 0.6  # share of memory bandwidth the optimizers' multi-tensor kernels reach
    # Compute beside a collective takes 1 + overlap_slowdown times as long (NCCL's kernels hold SMs)
    overlap_slowdown: float = 0.0

    def fraction_of(self, op: str, default: float) -> float:
        """The achievable fraction for ``op`` (an overload packet name), or ``default``."""
        return next((frac for name, frac in self.op_fraction if name == op), default)


# H100 SXM5: datasheet and NCCL numbers (docs/performance.md, "The presets").
_H100 = Hardware(
    name="h100", peak_flops_bf16=989e12, peak_flops_fp32=67e12, matmul_fraction=0.8,
    memory_bandwidth=3.35e12, memory_fraction=0.88, intra_node_busbw=360e9, inter_node_busbw=40e9,
    ranks_per_node=8, collective_latency=15e-6, hop_latency=1e-6, matmul_half_mn=128, matmul_half_k=256,
    attention_fraction=0.87, attention_backward_fraction=0.79, attention_half_seq=3584, kernel_latency=3e-6,
    foreach_fraction=0.62, overlap_slowdown=0.2,
)

# H200 SXM: the H100's compute with faster memory.
_H200 = dataclasses.replace(_H100, name="h200", memory_bandwidth=4.8e12)

# A 2-core x86 CPU running gloo over loopback (rough): all ranks on one host.
_CPU = Hardware(
    name="cpu", peak_flops_bf16=50e9, peak_flops_fp32=100e9, matmul_fraction=0.3, memory_bandwidth=20e9,
    memory_fraction=0.5, intra_node_busbw=1.5e9, inter_node_busbw=1.5e9, ranks_per_node=64,
    collective_latency=50e-6, hop_latency=10e-6, attention_fraction=0.3, attention_backward_fraction=0.3,
    foreach_fraction=0.5,
)

HARDWARE: dict[str, Hardware] = {"h100": _H100, "h200": _H200, "cpu": _CPU}

_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware))
_MAY_BE_ZERO = {"hop_latency", "collective_latency", "matmul_half_mn", "matmul_half_k", "attention_half_seq",
                "kernel_latency", "overlap_slowdown"}
_FRACTIONS = ("matmul_fraction", "memory_fraction", "attention_fraction", "attention_backward_fraction",
              "foreach_fraction")


def load_hardware(name: str | Hardware = "h200", calibration: str | Path | Mapping[str, Any] | None = None) -> Hardware:
    """A preset (or ``name`` itself, if a ``Hardware``) overlaid with ``calibration``: a JSON file or dict of
    any of ``Hardware``'s fields (``op_fraction`` may be a dict; keys starting with ``_`` are ignored)."""
    if isinstance(name, Hardware):
        base = name
    elif name in HARDWARE:
        base = HARDWARE[name]
    else:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(sorted(HARDWARE))}")
    if calibration is None:
        return base
    values = calibration if isinstance(calibration, Mapping) else json.loads(Path(calibration).read_text())
    values = {k: v for k, v in values.items() if not str(k).startswith("_")}
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown calibration field(s) {unknown}; valid fields: {', '.join(_FIELDS)}")
    if "op_fraction" in values:
        fractions = values["op_fraction"]
        items = fractions.items() if isinstance(fractions, Mapping) else fractions
        values["op_fraction"] = tuple(sorted((str(k), float(v)) for k, v in items))
    hw = dataclasses.replace(base, **values)
    _validate(hw)
    return hw


def write_calibration(hw: Hardware, path: str | Path) -> None:
    """Write every field of ``hw`` as a calibration JSON that ``load_hardware`` reads back."""
    data = dataclasses.asdict(hw)
    data["op_fraction"] = dict(hw.op_fraction)
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _validate(hw: Hardware) -> None:
    for f in _FIELDS:
        if f in ("name", "op_fraction"):
            continue
        v = getattr(hw, f)
        if not isinstance(v, (int, float)) or v < 0 or (v == 0 and f not in _MAY_BE_ZERO):
            raise ValueError(f"hardware field {f} must be a positive number, got {v!r}")
    for op, frac in [*((f, getattr(hw, f)) for f in _FRACTIONS), *hw.op_fraction]:
        if not 0 < frac <= 1:
            raise ValueError(f"fraction for {op} must be in (0, 1], got {frac}")


def detect_hardware() -> Hardware:
    """The preset for this process's device: ``h200`` or ``h100`` by CUDA device name, else ``cpu``."""
    if torch.cuda.is_available():
        return HARDWARE["h200" if "h200" in torch.cuda.get_device_name().lower() else "h100"]
    return HARDWARE["cpu"]
