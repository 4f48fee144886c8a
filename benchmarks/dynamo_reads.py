"""What sharding costs Dynamo: the time to trace a model whose every block is traced inline, plain vs sharded.

torch 2.11's ``nested_compile_region`` traces every call of a block before it shares the body, so there
Dynamo's time grows with the blocks it traces, and each sharded parameter a block reads is traced too
(the parametrization's property, its modules, the marker op and its constant arguments). This traces
the same Llama-style model (``fsdp_compile.models.Transformer``, tests' small shapes) with a backend that
compiles nothing (so nothing is outlined and no graph is lowered), unsharded and sharded over a fake
process group of 2 ranks, alternated over ``--rounds``, and prints the median CPU seconds of each and
their ratio.

On 2.13 the reused blocks are not traced again; each reuse re-evaluates the block's guards instead,
whose count ``TORCH_LOGS=+hierarchical_compile`` prints ("Number of guards").

``python -m benchmarks.dynamo_reads --layers 32``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def trace_seconds(layers: int, sharded: bool, groups: object) -> float:
    from fsdp_compile import fully_shard
    from fsdp_compile.models import ModelConfig, Transformer

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, max_seq_len=16)
    model = Transformer(cfg)
    if sharded:
        for block in model.layers:
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
    compiled = torch.compile(model, backend=lambda gm, example_inputs: gm.forward, fullgraph=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    t0 = time.thread_time()
    with torch.no_grad():
        compiled(tokens)
    return time.thread_time() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dynamo_reads", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile import FsdpGroups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    groups = FsdpGroups.create()
    times: dict[str, list[float]] = {"plain": [], "sharded": []}
    try:
        for _ in range(args.rounds):
            for name in times:
                times[name].append(trace_seconds(args.layers, name == "sharded", groups))
    finally:
        groups.destroy()
        dist.destroy_process_group()
    plain, sharded = (statistics.median(times[k]) for k in ("plain", "sharded"))
    print(f"torch {torch.__version__}, {args.layers} blocks, inline trace, CPU seconds, median of {args.rounds}\n\n"
          f"| model | trace s | runs |\n|---|---|---|\n"
          f"| plain | {plain:.2f} | {', '.join(f'{t:.2f}' for t in times['plain'])} |\n"
          f"| sharded | {sharded:.2f} ({sharded / plain:.2f}x) | {', '.join(f'{t:.2f}' for t in times['sharded'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
