"""Measure what the cost model's GPU preset rests on, on one GPU, in about a minute.

    python -m benchmarks.calibration.measure_kernels --out h200_kernels.json
    python -m benchmarks.calibration.measure_kernels --smoke      # a check of this script on a CPU

Writes raw numbers as JSON: copy bandwidth; bf16 matmul time for the shapes a Llama/MLP block runs
(forward ``x @ w.t()``, input grad ``dy @ w``, weight grad ``dy.t() @ x``) at several token counts;
causal attention forward and forward+backward (the default SDPA kernel and flash); one
``torch.optim.AdamW`` step (the default, foreach; and fused) over parameter shards; and fsdp-compile
training steps at world size 1 for shapes the README's tables do not have, to check ``explain``
against. Every time is the median of CUDA-event timings after warm-up, on random data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

BF16 = torch.bfloat16


class Bench:
    """Where to run and how small (``scale`` divides every size, for the CPU smoke test)."""

    def __init__(self, smoke: bool) -> None:
        self.device = "cpu" if smoke else "cuda"
        self.scale = 32 if smoke else 1

    def n(self, size: int) -> int:
        return max(8, size // self.scale)

    def ms(self, fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
        """Median milliseconds of ``fn`` over ``reps`` timings after ``warmup`` calls."""
        for _ in range(warmup):
            fn()
        if self.device != "cuda":
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    def randn(self, *shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=BF16, requires_grad=grad)


def copy_bandwidth(b: Bench) -> dict[str, float]:
    src = b.randn(b.n(1 << 30))  # 2 GiB
    dst = torch.empty_like(src)
    ms = b.ms(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()
    return {"bytes": moved, "ms": ms, "bytes_per_s": moved / (ms * 1e-3)}


LINEARS = [(4096, 4096), (10928, 4096), (4096, 10928), (16384, 4096), (4096, 16384), (32000, 4096),
           (1024, 4096), (14336, 4096), (4096, 14336), (8192, 8192)]
TOKENS = [256, 1024, 2048, 4096, 8192]


def matmuls(b: Bench) -> list[dict[str, Any]]:
    out = []
    for n_out, n_in in LINEARS:
        n_out, n_in = b.n(n_out), b.n(n_in)
        w = b.randn(n_out, n_in)
        for t in map(b.n, TOKENS):
            x, dy = b.randn(t, n_in), b.randn(t, n_out)
            for kind, fn, (m, n, k) in (
                ("fwd", lambda: torch.mm(x, w.t()), (t, n_out, n_in)),
                ("dgrad", lambda: torch.mm(dy, w), (t, n_in, n_out)),
                ("wgrad", lambda: torch.mm(dy.t(), x), (n_out, n_in, t)),
            ):
                ms = b.ms(fn)
                out.append({"kind": kind, "m": m, "n": n, "k": k, "ms": ms, "tflops": 2 * m * n * k / (ms * 1e9)})
    return out


ATTENTION = [(1, 32, 2048, 128), (2, 32, 2048, 128), (1, 32, 4096, 128), (1, 32, 8192, 128), (1, 64, 4096, 128)]


def attention(b: Bench) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = []
    for bs, h, s, d in ATTENTION:
        s = b.n(s)
        q, k, v = (b.randn(bs, h, s, d, grad=True) for _ in range(3))
        g = b.randn(bs, h, s, d)
        for backend in ("default", "flash"):
            if backend == "flash" and b.device != "cuda":
                continue
            ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if backend == "flash" else contextlib.nullcontext()
            with ctx:
                fwd = b.ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                both = b.ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g))
            causal = 2 * bs * h * s * s * d  # forward FLOPs: 4*b*h*s^2*d for full attention, half when causal
            out.append({"backend": backend, "b": bs, "h": h, "s": s, "d": d, "fwd_ms": fwd, "bwd_ms": both - fwd,
                        "fwd_tflops_causal": causal / (fwd * 1e9),
                        "bwd_tflops_causal": 2.5 * causal / (max(both - fwd, 1e-6) * 1e9)})
    return out


def llama_shard_shapes(dim: int, ffn: int, vocab: int, layers: int, world: int) -> list[tuple[int, ...]]:
    """The local shards of a Llama-style model's params (dim 0 split over ``world`` ranks)."""
    block = [(dim, dim)] * 4 + [(ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)]
    shapes = block * layers + [(vocab, dim), (vocab, dim), (dim,)]
    return [(-(-s[0] // world), *s[1:]) for s in shapes]


def adamw(b: Bench) -> list[dict[str, Any]]:
    out = []
    for world, fused in ((2, False), (1, False), (2, True)):
        if fused and b.device != "cuda":
            continue
        shapes = llama_shard_shapes(b.n(4096), b.n(10928), b.n(32000), 4, world)
        params = [torch.nn.Parameter(b.randn(*s)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True if fused else None)
        ms = b.ms(opt.step, reps=8, warmup=2)
        numel = sum(p.numel() for p in params)
        out.append({"world": world, "fused": fused, "numel": numel, "ms": ms})
        del params, opt
        if b.device == "cuda":
            torch.cuda.empty_cache()
    return out


STEPS: dict[str, tuple[str, dict[str, int]]] = {
    "llama-2x4096-seq8192": ("llama", {"dim": 4096, "layers": 2, "heads": 32, "vocab": 32000, "seq": 8192, "batch": 1}),
    "mlp-4x4096-1024tok": ("mlp", {"dim": 4096, "layers": 4, "tokens": 1024}),
}


def whole_steps(b: Bench, names: list[str]) -> list[dict[str, Any]]:
    """fsdp-compile (``fsdp_backend``, world size 1) training steps with AdamW, as benchmarks.step_time runs them."""
    from benchmarks.workloads import Mlp
    from fsdp_compile import FsdpGroups, fsdp_backend, fully_shard
    from fsdp_compile.examples.models import ModelConfig, Transformer, loss_fn

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if b.device == "cuda" else "gloo", rank=0, world_size=1)
    groups = FsdpGroups.create()
    out = []
    for name in names:
        kind, kw = STEPS[name]
        kw = {k: (b.n(v) if k in ("dim", "seq", "tokens", "vocab") else v) for k, v in kw.items()}
        torch.manual_seed(0)
        with torch.device(b.device):
            if kind == "llama":
                cfg = ModelConfig(vocab_size=kw["vocab"], dim=kw["dim"], n_layers=kw["layers"], n_heads=kw["heads"],
                                  max_seq_len=kw["seq"])
                model: torch.nn.Module = Transformer(cfg).to(BF16)
                tokens = torch.randint(0, kw["vocab"], (kw["batch"], kw["seq"] + 1))
                batch: tuple[torch.Tensor, ...] = (tokens[:, :-1], tokens[:, 1:])
            else:
                model = Mlp(kw["dim"], kw["layers"]).to(BF16)
                batch = (torch.randn(kw["tokens"], kw["dim"], dtype=BF16),)
        for block in model.layers:  # type: ignore[union-attr]
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        compiled = torch.compile(model, backend=fsdp_backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:
            out_ = compiled(batch[0])
            loss = loss_fn(out_, batch[1]) if kind == "llama" else out_.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        step()
        if b.device == "cuda":
            torch.cuda.synchronize()
        cold = time.perf_counter() - t0
        ms = b.ms(step, reps=10, warmup=3)
        out.append({"name": name, "kind": kind, **kw, "median_ms": ms, "cold_s": cold})
        del model, compiled, opt
        torch._dynamo.reset()
    groups.destroy()
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="h200_kernels.json")
    p.add_argument("--steps", default=",".join(STEPS), help="whole-step configs to run ('' for none)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script, measures nothing")
    ns = p.parse_args()
    b = Bench(ns.smoke)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if b.device == "cuda" else "cpu (smoke test)",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }
    parts: list[tuple[str, Callable[[], object]]] = [
        ("copy", lambda: copy_bandwidth(b)), ("matmul", lambda: matmuls(b)), ("attention", lambda: attention(b)),
        ("adamw", lambda: adamw(b)), ("steps", lambda: whole_steps(b, [s for s in ns.steps.split(",") if s])),
    ]
    for name, fn in parts:
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # keep what was measured; say what failed
            result[name] = {"error": repr(e)}
        print(f"[{name}: {time.perf_counter() - t0:.1f}s]", flush=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    summarize(result)


def summarize(result: dict[str, Any]) -> None:
    if "bytes_per_s" in result.get("copy", {}):
        print(f"copy {result['copy']['bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    if isinstance(result.get("matmul"), list):
        by_t: dict[int, list[float]] = {}
        for r in result["matmul"]:
            by_t.setdefault(min(r["m"], r["n"], r["k"]), []).append(r["tflops"])
        for t, v in sorted(by_t.items()):
            print(f"matmul smallest dim {t:6d}: median {statistics.median(v):6.0f} TFLOP/s over {len(v)}")
    for r in result.get("attention", []) if isinstance(result.get("attention"), list) else []:
        print(f"attention {r['backend']:8s} {r['b']}x{r['h']}x{r['s']}x{r['d']}: fwd {r['fwd_ms']:.3f} ms "
              f"({r['fwd_tflops_causal']:.0f} TFLOP/s causal), bwd {r['bwd_ms']:.3f} ms ({r['bwd_tflops_causal']:.0f})")
    for r in result.get("adamw", []) if isinstance(result.get("adamw"), list) else []:
        print(f"adamw world {r['world']} fused {r['fused']}: {r['ms']:.2f} ms for {r['numel'] / 1e6:.0f}M params")
    for r in result.get("steps", []) if isinstance(result.get("steps"), list) else []:
        print(f"step {r['name']}: {r['median_ms']:.2f} ms (first step {r['cold_s']:.1f} s)")
    for k, v in result.items():
        if isinstance(v, dict) and "error" in v:
            print(f"{k} FAILED: {v['error']}")


if __name__ == "__main__":
    main()
