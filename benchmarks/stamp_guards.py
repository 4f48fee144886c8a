"""What a stamped block costs Dynamo: the guards moved onto it, by kind, and Dynamo's seconds at depth.

NOTE [stamped blocks] (``fsdp_compile/stamp.py``): each block stamped out of the template's trace gets the
template's guards moved onto it, and Dynamo builds every one of them for every block (``build_guards``,
the part of a stamped block's cost that grows with its submodules). NOTE [guards fixed by sharding]
(``stamp_guards.py``) leaves out those on where a read finds its piece. This prints, for the small
Llama-style model (``fsdp_compile.models.Transformer``, sharded over a fake process group of 2 ranks,
stamping forced on as on torch 2.11), the template block's guards by kind and how many are moved onto
each later block; then, over ``--rounds``, Dynamo's own CPU seconds for ``--layers`` blocks with a
backend that compiles nothing, and the part of them spent building guards.

``python -m benchmarks.stamp_guards [--layers 4 32] [--rounds 3] [--json PATH]``
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def _sharded(layers: int) -> tuple[Any, Any]:
    from fsdp_compile import FsdpGroups, fully_shard
    from fsdp_compile.models import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, max_seq_len=16))
    groups = FsdpGroups.create()
    for block in model.layers:
        fully_shard(block, groups=groups)
    fully_shard(model, groups=groups)
    return model, groups


def _trace(model: Any) -> None:
    """Dynamo's trace of one forward, handed to a backend that compiles nothing."""
    from fsdp_compile.module import OUTLINES

    def keep(gm: Any, example: Any) -> Any:
        return gm.forward

    setattr(keep, OUTLINES, True)  # (traced as for fsdp_backend: NOTE [regions for our backend only])
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.compile(model, backend=keep, fullgraph=True)(torch.randint(0, 64, (1, 16)))
        except RuntimeError:  # (a stamped op only runs as its template's body: passes/stamp.py)
            pass


def guard_counts() -> dict[str, Any]:
    """The template block's guards by kind, and how many of them each later block gets."""
    from fsdp_compile import stamp

    template: list[Any] = []
    moved: list[int] = []
    real_block, real_move = stamp.block_guards, stamp.check_and_move

    def block_guards(*args: Any) -> Any:
        out = real_block(*args)
        template.extend(out)
        return out

    def check_and_move(*args: Any) -> Any:
        out = real_move(*args)
        moved.append(len(out))
        return out

    stamp.block_guards, stamp.check_and_move = block_guards, check_and_move
    try:
        model, groups = _sharded(3)
        _trace(model)
        groups.destroy()
    finally:
        stamp.block_guards, stamp.check_and_move = real_block, real_move
    kinds = collections.Counter(r.kind for r in template)
    fixed = collections.Counter(r.kind for r in template if getattr(r, "fixed", False))  # (none in an earlier tree)
    return {"template": len(template), "moved_per_block": moved, "by_kind": dict(kinds.most_common()),
            "fixed_by_sharding": dict(fixed.most_common())}


def dynamo_seconds(layers: int) -> tuple[float, float]:
    """This thread's CPU seconds for Dynamo's trace of ``layers`` blocks, and those of ``build_guards``."""
    from torch._dynamo.utils import compilation_time_metrics

    model, groups = _sharded(layers)
    compilation_time_metrics.clear()
    start = time.thread_time()
    _trace(model)
    total = time.thread_time() - start
    groups.destroy()
    return total, sum(compilation_time_metrics.get("build_guards", [0.0]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stamp_guards", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.workers import force_stamping

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with force_stamping():
            counts = guard_counts()
            runs: dict[int, list[tuple[float, float]]] = {n: [] for n in args.layers}
            for _ in range(args.rounds):
                for n in args.layers:
                    runs[n].append(dynamo_seconds(n))
    finally:
        dist.destroy_process_group()
    print(f"torch {torch.__version__}; template block: {counts['template']} guards "
          f"{counts['by_kind']}; moved onto each later block: {counts['moved_per_block']} "
          f"(checked, not moved: {counts['fixed_by_sharding']})\n")
    print("| blocks | dynamo s (median) | build_guards s (median) | runs (dynamo / build_guards) |\n|---|---|---|---|")
    for n, rs in runs.items():
        print(f"| {n} | {statistics.median(r[0] for r in rs):.2f} | {statistics.median(r[1] for r in rs):.2f} | "
              + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in rs) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "guards": counts,
                       "runs": {str(n): rs for n, rs in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
