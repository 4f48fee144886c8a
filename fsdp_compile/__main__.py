"""``python -m fsdp_compile demo`` (and, as they land, ``explain`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys

import torch

from . import demo
from .cost import HARDWARE
from .explain import explain
from .models import PRESETS


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
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--trace-layers", type=int, default=4,
                   help="blocks traced (totals extended to the full depth); 0 traces all")
    p.add_argument("--out", default="out/explain", help="directory for tables, trace.json, timeline.png")
    p.add_argument("--print-tables", action="store_true", help="also print each graph's table")


def _explain(ns: argparse.Namespace) -> int:
    result = explain(
        ns.model, world_size=ns.world_size, hardware=ns.hardware, calibration=ns.calibration, batch=ns.batch,
        seq=ns.seq, dtype=torch.bfloat16 if ns.dtype == "bf16" else torch.float32, dedicated=ns.dedicated,
        schedule=ns.schedule, prefetch=ns.prefetch, trace_layers=ns.trace_layers or None, out_dir=ns.out,
    )
    if ns.print_tables:
        for kind, text in result.tables.items():
            print(f"== {kind} ==\n{text}\n")
    s = result.summary
    print(f"{ns.model} at {ns.world_size} ranks on {s['hardware']} ({ns.dedicated} dedicated, {ns.schedule} schedule, "
          f"prefetch {ns.prefetch}):")
    print(f"  estimated step     {s['step_ms']:.2f} ms (compute {s['compute_ms']:.2f} ms)")
    print(f"  exposed comm       {s['exposed_comm_ms']:.2f} ms ({s['exposed_comm_pct']:.1f}% of the step)")
    for kind, b in s["peak_bytes_in_flight"].items():
        print(f"  peak {kind:<16}{b / 2**20:.1f} MiB in flight")
    if "extrapolated_from_layers" in s:
        print(f"  (traced {s['extrapolated_from_layers']} of {s['layers']} identical blocks; totals extended linearly)")
    print("  wrote " + ", ".join(str(p) for p in result.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
