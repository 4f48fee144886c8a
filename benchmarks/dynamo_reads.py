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

More variants take parts of sharding away again, to say which part costs what. Each is the sharded
model with every sharded parameter's read changed: ``attrs``, a plain tensor attribute of the full shape
(no property, no marker); ``attrs-unmixed``, the same with the units' own classes back (no
``FsdpModule`` forward wrapper); ``prop-plain``, a property that returns that tensor (the cost of a
property as such); ``prop-marker``, a property that calls the marker on the shard with its arguments
read from the module's ``__dict__`` (what a read costs without parametrize's modules and the
accumulator check). They compute nothing useful; only their trace is timed.

``python -m benchmarks.dynamo_reads --layers 32 [--variants plain,sharded,attrs,prop-plain,prop-marker]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


VARIANTS = ("plain", "sharded", "attrs", "attrs-unmixed", "prop-plain", "prop-marker")


def _swap_reads(model: torch.nn.Module, variant: str) -> None:
    """The reads of ``attrs``, ``attrs-unmixed``, ``prop-plain`` and ``prop-marker`` (module docstring)."""
    from fsdp_compile.module import FsdpModule

    for module in list(model.modules()):
        if "parametrizations" in module._modules:
            reads = {}
            for name, chain in list(module._modules["parametrizations"].items()):
                p = chain[0].param
                reads[name] = (torch.zeros(p.full_shape), chain.original, p.traced_args)
                if variant.startswith("attrs"):
                    delattr(type(module), name)
                    module.__dict__[name] = reads[name][0]
                else:
                    setattr(type(module), name, property(_read_plain(name) if variant == "prop-plain"
                                                         else _read_marker(name)))
            module.__dict__["_reads"] = reads
        if variant == "attrs-unmixed" and isinstance(module, FsdpModule):
            module.__class__ = next(c for c in type(module).__mro__ if not issubclass(c, FsdpModule))


def _read_plain(name: str) -> Any:
    return lambda self: self.__dict__["_reads"][name][0]


def _read_marker(name: str) -> Any:
    def get(self: torch.nn.Module) -> torch.Tensor:
        _, shard, args = self.__dict__["_reads"][name]
        return torch.ops.fsdp.unshard(shard, *args, None)

    return get


def trace_seconds(layers: int, variant: str | bool, groups: object) -> float:
    from fsdp_compile import fully_shard
    from fsdp_compile.models import ModelConfig, Transformer

    if isinstance(variant, bool):  # the older signature: sharded or not
        variant = "sharded" if variant else "plain"
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, max_seq_len=16)
    model = Transformer(cfg)
    if variant != "plain":
        for block in model.layers:
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
    if variant not in ("plain", "sharded"):
        _swap_reads(model, variant)
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
    p.add_argument("--variants", default="plain,sharded", help=f"comma-separated, from {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile import FsdpGroups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    groups = FsdpGroups.create()
    times: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for r in range(args.rounds):  # the order rotates, so drift hits every variant alike
            for name in variants[r % len(variants):] + variants[:r % len(variants)]:
                times[name].append(trace_seconds(args.layers, name, groups))
    finally:
        groups.destroy()
        dist.destroy_process_group()
    base = statistics.median(times[variants[0]])
    rows = [f"| {v} | {statistics.median(times[v]):.2f} ({statistics.median(times[v]) / base:.2f}x) | "
            f"{', '.join(f'{t:.2f}' for t in times[v])} |" for v in variants]
    print(f"torch {torch.__version__}, {args.layers} blocks, inline trace, CPU seconds, median of {args.rounds}, "
          f"ratios to {variants[0]}\n\n| model | trace s | runs |\n|---|---|---|\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
