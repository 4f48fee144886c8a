"""Llama-3-8B shapes on one GPU: fsdp-compile beside FSDP2 + ``torch.compile``, each variant in its own process.

Every variant builds the model on the meta device, shards it (blocks, then the root), ``to_empty`` it on
the device and runs the same init (torchtitan's: truncated normals, ones for norms, RoPE tables
recomputed), so nothing ever holds the unsharded model; bf16 compute over fp32 shards, fp32 gradient
reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), fused AdamW, world size 1 with
the collectives kept (``make_backend(elide_single_rank=False)``; FSDP2's own at world 1). ``compile`` is
the bound at world size 1: the unsharded fp32 model under ``torch.autocast(bfloat16)`` and plain
``torch.compile``, no collectives.

**Each variant runs in a fresh process** (``--child``), so none is measured on top of what another left
allocated; with ``--repeats`` the processes alternate (A B, B A, ...). Per variant and process:

* *cold s*: the first step (compile included; Inductor's caches are off unless
  ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=0``);
* *step ms*: the median of ``--steps`` timed steps after ``--warmup`` untimed ones;
* *whole-run peak*: ``max_memory_allocated`` over the process's whole life (build, init, compile, every step);
* *resident*: what is allocated between steps (parameters and optimizer state; no gradients after
  ``zero_grad(set_to_none=True)``); *steady transient*: the timed steps' peak minus that resident;
* *left behind*: bytes a timed step left allocated (``memory_allocated`` after the steps minus before);
  should be 0;
* with ``--snapshot``, the allocations alive at one steady step's peak (a CUDA memory snapshot), grouped by
  the source line that made them.

MFU = tokens/s x FLOPs per token / peak (989 TFLOP/s, bf16 H100/H200 dense), FLOPs per token = 6 N +
12 L H d T (torchtitan's count: N without the input embedding, the output head included).
A variant that runs out of device memory in its own process is reported as such.

GPU:   python -m benchmarks.llama8b --tokens 4096 8192 --out llama8b.json
CPU:   python -m benchmarks.llama8b --device cpu --tiny            (a smoke test: tiny shapes, no Inductor)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Mp
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from benchmarks.world1_costs import live_at_peak
from fsdp_compile import FsdpGroups, MixedPrecisionPolicy, fully_shard, make_backend
from fsdp_compile.examples.models import PRESETS, ModelConfig, Transformer, loss_fn

VARIANTS = ("fsdp-compile", "fsdp2-compile", "compile")
PEAK_TFLOPS = 989.0  # bf16 dense, H100/H200 SXM
TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64)
GIB = 2**30


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


def build(variant: str, cfg: ModelConfig, device: torch.device,
          tiny: bool) -> tuple[nn.Module, Callable[[Tensor, Tensor], Tensor], torch.optim.Optimizer]:
    """The variant's model (built on meta, sharded, ``to_empty``, initialised), a loss function of a batch, AdamW."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    autocast: Callable[[], Any] = contextlib.nullcontext
    if variant == "fsdp-compile":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        groups = FsdpGroups.create()
        for block in model.layers:
            fully_shard(block, groups=groups, mp_policy=mp)
        fully_shard(model, groups=groups, mp_policy=mp)
        backend: Any = make_backend(elide_single_rank=False, inductor=not tiny)
    elif variant == "fsdp2-compile":
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp2 = Fsdp2Mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fsdp2_fully_shard(block, mesh=mesh, mp_policy=mp2)
        fsdp2_fully_shard(model, mesh=mesh, mp_policy=mp2)
        backend = "aot_eager" if tiny else "inductor"
    else:  # plain torch.compile of the unsharded model, bf16 autocast over fp32 parameters
        backend = "aot_eager" if tiny else "inductor"
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    forward = torch.compile(model, backend=backend)

    def loss_of(inputs: Tensor, labels: Tensor) -> Tensor:
        with autocast():
            return loss_fn(forward(inputs), labels)

    return model, loss_of, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: cold step, warm-up, timed steps, memory; the result as a dict."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = model_config(args.layers, args.tiny, args.tokens[0])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.tokens[0] + 1), generator=gen).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    peak = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    out: dict[str, Any] = {"variant": args.variant, "tokens": args.tokens[0], "oom": False}
    try:
        _, loss_of, opt = build(args.variant, cfg, device, args.tiny)

        def step() -> float:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss_of(*batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        out["cold_s"] = step()
        for _ in range(args.warmup):
            step()
        resident = allocated()
        whole_run = peak()  # reset_peak_memory_stats below forgets it
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out["step_ms"] = [step() * 1e3 for _ in range(args.steps)]
        out["left_behind_bytes"] = allocated() - resident
        out["resident_gib"] = resident / GIB
        out["steady_transient_gib"] = (peak() - resident) / GIB
        if args.snapshot and cuda:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=400_000)
            try:
                step()
                snap = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            out["live_at_peak"] = live_at_peak(snap, allocated())
        out["whole_run_peak_gib"] = max(whole_run, peak()) / GIB if cuda else None
    except torch.OutOfMemoryError as e:  # alone in its process: this variant does not fit
        out.update(oom=True, error=str(e).splitlines()[0][:300], whole_run_peak_gib=peak() / GIB if cuda else None)
    return out


