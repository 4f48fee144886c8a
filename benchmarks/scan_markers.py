"""Do fsdp-compile's markers survive a scan, and what does the scan's backward keep? A probe for the
scan-based design of README, Compile time.

Each of ``--blocks`` iterations of one ``torch._higher_order_ops.scan`` reads its block's rows of a
stacked weight through ``fsdp::unshard`` (world size 2, a fake process group: nothing is communicated)
and applies it; the first carry requires grad (on torch 2.11 a scan whose first carry does not drops the
carry's gradient, so every block but the last gets a wrong weight gradient: pytorch/pytorch#184528,
fixed in a later release; 0.72 and 1.03 off on 3 blocks here, eager and compiled). The forward and backward graphs AOTAutograd hands to a compiler are printed as what
matters here: which ``fsdp::*`` ops each graph's loop body holds (the marker's own backward is
``fsdp::reduce_grad``), and which outputs the forward returns for the backward. An output of shape
``(blocks, D, D)`` is every block's *gathered* weight, saved from forward to backward: the scan's own
partition keeps what the body gathered instead of gathering it again in backward, so resharding after
forward would not hold in a scan as it does in our whole-model graph (NOTE [reshard by recompute] in
``fsdp_compile/partition.py``, which runs only on the outer joint graph).

``python -m benchmarks.scan_markers [--blocks 3 --dim 8]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from functorch.compile import aot_module_simplified, make_boxed_func
from torch import fx
from torch._higher_order_ops.scan import scan
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compile import FsdpGroups


def _fsdp_ops(gm: fx.GraphModule) -> dict[str, list[str]]:
    """``fsdp::*`` ops by the graph module (the graph itself, its loop bodies) that holds them."""
    out: dict[str, list[str]] = {}
    for name, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            ops = [str(n.target) for n in module.graph.nodes if str(n.target).startswith("fsdp.")]
            if ops:
                out[name or "(graph)"] = ops
    return out


def probe(blocks: int, dim: int, recompute: bool = False) -> list[dict[str, Any]]:
    """The forward's and backward's graphs as :func:`_fsdp_ops` and their outputs' shapes. With
    ``recompute`` the body's unshard runs under activation checkpointing (``torch.utils.checkpoint``),
    so that backward may gather again instead of keeping the gathered weight."""
    groups = FsdpGroups.create()
    ag, rs = groups.all_gather.group_name, groups.reduce_scatter.group_name
    try:
        rows = torch.nn.Parameter(torch.randn(blocks, dim // 2, dim))  # this rank's rows of each block's weight

        def body(h: torch.Tensor, xs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            (w,) = xs if isinstance(xs, (list, tuple)) else (xs,)

            def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                full = torch.ops.fsdp.unshard(w, [dim, dim], 2, 0, "w", ag, rs, "", 0, True, None, None, None)
                return torch.tanh(h @ full.t())

            if recompute:
                return torch.utils.checkpoint.checkpoint(block, h, w, use_reentrant=False), h.new_zeros(())
            return block(h, w), h.new_zeros(())

        def run(h: torch.Tensor) -> torch.Tensor:
            out, _ = scan(body, h, [rows])
            return out.sum()

        seen: list[fx.GraphModule] = []

        def keep(gm: fx.GraphModule, example_inputs: Any) -> Any:
            seen.append(gm)
            return make_boxed_func(gm.forward)

        def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
            return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

        torch._dynamo.reset()
        # The carry requires grad, as hidden states from a trained embedding do: on torch 2.11 a scan
        # whose first carry does not drops the carry's gradient (pytorch/pytorch#184528, fixed after).
        torch.compile(run, backend=backend, fullgraph=True)(torch.randn(2, dim, requires_grad=True)).backward()
    finally:
        groups.destroy()
    result = []
    for kind, gm in zip(("forward", "backward"), seen):
        (outputs,) = gm.graph.find_nodes(op="output")[0].args
        shapes = [tuple(o.meta["val"].shape) for o in outputs if isinstance(o, fx.Node)
                  and isinstance(o.meta.get("val"), torch.Tensor)]
        result.append({"graph": kind, "fsdp_ops": _fsdp_ops(gm), "outputs": shapes})
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scan_markers", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--recompute", action="store_true", help="the body under activation checkpointing")
    args = p.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        rows = probe(args.blocks, args.dim, args.recompute)
    finally:
        dist.destroy_process_group()
    gathered = (args.blocks, args.dim, args.dim)
    print(f"torch {torch.__version__}, {args.blocks} blocks, D={args.dim}, world 2 (fake)"
          f"{', body checkpointed' if args.recompute else ''}\n\n"
          "| graph | fsdp ops, by graph module | outputs (shapes) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['graph']} | {r['fsdp_ops']} | {r['outputs']} |")
    saves = any(tuple(s) == gathered for s in rows[0]["outputs"])
    print(f"\nforward saves every block's gathered weight {gathered} for backward: {'yes' if saves else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
