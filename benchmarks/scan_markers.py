"""Do fsdp-compile's markers survive a scan, and what does the scan's backward keep? A probe for the
scan-based design of README, Compile time.

Each of ``--blocks`` iterations of one ``torch._higher_order_ops.scan`` reads its block's rows of a
stacked weight through ``fsdp::unshard`` (``--ranks`` gloo ranks, each holding its rows; the markers run
their own eager implementation, which gathers and reduce-scatters for real) and applies it. The first
carry requires grad: on torch 2.11 a scan whose first carry does not drops the carry's gradient, so every
block but the last gets a wrong weight gradient (pytorch/pytorch#184528, fixed in a later release; 0.72
and 1.03 off on 3 blocks here, eager and compiled).

Printed: which ``fsdp::*`` ops the loop body of each graph AOTAutograd hands to a compiler holds (the
marker's own backward is ``fsdp::reduce_grad``), which outputs the forward returns for the backward, and
the largest difference between each rank's weight gradient and its rows of an unsharded, uncompiled
loop's. An output of shape ``(blocks, D, D)`` is every block's *gathered* weight, saved from forward to
backward: the scan's own partition keeps what the body gathered instead of gathering it again, so
resharding after forward would not hold in a scan as it does in our whole-model graph (NOTE [reshard by
recompute] in ``fsdp_compile/partition.py``, which runs only on the outer joint graph).
``--tag-unshards`` tags the body's unshards (and the copies of views of them) must-recompute before torch
partitions the body, as ``_tag_reshard`` does to our outer joint graph: then the forward saves only the
shards and the backward body gathers again.

``python -m benchmarks.scan_markers [--blocks 3 --dim 8 --ranks 2 --recompute --tag-unshards]``
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from functorch.compile import aot_module_simplified, make_boxed_func
from torch import fx
from torch._higher_order_ops.scan import scan

from fsdp_compile import FsdpGroups
from fsdp_compile.launch import run_ranks


def _fsdp_ops(gm: fx.GraphModule) -> dict[str, list[str]]:
    """``fsdp::*`` ops by the graph module (the graph itself, its loop bodies) that holds them."""
    out: dict[str, list[str]] = {}
    for name, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            ops = [str(n.target) for n in module.graph.nodes if str(n.target).startswith("fsdp.")]
            if ops:
                out[name or "(graph)"] = ops
    return out


def tagged_body_unshards() -> Any:
    """``--tag-unshards``: while open, every loop body's joint graph has its ``fsdp::unshard`` nodes (and
    the copies of views of them) tagged must-recompute before torch partitions it, which is what the
    backend now does for a stack's loop (``partition.tag_loop_body``, NOTE [stacked blocks])."""
    from fsdp_compile._compat_loops import tagging_loop_bodies
    from fsdp_compile.partition import tag_loop_body

    return tagging_loop_bodies(tag_loop_body)


