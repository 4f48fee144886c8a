"""Warm start of two source trees side by side: second process starts alternated over one cache directory.

``benchmarks.compile_time --warm-start`` measures one tree, a fresh cache per round, so its second starts
are as noisy as the machine. To compare two trees (an earlier commit, ``git archive REV | tar -x -C
.base``, against this one) this fills one cache directory with a first start of each (their entries do
not collide: the cache key holds fsdp-compile's source, NOTE [warm start]) and then times ``--rounds``
second starts of each, alternating which goes first. Stages as in ``compile_time``; JSON to ``--json``.

``python -m benchmarks.warm_ab --trees .base . --layers 32 --rounds 4 [--device cuda]``
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
from typing import Any


def _start(tree: str, layers: int, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", "--variant", args.variant, "--layers",
           str(layers), "--device", args.device, "--steps", "0", *args.shape]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])),
               TORCHINDUCTOR_FORCE_DISABLE_CACHES="0", TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", TORCHINDUCTOR_CACHE_DIR=cache_dir,
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        return {"error": "\n".join(proc.stderr.strip().splitlines()[-10:])}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    p.add_argument("--layers", type=int, nargs="+", default=[32])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variant", default="fsdp-compile-stacked")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args, args.shape = p.parse_known_args(argv)  # the rest (--dim 1024 ...) goes to each start
    trees = [os.path.abspath(t) for t in args.trees]
    runs: list[dict[str, Any]] = []
    for layers in args.layers:
        cache_dir = tempfile.mkdtemp(prefix="warm_ab_")
        try:
            for tree in trees:
                runs.append({"tree": tree, "layers": layers, "start": "first", **_start(tree, layers, args, cache_dir)})
            for r in range(args.rounds):
                for tree in trees if r % 2 == 0 else trees[::-1]:
                    res = _start(tree, layers, args, cache_dir)
                    runs.append({"tree": tree, "layers": layers, "start": "second", "round": r, **res})
                    shown = (f"{res['total_s']:.2f}s " + json.dumps({k: round(v, 2) for k, v in res["stages"].items()})
                             if "total_s" in res else "failed: " + res["error"].splitlines()[-1])
                    print(f"[round {r}] L{layers} {tree}: {shown}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    # (the second tree's first start finds the first one's kernels and Inductor graphs: no ratio to it)
    lines = ["| layers | tree | first start s | second starts s | median |", "|---|---|---|---|---|"]
    for layers in args.layers:
        for tree in trees:
            first = [r["total_s"] for r in runs if (r["tree"], r["layers"], r["start"]) == (tree, layers, "first")
                     and "total_s" in r]
            second = [r["total_s"] for r in runs if (r["tree"], r["layers"], r["start"]) == (tree, layers, "second")
                      and "total_s" in r]
            if first and second:
                med = statistics.median(second)
                lines.append(f"| {layers} | {args.trees[trees.index(tree)]} | {first[0]:.1f} | "
                             f"{', '.join(f'{s:.2f}' for s in second)} | {med:.2f} |")
    table = "\n".join(lines)
    meta = {"date": datetime.date.today().isoformat(), "device": args.device, "variant": args.variant,
            "shape": args.shape, "trees": args.trees, "command": " ".join(["python -m benchmarks.warm_ab", *(argv or sys.argv[1:])])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(f"{meta['command']}\n{meta['date']}, {args.device}, {args.variant}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
