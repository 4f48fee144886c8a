"""Does a model whose blocks run as one loop compile flat in depth? A probe for issue 11's design.

fsdp-compile outlines repeated blocks (each block one call of a body compiled once), but the whole-model
graph still holds every call and its glue, which Dynamo, AOTAutograd, our passes and Inductor each
handle block by block: its cold compile still grows with depth. A graph with no per-block nodes at
all would be one loop over the blocks, with each block's weights a slice of stacked tensors. This
probe measures what torch gives such a loop today, with no sharding: plain ``torch.compile`` of one
Llama-style stack written two ways,

    loop   a Python loop over the blocks (Dynamo unrolls it: what a model's ``for layer in layers`` gives)
    scan   one ``torch._higher_order_ops.scan`` over the stacked weights (the body traced once)

each in a fresh process with Inductor's caches off: the cold compile (first forward+backward), then
the median forward+backward step, and the loss and gradient norm, which must agree between the two.
With ``--ranks N`` (CPU, N gloo ranks) each rank keeps its rows of every block's weights and the block
gathers them (``all_gather_tensor_autograd``, whose backward reduce-scatters the gradient to the rows):
the collectives sit inside the scan's body, as a sharded loop's would. With ``--gather-world1`` (GPU)
the blocks gather the same way on NCCL of one rank (the collectives a larger world compiles).

``python -m benchmarks.scan_probe --layers 4 32`` (CPU, D=32; ``--ranks 2``: sharded) or ``--device cuda``
(GPU, D=1024, bf16).

NOTE [lean C++ for a GPU loop]: Inductor lowers a scan to a ``while_loop`` whose counter lives on the CPU
(``decompose_scan_to_while_loop`` in torch's post-grad passes: the loop condition is read on the host),
so a GPU model's scan also compiles a few scalar C++ kernels. Before its first C++ build in a process,
Inductor probes which vector instructions the CPU has, each probe a compile and a fresh Python that
imports torch, and builds a precompiled header, then compiles the kernels: on the H200 (torch 2.11) the
4-block scan took 58-75 s with all of it and 12-13 s with none (README, Compile time, has the table).
Scalar counters need neither the probes nor the header. ``--lean-cpp`` (GPU only) sets
``cpp.vec_isa_ok = False`` (no probes; C++ kernels without vector instructions) and ``--no-pch`` also
``cpp_cache_precompile_headers = False``, to measure what the scan costs without that start-up.
``--host-counters`` goes further: after torch's decomposition it swaps the counter's three scalar ops
(start at zero, compare with the length, add one) for ops that Inductor calls as they are instead of
generating C++, so a GPU model's scan compiles no C++ at all. fsdp-compile's backend now does the same
for a stack's loop (NOTE [loop counters off the C++ path] in ``fsdp_compile/_compat_loops.py``); the flag
applies that to plain ``torch.compile``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = ("loop", "scan")
_ROLES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "attn_norm", "ffn_norm")  # the block's arguments, in order


def _stack(layers: int, dim: int, heads: int, vocab: int, mode: str, ranks: int = 1,
           gather_always: bool = False) -> Any:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from torch import nn
    from torch._higher_order_ops.scan import scan

    def gather(w: Any) -> Any:
        """A block's weight from every rank's rows (its gradient is reduce-scattered back to them)."""
        if ranks == 1 and not gather_always:
            return w
        return funcol.all_gather_tensor_autograd(w, gather_dim=0, group=dist.group.WORLD)

    def block(h: Any, wq: Any, wk: Any, wv: Any, wo: Any, w1: Any, w2: Any, w3: Any, n1: Any, n2: Any) -> Any:
        b, t, _ = h.shape
        x = F.rms_norm(h, (dim,), n1)
        q, k, v = ((x @ w.t()).view(b, t, heads, dim // heads).transpose(1, 2) for w in (wq, wk, wv))
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, dim) @ wo.t()
        x = F.rms_norm(h, (dim,), n2)
        return h + (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shapes = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim), (4 * dim, dim)]
            # plain attributes, not a ParameterList: torch 2.11's Dynamo cannot unpack one
            for name, shape in zip(_ROLES, shapes):
                setattr(self, name, nn.Parameter(torch.randn(layers, *shape) * dim**-0.5))
            for name in _ROLES[len(shapes):]:
                setattr(self, name, nn.Parameter(torch.ones(layers, dim)))
            self.embedding = nn.Parameter(torch.randn(vocab, dim) * 0.02)
            if ranks > 1:  # keep this rank's rows of each block's weights (dim 1 of the stacks)
                for name in _ROLES:
                    full = getattr(self, name).detach()
                    setattr(self, name, nn.Parameter(full.chunk(ranks, dim=1)[dist.get_rank()].clone()))

        def forward(self, tokens: Any) -> Any:
            h = self.embedding[tokens]
            stacked = [getattr(self, name) for name in _ROLES]
            if mode == "scan":
                h, _ = scan(lambda carry, ws: (block(carry, *map(gather, ws)), carry.new_zeros(())), h, stacked)
            else:
                for i in range(layers):
                    h = block(h, *(gather(w[i]) for w in stacked))
            return F.rms_norm(h, (dim,)) @ self.embedding.t()

    return Stack()


def host_counters() -> Any:
    """``--host-counters`` (module docstring): fsdp-compile's own swap of the loop counter
    (``host_loop_counters``, NOTE [loop counters off the C++ path] in ``fsdp_compile/_compat_loops.py``)."""
    from fsdp_compile._compat_loops import host_loop_counters

    return host_loop_counters()


def child(args: argparse.Namespace) -> dict[str, Any]:
    with host_counters() if args.host_counters else contextlib.nullcontext():
        return _child(args)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    if args.gather_world1:  # NCCL of one rank: the collectives of world N, each gathering one rank's rows
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)
        try:
            return _measure(args)
        finally:
            dist.destroy_process_group()
    if args.ranks == 1:
        return _measure(args)
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        mp.spawn(_rank, args=(args, str(out)), nprocs=args.ranks)
        return json.loads(out.read_text())


def _rank(rank: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29650 + args.layers[0]))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        result = _measure(args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = torch.device(args.device)
    if args.lean_cpp:  # NOTE [lean C++ for a GPU loop]
        torch._inductor.config.cpp.vec_isa_ok = False
    if args.no_pch:
        torch._inductor.config.cpp_cache_precompile_headers = False
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = _stack(args.layers[0], args.dim, args.heads, args.vocab, args.mode, args.ranks,
                   args.gather_world1).to(device=device, dtype=dtype)
    tokens = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    compiled = torch.compile(model, fullgraph=True)
    torch.compile(lambda x: x + 1)(torch.zeros(2, device=device))  # Inductor's one-time set-up, not counted

    def step() -> Any:
        loss = compiled(tokens[:, :-1]).float().logsumexp(-1).mean()
        loss.backward()
        return loss

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    from benchmarks.compile_stages import stages_from
    from fsdp_compile._compat import compile_time_metrics

    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    if device.type != "cuda":  # torch's timing table on the same clock (NOTE [CPU clock] in compile_stages.py)
        time.time_ns = time.thread_time_ns
    before = compile_time_metrics()
    profile = None
    if args.profile_dir:  # where the first step's seconds go, function by function
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = clock()
    loss = step()
    sync()
    compile_s = clock() - t0
    if profile is not None:
        profile.disable()
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(args.profile_dir) / f"{args.mode}-L{args.layers[0]}.prof")
    metrics = {k: v - before.get(k, 0.0) for k, v in compile_time_metrics().items() if v - before.get(k, 0.0) > 0}
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])).item()
    reference_err = _reference_error(args, model, tokens) if args.ranks > 1 else None
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"mode": args.mode, "layers": args.layers[0], "compile_s": compile_s,
            "stages": stages_from(metrics, compile_s), "metrics": metrics, "loss": loss.item(),
            "grad_norm": grad_norm, "reference_err": reference_err,
            "step_ms": statistics.median(times) if times else None}


def _reference_error(args: argparse.Namespace, model: Any, tokens: Any) -> float:
    """Largest difference between this rank's block-weight gradients and its rows of an unsharded,
    uncompiled copy's (every rank ran the same tokens, and the reduce-scatter sums: ``ranks`` times)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    reference = _stack(args.layers[0], args.dim, args.heads, args.vocab, "loop")
    reference(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
    rank, err = dist.get_rank(), 0.0
    for name in _ROLES:
        expected = getattr(reference, name).grad.chunk(args.ranks, dim=1)[rank] * args.ranks
        err = max(err, (getattr(model, name).grad - expected).abs().max().item())
    return err


def _err(run: dict[str, Any]) -> str:
    return "-" if run.get("reference_err") is None else f"{run['reference_err']:.1e}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scan_probe", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dim", type=int, default=None, help="default: 32 on CPU, 1024 on GPU")
    p.add_argument("--heads", type=int, default=None, help="default: 2 on CPU, 16 on GPU")
    p.add_argument("--vocab", type=int, default=None, help="default: 64 on CPU, 32000 on GPU")
    p.add_argument("--seq", type=int, default=None, help="default: 17 on CPU, 1025 on GPU")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ranks", type=int, default=1,
                   help="CPU: gloo ranks; each keeps its rows of every block's weights and gathers them in the block")
    p.add_argument("--timeout-s", type=int, default=900)
    p.add_argument("--json", default=None)
    p.add_argument("--profile-dir", default=None, help="cProfile each child's first step into this folder")
    p.add_argument("--gather-world1", action="store_true",
                   help="GPU: NCCL of one rank; each block gathers its weights and reduce-scatters their gradients")
    p.add_argument("--lean-cpp", action="store_true",
                   help="GPU: no vector-ISA probes for the loop counter's C++ kernels (NOTE [lean C++ for a GPU loop])")
    p.add_argument("--host-counters", action="store_true",
                   help="the loop counter's ops called as they are, not compiled to C++ (experiment; module docstring)")
    p.add_argument("--no-pch", action="store_true", help="GPU: no precompiled header for those kernels either")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if args.gather_world1 and (not gpu or args.ranks != 1):
        p.error("--gather-world1 is for --device cuda at --ranks 1")
    if (args.lean_cpp or args.no_pch) and not gpu:
        p.error("--lean-cpp and --no-pch are for --device cuda: on the CPU the model's own kernels are C++ "
                "and need the vector instructions and the header")
    for name, cpu_default, gpu_default in (("dim", 32, 1024), ("heads", 2, 16), ("vocab", 64, 32000),
                                           ("seq", 17, 1025)):
        if getattr(args, name) is None:
            setattr(args, name, gpu_default if gpu else cpu_default)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    runs = []
    for layers in args.layers:
        for mode in MODES:
            cmd = [sys.executable, "-m", "benchmarks.scan_probe", "--child", "--mode", mode, "--layers", str(layers),
                   "--device", args.device, "--dim", str(args.dim), "--heads", str(args.heads),
                   "--vocab", str(args.vocab), "--seq", str(args.seq), "--steps", str(args.steps),
                   "--ranks", str(args.ranks), *(["--profile-dir", args.profile_dir] if args.profile_dir else []),
                   *(["--lean-cpp"] if args.lean_cpp else []), *(["--no-pch"] if args.no_pch else []),
                   *(["--gather-world1"] if args.gather_world1 else []),
                   *(["--host-counters"] if args.host_counters else [])]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
            if out.returncode != 0:
                raise RuntimeError(f"{mode} L{layers} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[{mode} L{layers}] {runs[-1]}", flush=True)
    by = {(r["mode"], r["layers"]): r for r in runs}
    base = min(args.layers)
    lines = ["| layers | loop compile s | scan compile s | loop vs fewest layers | scan vs fewest layers "
             "| loop step ms | scan step ms | same loss and grads | max grad error vs unsharded (loop, scan) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for layers in args.layers:
        loop, scn = by[("loop", layers)], by[("scan", layers)]
        same = (abs(loop["loss"] - scn["loss"]) <= 1e-3 * max(1.0, abs(loop["loss"]))
                and abs(loop["grad_norm"] - scn["grad_norm"]) <= 1e-2 * max(1.0, loop["grad_norm"]))
        lines.append(f"| {layers} | {loop['compile_s']:.1f} | {scn['compile_s']:.1f} "
                     f"| {loop['compile_s'] / by[('loop', base)]['compile_s']:.2f} "
                     f"| {scn['compile_s'] / by[('scan', base)]['compile_s']:.2f} "
                     f"| {loop['step_ms']:.2f} | {scn['step_ms']:.2f} | {'yes' if same else 'NO'} "
                     f"| {_err(loop)}, {_err(scn)} |")
    import torch

    meta = {"date": datetime.date.today().isoformat(), "device": args.device, "torch": torch.__version__,
            "ranks": args.ranks, "lean_cpp": args.lean_cpp, "no_pch": args.no_pch,
            "gather_world1": args.gather_world1, "host_counters": args.host_counters,
            "clock": "wall" if args.device == "cuda" else "cpu",
            "model": {k: getattr(args, k) for k in ("dim", "heads", "vocab", "seq")},
            "command": " ".join(["python", "-m", "benchmarks.scan_probe",
                                 *(argv if argv is not None else sys.argv[1:])])}
    suffix = f"-gather-w{args.ranks}" if args.ranks > 1 else ""
    path = Path(args.json) if args.json else RESULTS_DIR / f"scan_probe-{args.device}{suffix}.json"
    path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    stages = list(runs[0]["stages"])
    stage_lines = ["| mode | layers | " + " | ".join(stages) + " |", "|---|---|" + "---|" * len(stages)]
    stage_lines += [f"| {r['mode']} | {r['layers']} | " + " | ".join(f"{v:.1f}" for v in r["stages"].values()) + " |"
                    for r in runs]
    print(f"{meta['command']}\n{meta['date']}, {args.device}, torch {meta['torch']}, {meta['clock']} seconds\n\n"
          + "\n".join(lines) + "\n\nfirst step by stage, seconds:\n\n" + "\n".join(stage_lines)
          + f"\n\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