def probe(blocks: int, dim: int, recompute: bool = False, prefetch: bool = False) -> dict[str, Any]:
    """One compiled forward and backward of the scan on the default process group (every rank the same
    input and the same full weights, each rank its rows): the forward's and backward's graphs as
    :func:`_fsdp_ops` and their outputs' shapes, and the largest difference between this rank's
    weight gradient and its rows of an unsharded, uncompiled loop's (``reduce_grad`` averages over the
    ranks, which all ran the same input). With ``recompute`` the body runs under activation
    checkpointing (``torch.utils.checkpoint``). With ``prefetch`` the gathered weight is a loop carry:
    iteration i gathers block i+1's weight before it runs block i on the weight it was handed (the
    first is gathered before the loop; the last iteration's gather is of block 0 again, unused)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(blocks, dim, dim) / dim**0.5
    h0 = torch.randn(2, dim)
    n = dim // world
    rows = torch.nn.Parameter(full[:, rank * n:(rank + 1) * n].clone())  # this rank's rows of each weight
    groups = FsdpGroups.create()
    ag, rs = groups.all_gather.group_name, groups.reduce_scatter.group_name
    try:
        def body(h: torch.Tensor, xs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            (w,) = xs if isinstance(xs, (list, tuple)) else (xs,)

            def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                w_full = torch.ops.fsdp.unshard(w, [dim, dim], world, 0, "w", ag, rs, "", 0, True, None, None, None)
                return torch.tanh(h @ w_full.t())

            if recompute:
                return torch.utils.checkpoint.checkpoint(block, h, w, use_reentrant=False), h.new_zeros(())
            return block(h, w), h.new_zeros(())

        def unshard(w: torch.Tensor) -> torch.Tensor:
            return torch.ops.fsdp.unshard(w, [dim, dim], world, 0, "w", ag, rs, "", 0, True, None, None, None)

        def prefetching_body(carry: Any, xs: Any) -> tuple[Any, torch.Tensor]:
            h, w_full = carry
            (w_next,) = xs if isinstance(xs, (list, tuple)) else (xs,)
            gathered_next = unshard(w_next)  # first: in a lowered graph it would overlap block i
            return (torch.tanh(h @ w_full.t()), gathered_next), h.new_zeros(())

        def run(h: torch.Tensor) -> torch.Tensor:
            if prefetch:
                (out, _), _ = scan(prefetching_body, (h, unshard(rows[0])), [torch.cat([rows[1:], rows[:1]])])
            else:
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the markers' eager implementation warns that it is one
            torch.compile(run, backend=backend, fullgraph=True)(h0.clone().requires_grad_()).backward()
    finally:
        groups.destroy()
    reference = full.clone().requires_grad_()
    h = h0.clone().requires_grad_()
    for i in range(blocks):
        h = torch.tanh(h @ reference[i].t())
    h.sum().backward()
    assert rows.grad is not None and reference.grad is not None
    error = (rows.grad - reference.grad[:, rank * n:(rank + 1) * n]).abs().max().item()
    graphs = []
    for kind, gm in zip(("forward", "backward"), seen):
        (outputs,) = gm.graph.find_nodes(op="output")[0].args
        shapes = [tuple(o.meta["val"].shape) for o in outputs if isinstance(o, fx.Node)
                  and isinstance(o.meta.get("val"), torch.Tensor)]
        graphs.append({"graph": kind, "fsdp_ops": _fsdp_ops(gm), "outputs": shapes})
    return {"graphs": graphs, "grad_error": error}


def _rank(rank: int, world_size: int, blocks: int, dim: int, recompute: bool, tag_unshards: bool,
          prefetch: bool) -> dict[str, Any]:
    with tagged_body_unshards() if tag_unshards else contextlib.nullcontext():
        return probe(blocks, dim, recompute, prefetch)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`probe` on ``args.ranks`` gloo ranks; rank 0's result."""
    return run_ranks(_rank, args.ranks, args.blocks, args.dim, args.recompute, args.tag_unshards, args.prefetch,
                     timeout=300.0)[0]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scan_markers", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (the weights' rows are split over them)")
    p.add_argument("--recompute", action="store_true", help="the body under activation checkpointing")
    p.add_argument("--prefetch", action="store_true", help="the gathered weight carried: block i+1 gathered in iteration i")
    p.add_argument("--tag-unshards", action="store_true",
                   help="tag the body's unshards must-recompute before torch partitions it (experiment)")
    args = p.parse_args(argv)
    if args.dim % args.ranks:
        p.error(f"--dim {args.dim} must split into --ranks {args.ranks} equal row blocks")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    gathered = [args.blocks, args.dim, args.dim]
    print(f"torch {torch.__version__}, {args.blocks} blocks, D={args.dim}, {args.ranks} gloo ranks"
          f"{', body checkpointed' if args.recompute else ''}{', prefetch carried' if args.prefetch else ''}"
          f"{', body unshards tagged must-recompute' if args.tag_unshards else ''}\n\n"
          "| graph | fsdp ops, by graph module | outputs (shapes) |\n|---|---|---|")
    for r in result["graphs"]:
        print(f"| {r['graph']} | {r['fsdp_ops']} | {[tuple(s) for s in r['outputs']]} |")
    saves = any(list(shape) == gathered for shape in result["graphs"][0]["outputs"])
    print(f"\nforward saves every block's gathered weight {tuple(gathered)} for backward: {'yes' if saves else 'no'}"
          f"\nlargest weight-gradient difference from an unsharded, uncompiled loop: {result['grad_error']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
