"""Warm start of two source trees side by side: second process starts alternated over one cache directory.

``benchmarks.compile_time --warm-start`` measures one tree, a fresh cache per round, so its second starts
are as noisy as the machine. To compare two trees (an earlier commit, ``git archive REV | tar -x -C
.base``, against this one) this fills one cache directory with a first start of each (their entries do
not collide: the cache key holds fsdp-compile's source, NOTE [warm start]) and then times ``--rounds``
second starts of each, alternating which goes first. Every other option (``--layers``, ``--variants``,
``--device``, the model's shape) is ``compile_time``'s, and so are the stages; JSON to ``--json``.

``python -m benchmarks.warm_ab --trees .base . --layers 32 --rounds 4 [--device cuda --dim 1024 ...]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.compile_time import _child_env, _run_child, parse_args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    ours, rest = p.parse_known_args(argv)
    defaults = {"--layers": ["32"], "--variants": ["fsdp-compile-stacked"]}
    args = parse_args([*rest, *(a for k, v in defaults.items() if k not in rest for a in (k, *v))])
    variant = args.variants[0]
    trees = [os.path.abspath(t) for t in ours.trees]

    def start(tree: str, layers: int, cache_dir: str) -> dict[str, Any]:
        return _run_child(args, variant, layers, _child_env(args, cache_dir, True, root=tree), cwd=tree)

    runs: list[dict[str, Any]] = []
    for layers in args.layers:
        cache_dir = tempfile.mkdtemp(prefix="warm_ab_")
        try:
            for tree in trees:
                runs.append({"tree": tree, "layers": layers, "start": "first", **start(tree, layers, cache_dir)})
            for r in range(ours.rounds):
                for tree in trees if r % 2 == 0 else trees[::-1]:
                    res = start(tree, layers, cache_dir)
                    runs.append({"tree": tree, "layers": layers, "start": "second", "round": r, **res})
                    shown = (f"{res['total_s']:.2f}s " + json.dumps({k: round(v, 2) for k, v in res["stages"].items()})
                             if "total_s" in res else "failed: " + res["error"].splitlines()[-1])
                    print(f"[round {r}] L{layers} {tree}: {shown}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    # (the second tree's first start finds the first one's kernels and Inductor graphs: no ratio to it)
    lines = ["| layers | tree | first start s | second starts s | median |", "|---|---|---|---|---|"]
    for layers in args.layers:
        for name, tree in zip(ours.trees, trees):
            def total(start: str) -> list[float]:
                return [r["total_s"] for r in runs
                        if (r["tree"], r["layers"], r["start"]) == (tree, layers, start) and "total_s" in r]
            first, second = total("first"), total("second")
            if first and second:
                lines.append(f"| {layers} | {name} | {first[0]:.1f} | {', '.join(f'{s:.2f}' for s in second)} | "
                             f"{statistics.median(second):.2f} |")
    table = "\n".join(lines)
    meta = {"date": datetime.date.today().isoformat(), "device": args.device, "variant": variant,
            "trees": ours.trees, "command": " ".join(["python -m benchmarks.warm_ab", *argv])}
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(f"{meta['command']}\n{meta['date']}, {args.device}, {variant}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
