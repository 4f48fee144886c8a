"""``python -m fsdp_compile demo`` (and, as they land, ``explain`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from fsdp_compile.examples import demo
from fsdp_compile.inspect.cost import HARDWARE
from fsdp_compile.inspect.explain import explain
from fsdp_compile.examples.models import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help="train a small transformer on 2 CPU ranks (or GPUs)"))
    _explain_arguments(sub.add_parser("explain", help="show and predict a model's schedule, no GPU needed"))
    ns = parser.parse_args(argv)
    if ns.command == "demo":
        return demo.main(ns)
    if ns.command == "explain":
        return _explain(ns)
    raise AssertionError(ns.command)


def _explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", choices=sorted(PRESETS), help="a built-in model preset")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    p.add_argument("--calibration", default=None, help="JSON of measured numbers overriding the preset")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--dedicated", default="reduce_scatter", choices=["reduce_scatter", "all_gather", "none"])
    p.add_argument("--schedule", default="eager", choices=["eager", "delayed"])
    p.add_argument("--prefetch", type=_prefetch_arg, default=1,
                   help="units gathered ahead of use: a number, or 'auto' (picked by the cost model)")
    p.add_argument("--prefetch-bytes", type=_bytes_arg, default=None,
                   help="cap on bytes gathered but not yet used, e.g. 512M (default: none)")
    p.add_argument("--reduce-scatter-bytes", type=_bytes_arg, default="auto",
                   help="cap on reduce-scatter input bytes in flight, e.g. 1G; 'auto' (default) or 'none'")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "none"],
                   help="the optimizer step added to the estimate (torch.optim's default implementation)")
    p.add_argument("--trace-layers", type=int, default=4,
                   help="blocks traced (totals extended to the full depth); 0 traces all")
    p.add_argument("--out", default="out/explain", help="directory for tables, trace.json, timeline.png")
    p.add_argument("--print-tables", action="store_true", help="also print each graph's table")


_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def _bytes_arg(text: str) -> int | str | None:
    """``1048576``, ``512K``, ``64M``, ``2G`` (powers of 2), ``auto`` or ``none``."""
    low = text.strip().lower().removesuffix("ib").removesuffix("b")
    if low in ("auto", "none"):
        return None if low == "none" else "auto"
    scale = _UNITS.get(low[-1:], 1)
    try:
        value = float(low[:-1] if scale > 1 else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes as 1048576, 512K, 64M or 2G, or 'auto'/'none'") from None
    return int(value * scale)


def _prefetch_arg(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of units (0, 1, 2...) or 'auto'") from None


def _explain(ns: argparse.Namespace) -> int:
    if ns.prefetch_bytes == "auto":
        raise SystemExit("--prefetch-bytes takes a number of bytes (or 'none'), not 'auto'")
    result = explain(
        ns.model, world_size=ns.world_size, hardware=ns.hardware, calibration=ns.calibration, batch=ns.batch,
        seq=ns.seq, dtype=torch.bfloat16 if ns.dtype == "bf16" else torch.float32, dedicated=ns.dedicated,
        optimizer=None if ns.optimizer == "none" else ns.optimizer, schedule=ns.schedule, prefetch=ns.prefetch,
        prefetch_bytes=ns.prefetch_bytes, reduce_scatter_bytes=ns.reduce_scatter_bytes,
        trace_layers=ns.trace_layers or None, out_dir=ns.out,
    )
    if ns.print_tables:
        for kind, text in result.tables.items():
            print(f"== {kind} ==\n{text}\n")
    print(summary_text(result.summary, ns))
    print("  wrote " + ", ".join(str(p) for p in result.files))
    return 0


def summary_text(s: dict[str, Any], ns: argparse.Namespace) -> str:
    """The lines ``explain`` prints: the estimated step, what it is made of, peaks in flight."""
    lines = [
        f"{ns.model} at {ns.world_size} ranks on {s['hardware']} ({ns.dedicated} dedicated, {ns.schedule} schedule, "
        f"prefetch {ns.prefetch}):",
        f"  estimated step     {s['step_ms']:.2f} ms: compute {s['compute_ms'] - s['optimizer_ms']:.2f} ms, "
        f"{s['optimizer'] or 'no'} optimizer step {s['optimizer_ms']:.2f} ms, exposed comm {s['exposed_comm_ms']:.2f} ms",
        f"  exposed comm       {s['exposed_comm_pct']:.1f}% of the step",
    ]
    for kind, b in s["peak_bytes_in_flight"].items():
        lines.append(f"  peak {kind:<16}{b / 2**20:.1f} MiB in flight")
    if "extrapolated_from_layers" in s:
        lines.append(f"  traced {s['extrapolated_from_layers'][1]} and {s['extrapolated_from_layers'][0]} of "
                     f"{s['layers']} identical blocks; the totals above are extended linearly to {s['layers']}, "
                     "the tables and picture show the traced blocks")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
