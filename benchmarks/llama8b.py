"""Llama-3-8B shapes on one GPU: fsdp-compile beside FSDP2 + ``torch.compile``, in one run.

Both variants build the model on the meta device, shard it (blocks, then the root), ``to_empty`` it on
the device and run the same init (torchtitan's: truncated normals, ones for norms, RoPE tables
recomputed), so nothing ever holds the unsharded model; bf16 compute over fp32 shards, fp32 gradient
reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), fused AdamW, world size 1 with
the collectives kept (``make_backend(elide_single_rank=False)``; FSDP2's own at world 1). Its first
step is timed as the *cold compile* (Inductor's caches are off unless ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=0``),
then ``--rounds`` rounds of ``--steps`` timed steps per variant; the variants alternate within each round
when both fit in memory together, else each is built, measured and freed in turn (``schedule`` in the
JSON says which: at 16 blocks each variant's fp32 params, grads and AdamW state are ~73 GB).

Reported per variant: median step, tokens/s, MFU = tokens/s x FLOPs per token / peak (989 TFLOP/s, bf16
H100/H200 dense), FLOPs per token = 6 N + 12 L H d T (torchtitan's count: N = the parameters *without
the input embedding*, the output head included; attention over the full T x T, not halved for the causal
mask), peak memory (``torch.cuda.max_memory_allocated`` over the timed steps, after a reset).

GPU:   python -m benchmarks.llama8b --out llama8b.json            (one process, a 1-rank NCCL group)
       torchrun --nproc-per-node=1 -m benchmarks.llama8b --out llama8b.json
CPU:   python -m benchmarks.llama8b --device cpu --tiny            (a smoke test: tiny shapes, no Inductor)
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before torch is imported, so that every compile is cold
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Mp
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from benchmarks.variants import own_forward, raise_recompile_limit
from fsdp_compile import FsdpGroups, MixedPrecisionPolicy, fully_shard, make_backend
from fsdp_compile.examples.models import PRESETS, ModelConfig, Transformer, loss_fn

VARIANTS = ("fsdp-compile", "fsdp2-compile")
PEAK_TFLOPS = 989.0  # bf16 dense, H100/H200 SXM
TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64)


@dataclass
class Result:
    variant: str
    cold_s: float | None
    step_ms: list[float]
    peak_gib: float | None
    median_ms: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float | None = None
    oom: bool = False  # ran out of device memory: no step measured


def model_config(layers: int, tiny: bool, tokens: int) -> ModelConfig:
    base = TINY if tiny else PRESETS["llama3-8b"]
    return base.with_(n_layers=layers, max_seq_len=tokens)


def flops_per_token(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """(6 N + 12 L H d T, N): N without the input embedding (torchtitan's count)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    n = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    head_dim = cfg.dim // cfg.n_heads
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * head_dim * tokens, n


def build(variant: str, cfg: ModelConfig, device: torch.device, groups: FsdpGroups,
          tiny: bool) -> tuple[nn.Module, Callable[..., Tensor], torch.optim.Optimizer]:
    """The variant's sharded model (built on meta, ``to_empty``, initialised), its compiled forward, AdamW."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    own_forward(model)  # each variant its own code object (DESIGN: Dynamo's per-code state)
    if variant == "fsdp-compile":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, groups=groups, mp_policy=mp)
        fully_shard(model, groups=groups, mp_policy=mp)
        backend: Any = make_backend(elide_single_rank=False, inductor=not tiny)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp2 = Fsdp2Mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fsdp2_fully_shard(block, mesh=mesh, mp_policy=mp2)
        fsdp2_fully_shard(model, mesh=mesh, mp_policy=mp2)
        backend = "aot_eager" if tiny else "inductor"
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    forward = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, forward, opt


def step(forward: Callable[..., Tensor], opt: torch.optim.Optimizer, batch: tuple[Tensor, Tensor], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss_fn(forward(batch[0]), batch[1]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _timed(run: dict[str, Any], batch: tuple[Tensor, Tensor], steps: int, cuda: bool) -> tuple[list[float], float | None]:
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [step(run["forward"], run["opt"], batch, cuda) * 1e3 for _ in range(steps)]
    return times, torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def measure(args: argparse.Namespace, device: torch.device, groups: FsdpGroups) -> tuple[list[Result], str]:
    cfg = model_config(args.layers, args.tiny, args.tokens)
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.tokens + 1), generator=gen).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    with torch.device("meta"):
        state_bytes = 16 * sum(p.numel() for p in Transformer(cfg).parameters())  # fp32 param, grad, 2 AdamW moments
    fits = not cuda or len(args.variants) * state_bytes < 0.8 * torch.cuda.get_device_properties(device).total_memory
    schedule = "alternate" if fits else "sequential"
    results: dict[str, Result] = {}
    runs: dict[str, dict[str, Any]] = {}

    def start(variant: str) -> None:
        try:
            model, forward, opt = build(variant, cfg, device, groups, args.tiny)
            run = {"model": model, "forward": forward, "opt": opt}
            results[variant] = Result(variant, cold_s=step(forward, opt, batch, cuda), step_ms=[], peak_gib=None)
            for _ in range(args.warmup):
                step(forward, opt, batch, cuda)
            runs[variant] = run
        except torch.OutOfMemoryError:  # reported as such; the other variant still runs
            results[variant] = Result(variant, cold_s=None, step_ms=[], peak_gib=None, oom=True)
        if results[variant].oom:  # (outside the handler, so that its frames are gone)
            gc.collect()
            torch.cuda.empty_cache()

    def timed_round(variant: str) -> None:
        if variant not in runs:
            return
        times, peak = _timed(runs[variant], batch, args.steps, cuda)
        r = results[variant]
        r.step_ms += times
        r.peak_gib = peak if r.peak_gib is None or peak is None else max(r.peak_gib, peak)

    if schedule == "alternate":
        for variant in args.variants:
            start(variant)
        for _ in range(args.rounds):
            for variant in args.variants:
                timed_round(variant)
    else:
        for variant in args.variants:
            start(variant)
            for _ in range(args.rounds):
                timed_round(variant)
            runs.pop(variant, None)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    per_token, _ = flops_per_token(cfg, args.tokens)
    for r in results.values():
        if r.oom:
            continue
        r.median_ms = statistics.median(r.step_ms)
        r.tokens_per_s = args.tokens * dist.get_world_size() / (r.median_ms / 1e3)
        r.mfu = r.tokens_per_s * per_token / (args.peak_tflops * 1e12) / dist.get_world_size() if cuda else None
    return list(results.values()), schedule


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama8b", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--layers", type=int, default=16, help="blocks of Llama-3-8B (32 in the full model; default 16)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (one sequence; default 4096)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the cold one")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes and no Inductor: a CPU smoke test of the plumbing")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="peak bf16 TFLOP/s for MFU (default 989)")
    p.add_argument("--out", default="llama8b.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens = min(args.tokens, TINY.max_seq_len)
        args.layers = min(args.layers, TINY.n_layers)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend)
    else:  # one process: a group of one rank
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit("benchmarks.llama8b measures world size 1 (one GPU); run it with --nproc-per-node=1.")
    raise_recompile_limit(len(args.variants))
    groups = FsdpGroups.create()
    try:
        results, schedule = measure(args, device, groups)
    finally:
        groups.destroy()
    per_token, n = flops_per_token(model_config(args.layers, args.tiny, args.tokens), args.tokens)
    report = {"args": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "schedule": schedule, "flops_per_token": per_token,
              "params_without_input_embedding": n, "variants": [asdict(r) for r in results]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{report['device']}, {args.layers} blocks, {args.tokens} tokens/step, N = {n:,} without the input "
          f"embedding, {per_token:.3g} FLOP/token, schedule: {schedule}")
    print(f"{'variant':15} {'step ms':>9} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'cold s':>7}")
    for r in results:
        if r.oom:
            print(f"{r.variant:15} out of device memory")
            continue
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "-"
        peak = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "-"
        print(f"{r.variant:15} {r.median_ms:9.1f} {r.tokens_per_s:10.0f} {mfu:>7} {peak:>9} {r.cold_s:7.1f}")
    print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
