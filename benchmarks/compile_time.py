"""Cold compile time by stage, at several depths, for fsdp-compile beside plain ``torch.compile`` and FSDP2.

Each measurement is one fresh process (``--child``): it initialises a process group, compiles a tiny
function once (Inductor's one-time set-up, not counted), builds a Llama-style model of ``--layers``
blocks, prepares it as the variant says and times its first training step (forward, loss, backward):
the *cold compile*. The stages come from torch.compile's own timing table
(``torch._dynamo.utils.compilation_time_metrics``, which ours adds to under ``fsdp.*`` keys, see
NOTE [compile-time keys] in ``fsdp_compile/compiler/backend.py``):

    dynamo     Dynamo's bytecode tracing, guards, graph building (compile_inner - call_user_compiler)
    aot        AOTAutograd: metadata and joint-graph tracing
    partition  Inductor's joint-graph passes and the min-cut partition (ours: with the reshard tags)
    passes     fsdp-compile's passes (lower, bucket, prefetch, reduce-scatter, streams) and outlining
    agreement  the cross-rank agreement check (off on a fake process group: nobody to compare with)
    inductor   compile_fx_inner less kernel compilation: post-grad passes, lowering, scheduling, codegen
    kernels    kernel compilation (Triton, or the C++ compiler on CPU) that the compile waited for
    other      the rest of the first step: running it, Inductor's pre-grad passes, wrappers

and, apart, ``gc``: what Python's garbage collector took during the first step, inside whichever stages
it interrupted (at 32 CPU blocks about a tenth of the compile, most of it a few full collections).

Variants run in turn within each round (the order rotates), so machine noise hits them alike; the table
gives medians over rounds. On CPU a second is, by default, one of the compiling thread's CPU seconds
(``--clock cpu``, NOTE [CPU clock]): on a machine shared with other work, wall time mostly measures the
neighbours. ``--steps N`` also times N forward+backward steps after the compile (no optimizer), and
every run records how many all-gathers, reduce-scatters and subgraph calls each compiled graph holds.

Caches. On GPU every child starts with empty caches (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``). On CPU the
kernels are C++ files whose compiler dominates everything else on two cores, so by default the FX-graph
and AOTAutograd caches are off while compiled kernels come from a persistent directory filled by an
untimed first run of each variant (``--cpu-kernels warm``): every Python-side stage is cold, the C++
compiler is not (``--cpu-kernels cold`` compiles those too). ``--warm-start`` instead runs each child
twice over one fresh cache directory with every cache on and reports the second start against the first.

CPU:  python -m benchmarks.compile_time --layers 4 16 32                 (fake process group, world 2)
GPU:  python -m benchmarks.compile_time --device cuda --dim 1024 --layers 4 16 32   (NCCL, world 1,
      collectives kept: ``make_backend(elide_single_rank=False)``; ``--world 2``: a fake group of 2 ranks
      on the one GPU, where SimpleFSDP and FSDP2 compile their collectives too, which at world 1 they
      leave out)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.compile_stages import DEFAULT_VARIANTS, STAGES, VARIANTS, child

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _child_env(args: argparse.Namespace, cache_dir: str | None, caches_on: bool,
               root: str | None = None) -> dict[str, str]:
    """A child's environment: its caches, and the source tree ``root`` (default: this one) first on its path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root or os.getcwd(), env.get("PYTHONPATH")]))
    if caches_on:
        env.update(TORCHINDUCTOR_FORCE_DISABLE_CACHES="0", TORCHINDUCTOR_FX_GRAPH_CACHE="1",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    elif cache_dir is None:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    else:
        env.update(TORCHINDUCTOR_FORCE_DISABLE_CACHES="0", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    return env


def _run_child(args: argparse.Namespace, variant: str, layers: int, env: dict[str, str],
               profile: str | None = None, cwd: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", "--variant", variant, "--layers", str(layers),
           "--device", args.device, "--world", str(args.world), "--dim", str(args.dim), "--heads", str(args.heads),
           "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch), "--dtype", args.dtype,
           "--clock", args.clock, "--steps", str(args.steps)]
    if profile:
        cmd += ["--profile", profile]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"variant": variant, "layers": layers, "error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cold_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    cache_dir = None
    if args.device == "cpu" and args.cpu_kernels == "warm":
        cache_dir = tempfile.mkdtemp(prefix="compile_time_kernels_")
        for variant in args.variants:  # fills the kernel cache; not timed
            print(f"[kernel cache] {variant} L{min(args.layers)}", file=sys.stderr, flush=True)
            _run_child(args, variant, min(args.layers), _child_env(args, cache_dir, False))
    runs = []
    try:
        for r in range(args.rounds):
            for layers in args.layers:
                k = r % len(args.variants)
                for variant in [*args.variants[k:], *args.variants[:k]]:
                    profile = None
                    if args.profile_dir and r == 0:
                        profile = os.path.join(args.profile_dir, f"{variant}-L{layers}.prof")
                    res = _run_child(args, variant, layers, _child_env(args, cache_dir, False), profile)
                    res["round"] = r
                    runs.append(res)
                    if "total_s" in res:
                        steps = res.get("step_ms") or [float("nan")]
                        done = (f"{res['total_s']:.1f}s {json.dumps({k: round(v, 1) for k, v in res['stages'].items()})}"
                                f" step {statistics.median(steps):.2f} ms {json.dumps(res.get('schedule'))}")
                    else:
                        done = "failed: " + res["error"].splitlines()[-1]
                    print(f"[round {r}] {variant} L{layers}: {done}", file=sys.stderr, flush=True)
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return runs


def _warm_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for r in range(args.rounds):
        for layers in args.layers:
            for variant in args.variants:
                cache_dir = tempfile.mkdtemp(prefix="compile_time_warm_")
                try:
                    first = _run_child(args, variant, layers, _child_env(args, cache_dir, True))
                    profile = None
                    if args.profile_dir and r == 0:  # the second start's profile
                        profile = os.path.join(args.profile_dir, f"{variant}-L{layers}-second.prof")
                    second = _run_child(args, variant, layers, _child_env(args, cache_dir, True), profile)
                finally:
                    shutil.rmtree(cache_dir, ignore_errors=True)
                runs.append({"variant": variant, "layers": layers, "round": r, "first": first, "second": second})
                if "total_s" in first and "total_s" in second:
                    print(f"[round {r}] {variant} L{layers}: first {first['total_s']:.1f}s, second "
                          f"{second['total_s']:.1f}s", file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[dict[str, Any]], variants: Sequence[str], layers: Sequence[int]) -> list[dict[str, Any]]:
    """Median total and stages per (layers, variant), with ratios to ``compile`` and to the fewest layers."""
    rows = []
    med: dict[tuple[str, int], float] = {}
    for n in layers:
        for v in variants:
            ok = [r for r in runs if r["variant"] == v and r["layers"] == n and "total_s" in r]
            if not ok:
                err = next((r["error"] for r in runs if r["variant"] == v and r["layers"] == n), "not run")
                rows.append({"layers": n, "variant": v, "error": err.splitlines()[-1]})
                continue
            med[(v, n)] = statistics.median(r["total_s"] for r in ok)
            stages = {s: statistics.median(r["stages"][s] for r in ok) for s in STAGES}
            steps = [t for r in ok for t in r.get("step_ms", [])]
            gc_s = [r["gc"]["seconds"] for r in ok if "gc" in r]
            rows.append({"layers": n, "variant": v, "runs": len(ok), "total_s": med[(v, n)], "stages": stages,
                         "gc_s": statistics.median(gc_s) if gc_s else None,
                         "late_graphs": max(r["late_graphs"] for r in ok),
                         "step_ms": statistics.median(steps) if steps else None})
    for row in rows:
        if "total_s" in row:
            plain = med.get(("compile", row["layers"]))
            shallow = med.get((row["variant"], min(layers)))
            row["vs_compile"] = row["total_s"] / plain if plain else None
            row["vs_fewest_layers"] = row["total_s"] / shallow if shallow else None
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| layers | variant | cold s | vs compile | vs L{} | " + " | ".join(STAGES) + " | gc (in stages) | step ms |"
    lines = [head.format(min(r["layers"] for r in rows)), "|" + "---|" * (7 + len(STAGES))]
    for r in rows:
        if "total_s" not in r:
            lines.append(f"| {r['layers']} | {r['variant']} | failed: {r['error'][:60]} |")
            continue
        ratio = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
        stages = " | ".join(f"{r['stages'][s]:.1f}" for s in STAGES)
        lines.append(f"| {r['layers']} | {r['variant']} | {r['total_s']:.1f} | {ratio(r['vs_compile'])} | "
                     f"{ratio(r['vs_fewest_layers'])} | {stages} | "
                     + (f"{r['gc_s']:.1f} | " if r.get("gc_s") is not None else "- | ")
                     + (f"{r['step_ms']:.2f} |" if r["step_ms"] is not None else "- |"))
    return "\n".join(lines)


def warm_markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["| layers | variant | first start s | second start s | second / first |", "|---|---|---|---|---|"]
    keys = sorted({(r["layers"], r["variant"]) for r in runs})
    for n, v in keys:
        pairs = [(r["first"]["total_s"], r["second"]["total_s"]) for r in runs
                 if (r["layers"], r["variant"]) == (n, v) and "total_s" in r["first"] and "total_s" in r["second"]]
        if pairs:
            a, b = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
            lines.append(f"| {n} | {v} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=None,
                   help="ranks: a fake process group of this size (default 2) on CPU; on a GPU 1 (default) is NCCL "
                        "with our collectives kept, more is a fake group whose collectives compile but move nothing "
                        "(so SimpleFSDP and FSDP2, which issue none at world 1, compile theirs too)")
    p.add_argument("--dim", type=int, default=None, help="model width (default: 32 on CPU, 1024 on GPU)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="forward+backward steps timed after the compile")
    p.add_argument("--cpu-kernels", choices=("warm", "cold"), default="warm")
    p.add_argument("--clock", choices=("wall", "cpu"), default=None,
                   help="what a second is: wall time, or the compiling thread's CPU time (default on CPU)")
    p.add_argument("--warm-start", action="store_true", help="every cache on: second process start vs first")
    p.add_argument("--profile-dir", default=None,
                   help="cProfile each child of the first round (with --warm-start: its second start) into this folder")
    p.add_argument("--json", default=None, help="output path (default: benchmarks/results/compile_time-...json)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {"dim": 1024 if cuda else 32, "heads": 8 if cuda else 2, "vocab": 32000 if cuda else 64,
                "seq": 1024 if cuda else 16, "dtype": "bf16" if cuda else "fp32"}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.world is None:
        args.world = 1 if cuda else 2
    if args.clock is None:
        args.clock = "wall" if cuda or args.cpu_kernels == "cold" else "cpu"
    if args.child:
        args.layers = args.layers[0]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    mode = "warm" if args.warm_start else "cold"
    runs = _warm_runs(args) if args.warm_start else _cold_runs(args)
    import torch

    meta = {"date": datetime.date.today().isoformat(), "device": args.device, "world": args.world, "clock": args.clock,
            "torch": torch.__version__, "mode": mode, "cpu_kernels": args.cpu_kernels if args.device == "cpu" else None,
            "model": {k: getattr(args, k) for k in ("dim", "heads", "vocab", "seq", "batch", "dtype")},
            "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.compile_time",
                                 *(argv if argv is not None else sys.argv[1:])])}
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(0)
    if args.warm_start:
        table, rows = warm_markdown(runs), None
    else:
        rows = summarize(runs, args.variants, args.layers)
        table = markdown(rows)
    path = Path(args.json) if args.json else RESULTS_DIR / f"compile_time-{mode}-{args.device}-w{args.world}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
    print(f"{meta['command']}\n{meta['date']}, {args.device}, world {args.world}, torch {meta['torch']}, {args.clock} "
          "seconds, "
          f"llama D{args.dim} H{args.heads} V{args.vocab} seq {args.seq}x{args.batch} {args.dtype}\n\n{table}\n\n"
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
