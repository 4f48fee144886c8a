"""The command line: ``python -m fsdp_compile demo``, ``explain`` and ``emulate``."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

from fsdp_compile.api.sharding import MixedPrecisionPolicy
from fsdp_compile.examples import emulate as emulate_cli
from fsdp_compile.examples import demo
from fsdp_compile.inspection.cost import HARDWARE
from fsdp_compile.examples.explain import explain
from fsdp_compile.examples.models import PRESETS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_compile",
        description="fsdp-compile: FSDP as a torch.compile backend. 'demo' trains a small transformer; 'explain' "
                    "shows a model's schedule and predicts its step time, no GPU needed.")
    sub = p.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help="train a small transformer on 2 CPU ranks (or GPUs)"))
    _explain_arguments(sub.add_parser("explain", help="show and predict a model's schedule, no GPU needed"))
    emulate_cli.add_arguments(sub.add_parser(
        "emulate", help="train as rank 0 of an emulated world of N GPUs on one GPU: step time, MFU, memory, "
                        "exposed communication"))
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    commands = {"demo": demo.main, "explain": _explain, "emulate": emulate_cli.main}
    return commands[ns.command](ns)


def _explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", choices=sorted(PRESETS), help="a built-in model preset")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--hosts", type=int, default=None,
                   help="hosts the ranks sit on, the same number of GPUs on each (default: hosts of the preset's "
                        "ranks_per_node GPUs, e.g. 8 hosts for 64 ranks)")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    p.add_argument("--calibration", default=None, help="JSON of measured numbers overriding the preset")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "mixed"],
                   help="'mixed': bf16 compute and all-gathers over fp32 shards, fp32 reduce-scatters (as emulate's)")
    p.add_argument("--dedicated", default="reduce_scatter", choices=["reduce_scatter", "all_gather", "none"])
    p.add_argument("--schedule", default="eager", choices=["eager", "delayed"])
    p.add_argument("--root-reshard", action=argparse.BooleanOptionalAction, default=True,
                   help="the root unit reshards after forward (--no-root-reshard: the parameters backward reads "
                        "first, such as the output head, stay gathered into backward, as FSDP2 keeps its root's)")
    p.add_argument("--prefetch", type=_prefetch_arg, default=1,
                   help="units gathered ahead of use: a number, or 'auto' (picked by the cost model)")
    p.add_argument("--prefetch-bytes", type=_bytes_arg, default=None,
                   help="cap on bytes gathered but not yet used, e.g. 512M (default: none)")
    p.add_argument("--reduce-scatter-bytes", type=_bytes_arg, default="auto",
                   help="cap on reduce-scatter input bytes in flight, e.g. 1G; 'auto' (default) or 'none'")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "adamw-fused", "none"],
                   help="the optimizer step added to the estimate (torch.optim's default implementation; "
                        "adamw-fused: AdamW(fused=True), as emulate runs on a GPU)")
    p.add_argument("--trace-layers", type=int, default=4,
                   help="blocks traced (totals extended to the full depth); 0 traces all")
    p.add_argument("--out", default=None,
                   help=f"directory for the tables, trace.json, summary.json and timeline.png (default: {_OUT}, "
                        f"or {_OUT}-2, -3... when it holds files already; a directory given here is overwritten)")
    p.add_argument("--print-tables", action="store_true", help="also print each graph's table")


_OUT = "out/explain"
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
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes as 1048576, 512K, 64M or 2G, "
                                         "or 'auto'/'none'") from None
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
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    result = explain(
        ns.model, world_size=ns.world_size, hosts=ns.hosts, hardware=ns.hardware, calibration=ns.calibration,
        batch=ns.batch, seq=ns.seq, dtype=torch.bfloat16 if ns.dtype == "bf16" else torch.float32,
        mp_policy=mixed if ns.dtype == "mixed" else None, root_reshard_after_forward=ns.root_reshard,
        dedicated=ns.dedicated,
        optimizer=None if ns.optimizer == "none" else ns.optimizer, schedule=ns.schedule, prefetch=ns.prefetch,
        prefetch_bytes=ns.prefetch_bytes, reduce_scatter_bytes=ns.reduce_scatter_bytes,
        trace_layers=ns.trace_layers or None, out_dir=ns.out if ns.out is not None else _fresh_dir(Path(_OUT)),
    )
    if ns.print_tables:
        for kind, text in result.tables.items():
            print(f"== {kind} ==\n{text}\n")
    print(summary_text(result.summary, ns))
    print("  wrote " + ", ".join(str(p) for p in result.files))
    return 0


def _fresh_dir(path: Path) -> Path:
    """``path`` if it is missing or empty, else the first of ``path-2``, ``path-3``... that is."""
    candidates = itertools.chain([path], (path.with_name(f"{path.name}-{i}") for i in itertools.count(2)))
    return next(p for p in candidates if not p.exists() or not any(p.iterdir()))


def summary_text(s: dict[str, Any], ns: argparse.Namespace) -> str:
    """The lines ``explain`` prints."""
    lines = [
        f"{ns.model} at {ns.world_size} ranks on {s['hosts']} host(s) of {s['hardware']}, {ns.dtype} ({ns.dedicated} "
        f"dedicated, {ns.schedule} schedule, prefetch {ns.prefetch}):",
        f"  estimated step     {s['step_ms']:.2f} ms = compute {s['compute_ms']:.2f} ms "
        + (f"(the {s['optimizer']} optimizer step's {s['optimizer_ms']:.2f} ms included) " if s["optimizer"] else
           "(no optimizer step) ")
        + f"+ exposed comm {s['exposed_comm_ms']:.2f} ms",
        f"  exposed comm       {s['exposed_comm_pct']:.1f}% of the step",
    ]
    for kind, b in s["peak_bytes_in_flight"].items():
        lines.append(f"  peak {kind:<16}{b / 2**20:.1f} MiB in flight")
    if "extrapolated_from_layers" in s:  # NOTE [periodic blocks] in explain.py
        fewer, traced = s["extrapolated_from_layers"]
        lines.append(f"  depth              the model's {s['layers']} blocks are identical: copies of {fewer} and "
                     f"{traced} blocks were traced, and the figures above add their difference per block up to "
                     f"{s['layers']}; the tables and picture show the {traced}-block copy "
                     "(--trace-layers 0 traces all)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