def _child_cmd(args: argparse.Namespace, variant: str, tokens: int, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.llama8b", "--child", "--variant", variant, "--tokens", str(tokens),
           "--layers", str(args.layers), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device, "--out", out]
    return cmd + (["--tiny"] if args.tiny else []) + (["--snapshot"] if args.snapshot else [])


def run_parent(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (tokens, variant) in fresh processes, alternating the variants' order between repeats."""
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # every compile cold
    runs = []
    for tokens in args.tokens:
        for r in range(args.repeats):
            order = list(args.variants) if r % 2 == 0 else list(reversed(args.variants))
            for variant in order:
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    proc = subprocess.run(_child_cmd(args, variant, tokens, f.name), env=env, text=True,
                                          capture_output=True, timeout=args.timeout_s)
                    if proc.returncode != 0:
                        run = {"variant": variant, "tokens": tokens, "failed": proc.stderr[-2000:]}
                    else:
                        run = json.loads(open(f.name).read())
                run["repeat"] = r
                _derive(run, args)
                runs.append(run)
                print(_row(run), flush=True)
    return runs


def _derive(run: dict[str, Any], args: argparse.Namespace) -> None:
    """The median step and MFU of a measured run."""
    if run.get("step_ms"):
        per_token, _ = flops_per_token(model_config(args.layers, args.tiny, run["tokens"]), run["tokens"])
        run["median_ms"] = statistics.median(run["step_ms"])
        run["mfu"] = run["tokens"] / (run["median_ms"] / 1e3) * per_token / (args.peak_tflops * 1e12) \
            if args.device == "cuda" else None


def _row(run: dict[str, Any]) -> str:
    head = f"{run['tokens']:>6} {run['variant']:14}"
    if run.get("failed"):
        return f"{head} failed: {run['failed'].strip().splitlines()[-1][:200]}"
    if run["oom"]:
        return f"{head} out of device memory (alone in its process), whole-run peak {run['whole_run_peak_gib']:.1f} GiB"
    mfu = f"{100 * run['mfu']:.1f}%" if run.get("mfu") is not None else "-"
    gib = lambda k: f"{run[k]:.1f}" if run.get(k) is not None else "-"  # noqa: E731
    return (f"{head} {run['median_ms']:9.1f} {mfu:>6} {gib('whole_run_peak_gib'):>8} {gib('steady_transient_gib'):>9}"
            f" {gib('resident_gib'):>8} {run['cold_s']:7.1f} {run['left_behind_bytes']:>6}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama8b", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--layers", type=int, default=16, help="blocks of Llama-3-8B (32 in the full model; default 16)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per step (one sequence each)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS[:2]), choices=VARIANTS)
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per variant, alternating the order")
    p.add_argument("--steps", type=int, default=10, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the cold one")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes and no Inductor: a CPU smoke test of the plumbing")
    p.add_argument("--snapshot", action="store_true", help="name what is alive at one steady step's peak")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="peak bf16 TFLOP/s for MFU (default 989)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="seconds before a variant's process is killed")
    p.add_argument("--out", default="llama8b.json", help="where the JSON goes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens = [min(t, TINY.max_seq_len) for t in args.tokens]
        args.layers = min(args.layers, TINY.n_layers)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_child(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
        return 0
    print(f"{'tokens':>6} {'variant':14} {'step ms':>9} {'MFU':>6} {'peak GiB':>8} {'transient':>9} "
          f"{'resident':>8} {'cold s':>7} {'left':>6}")
    runs = run_parent(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "variant")}, "device": device,
              "torch": torch.__version__, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{device}, {args.layers} blocks, each variant in a fresh process; medians of {args.steps} steps")
    print(f"{'tokens':>6} {'variant':14} {'step ms':>9} {'MFU':>6} {'peak GiB':>8} {'transient':>9} "
          f"{'resident':>8} {'cold s':>7} {'left':>6}")
    for run in runs:
        print(_row(run))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
