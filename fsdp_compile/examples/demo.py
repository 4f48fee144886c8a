"""``python -m fsdp_compile demo``: train a small Llama-style transformer with ``fully_shard`` + ``fsdp_backend``.

On CPU it spawns gloo ranks; with ``--device cuda`` it runs under torchrun. The synthetic data is learnable
(each sequence counts up by its own stride), so the loss visibly falls.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from fsdp_compile.compiler.backend import make_backend
from fsdp_compile.api.groups import FsdpGroups
from fsdp_compile.examples.launch import run_ranks
from fsdp_compile.examples.models import PRESETS, Transformer, loss_fn
from fsdp_compile.api.sharding import MixedPrecisionPolicy, fully_shard, unit_of
from fsdp_compile.api.stack import BlockStack

__all__ = ["DemoArgs", "add_arguments", "main", "train"]


@dataclass(frozen=True)
class DemoArgs:
    preset: str = "demo"
    steps: int = 60
    batch: int = 8  # per rank
    seq: int = 64
    lr: float = 3e-3
    device: str = "cpu"
    ranks: int = 2
    dedicated: str = "reduce_scatter"
    bf16: bool = False
    inductor: bool = True
    stack: bool = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoArgs()
    p.add_argument("--preset", default=d.preset, choices=[k for k in PRESETS if not k.startswith("llama3")],
                   help="model size")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda"],
                   help="cpu: spawn --ranks gloo processes; cuda: run under torchrun, NCCL")
    p.add_argument("--ranks", type=int, default=d.ranks, help="CPU ranks to spawn (cpu only)")
    p.add_argument("--dedicated", default=d.dedicated, choices=["reduce_scatter", "all_gather", "none"])
    p.add_argument("--bf16", action="store_true", help="bf16 params for compute (fp32 shards)")
    p.add_argument("--no-inductor", dest="inductor", action="store_false",
                   help="run the scheduled graphs without Inductor (debugging)")
    p.add_argument("--stack", action="store_true",
                   help="the blocks as one BlockStack: Dynamo traces one block for all (NOTE [stacked blocks])")


def synthetic_batch(gen: torch.Generator, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train(rank: int, world: int, args: DemoArgs) -> list[float]:
    """Train on this rank (process group already initialised); return the mean loss per step."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cfg = PRESETS[args.preset].with_(max_seq_len=max(args.seq, PRESETS[args.preset].max_seq_len))
    groups = FsdpGroups.create(dedicated=args.dedicated)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    if args.stack:
        model.layers = BlockStack(model.layers)  # type: ignore[assignment]
    for block in model.layers:
        fully_shard(block, groups=groups, mp_policy=mp)
    fully_shard(model, groups=groups, mp_policy=mp)
    compiled = torch.compile(model, backend=make_backend(inductor=args.inductor))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234 + rank)
    losses: list[float] = []

    def step() -> None:
        x, y = (t.to(device) for t in synthetic_batch(gen, args.batch, args.seq, cfg.vocab_size))
        loss = loss_fn(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)

    say = print if rank == 0 else (lambda *a, **k: None)
    how = "with Inductor" if args.inductor else "without Inductor"
    if device.type != "cpu":
        expect = "tens of seconds"
    else:
        expect = "half a minute to a minute on 2 CPU cores" if args.inductor else "about ten seconds on 2 CPU cores"
    say(f"step 0 compiles the forward and backward graphs {how} first ({expect}) ...", flush=True)
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    say(f"step   0  loss {losses[0]:.4f}  (compiled and ran in {compile_s:.1f} s)", flush=True)
    bar = tqdm(range(1, args.steps), desc=f"fsdp-compile demo ({world} ranks)", disable=rank != 0, unit="step",
               total=args.steps, initial=1)
    t1 = time.perf_counter()
    for i in bar:
        step()
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if rank == 0 and (i % 10 == 0 or i == args.steps - 1):
            bar.write(f"step {i:3d}  loss {losses[-1]:.4f}")
    bar.close()
    if rank == 0:
        steady = (time.perf_counter() - t1) / max(args.steps - 1, 1)
        full = sum(torch.Size(sp.full_shape).numel() for m in model.modules() if (u := unit_of(m)) for sp in u.params)
        print(f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f}; first step (compile) {compile_s:.1f} s, "
              f"then {steady * 1e3:.0f} ms/step; {sum(p.numel() for p in model.parameters())} local params "
              f"of {full} in all")
    groups.destroy()
    return losses


def main(ns: argparse.Namespace) -> int:
    args = DemoArgs(**{k: getattr(ns, k) for k in DemoArgs.__dataclass_fields__})
    if args.device == "cuda":
        if "RANK" not in os.environ:
            raise SystemExit("--device cuda runs under torchrun: "
                             "torchrun --nproc-per-node=N -m fsdp_compile demo --device cuda")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    run_ranks(train, args.ranks, args, timeout=3600)
    return 0
