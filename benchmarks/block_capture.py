"""What capturing one block costs: Dynamo's inline trace per block against ``make_fx`` of each block.

A design that kept the unrolled whole-model graph but traced blocks with ``make_fx`` (under the fake
mode, through ``torch.func.functional_call``) instead of Dynamo would pay the second number per block.
Both are the growth from 4 to 32 blocks of the same Llama-style model (``fsdp_compile.models``, the
tests' small shapes, unsharded; Dynamo's is ``benchmarks.dynamo_reads.trace_seconds``), in CPU seconds of this thread, over ``--rounds``.

``python -m benchmarks.block_capture [--rounds 2]``; README, Compile time, says what it showed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.dynamo_reads import trace_seconds
from fsdp_compile.models import ModelConfig, Transformer

_FEW, _MANY = 4, 32


def _model(layers: int) -> Transformer:  # the model benchmarks.dynamo_reads traces
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, max_seq_len=16))


def make_fx_seconds(layers: int) -> tuple[float, int]:
    """``make_fx`` of every block on fake inputs; the seconds, and one block's node count."""
    model = _model(layers)
    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(2, 8, 32, requires_grad=True))  # dynamo_reads' tokens: 2 x 8
    cos, sin = mode.from_tensor(model.rope_cos), mode.from_tensor(model.rope_sin)
    nodes = 0
    t0 = time.thread_time()
    for block in model.layers:
        params = {k: mode.from_tensor(v) for k, v in block.named_parameters()}
        with mode:
            graph = make_fx(lambda p, *xs, b=block: functional_call(b, p, xs))(params, x, cos, sin)
        nodes = len(graph.graph.nodes)
    return time.thread_time() - t0, nodes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.block_capture", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    per_block: dict[str, list[float]] = {"dynamo": [], "make_fx": []}
    nodes = 0
    for _ in range(args.rounds):
        dynamo = trace_seconds(_MANY, "plain", None) - trace_seconds(_FEW, "plain", None)
        per_block["dynamo"].append(dynamo / (_MANY - _FEW) * 1e3)
        (many, nodes), (few, _) = make_fx_seconds(_MANY), make_fx_seconds(_FEW)
        per_block["make_fx"].append((many - few) / (_MANY - _FEW) * 1e3)
    rows = [f"| {name} | {statistics.median(ms):.1f} | {', '.join(f'{m:.1f}' for m in ms)} |"
            for name, ms in per_block.items()]
    print(f"torch {torch.__version__}, ms per block from {_FEW} to {_MANY} blocks, CPU time, "
          f"median of {args.rounds} (one block: {nodes} make_fx nodes)\n\n"
          "| capture | ms per block | runs |\n|---|---|---|\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
