"""Where the host's time goes in a launch-bound step: a Python profile of the steps, per variant.

When a step is bound by the CPU launching kernels (narrow, deep models with few tokens: the GPU waits on
the host), what decides the step time is the host's Python: Inductor's generated wrapper code, the
kernel launchers, the collectives' and the custom ops' dispatch. This builds each variant as
``benchmarks.step_time`` does (world size 1, NCCL or gloo), runs warm-up steps, then ``--steps`` steps
under ``cProfile``, and prints per variant the host seconds per step and the functions that take the
most of it (own time), with call counts per step, so two variants' tables can be read side by side.

``python -m benchmarks.host_profile --preset gpu-llama-1024 --variants fsdp-compile-keep,fsdp-compile-keep-whole``

``--kernels`` profiles the GPU side instead (``torch.profiler``): per step, each class of kernel (matmuls,
Triton kernels, NCCL, copies and fills, other ATen kernels) with its count and GPU milliseconds, and
how much of the step the GPU is idle.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import linecache
import os
import pstats
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workloads import PRESETS, make_batch
from benchmarks.variants import VARIANTS, SharedGroups, build_variant, raise_recompile_limit


def profile_variant(name: str, spec: Any, shared: SharedGroups, steps: int, top: int) -> dict[str, Any]:
    runner = build_variant(name, spec, shared, seed=0)
    batch = make_batch(spec, seed=1, device=shared.device)
    cuda = shared.device.type == "cuda"
    for _ in range(3):  # compile, then the first steps' checks (NOTE [lockstep])
        runner.step(spec, batch)
    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.thread_time()
    prof.enable()
    for _ in range(steps):
        runner.step(spec, batch)
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    wall, host = (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/")[-1].split("/torchinductor_")[-1]
        rows.append({"function": f"{where}:{line}({func})", "calls_per_step": calls / steps,
                     "own_ms_per_step": own * 1e3 / steps, "cum_ms_per_step": cum * 1e3 / steps})
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return {"variant": name, "wall_ms": wall * 1e3, "host_ms": host * 1e3, "profiled_steps": steps, "top": rows[:top]}


_KERNEL_CLASSES = (("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "cublas")), ("triton", ("triton",)),
                   ("nccl", ("nccl",)), ("copy/fill", ("memcpy", "memset", "copy")))


def _kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in _KERNEL_CLASSES if any(k in low for k in keys)), "other aten")


def _launch_site(event: Any) -> dict[str, Any]:
    """Where a CPU op that launched a kernel came from: its chain of enclosing ops (innermost first), its
    input shapes, and the first frames of its Python stack with the source line of each (the line of
    Inductor's generated code, read while the file exists)."""
    chain, e = [], event
    while e is not None and len(chain) < 6:
        chain.append(e.name)
        e = e.cpu_parent
    frames = []
    for frame in (event.stack or [])[:4]:
        where, _, func = frame.partition(": ")
        file, _, line = where.rpartition("(")
        text = linecache.getline(file, int(line.rstrip(")"))) if line.rstrip(")").isdigit() else ""
        frames.append(f"{frame} | {text.strip()[:160]}")
    return {"ops": chain, "input_shapes": [list(map(int, s)) for s in (event.input_shapes or []) if s][:4],
            "stack": frames}


def _copy_sources(prof: Any, steps: int) -> list[dict[str, Any]]:
    """The launch sites of copy kernels (``copy`` in the name of a kernel that is not Triton's), grouped,
    with counts per step."""
    sites: dict[str, dict[str, Any]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        for k in getattr(e, "kernels", []) or []:
            if "copy" not in k.name.lower() or k.name.startswith("triton_"):  # (a fused ``_to_copy`` is no copy)
                continue
            site = _launch_site(e)
            key = json.dumps([k.name[:80], site], sort_keys=True)
            row = sites.setdefault(key, {"kernel": k.name[:120], **site, "per_step": 0.0, "ms_per_step": 0.0})
            row["per_step"] += 1 / steps
            row["ms_per_step"] += k.duration / 1e3 / steps
    return sorted(sites.values(), key=lambda r: -r["ms_per_step"])


def kernel_profile(name: str, spec: Any, shared: SharedGroups, steps: int,
                   copy_sources: bool = False) -> dict[str, Any]:
    """GPU kernels of ``steps`` steps by class: count and milliseconds per step; GPU idle share. With
    ``copy_sources``, also where each copy kernel was launched from (``_copy_sources``)."""
    runner = build_variant(name, spec, shared, seed=0)
    batch = make_batch(spec, seed=1, device=shared.device)
    for _ in range(3):
        runner.step(spec, batch)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=copy_sources, with_stack=copy_sources) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step(spec, batch)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    classes: dict[str, list[float]] = {}
    names: dict[str, list[float]] = {}
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            for table, key in ((classes, _kernel_class(e.name)), (names, e.name)):
                c = table.setdefault(key, [0, 0.0])
                c[0] += 1
                c[1] += e.device_time / 1e3
            spans.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):  # the union of kernel intervals, microseconds
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    extra = {"copy_sources": _copy_sources(prof, steps)} if copy_sources else {}
    return {"variant": name, "wall_ms": wall * 1e3, "gpu_busy_ms": busy / 1e3 / steps, **extra,
            "classes": {c: {"kernels_per_step": n / steps, "ms_per_step": ms / steps}
                        for c, (n, ms) in sorted(classes.items())},
            "kernels": [{"name": k[:160], "class": _kernel_class(k), "per_step": n / steps, "ms_per_step": ms / steps}
                        for k, (n, ms) in sorted(names.items(), key=lambda kv: -kv[1][1])]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_profile", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu-llama-1024")
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--variants", default="fsdp-compile-keep,fsdp-compile-keep-whole")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    p.add_argument("--kernels", action="store_true", help="GPU kernels by class instead of the host profile")
    p.add_argument("--copy-sources", action="store_true",
                   help="with --kernels: where each copy kernel was launched (ops, shapes, generated-code line)")
    ns = p.parse_args(argv)
    names = [v for v in ns.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    spec = PRESETS[ns.preset]
    if ns.layers is not None:
        from dataclasses import replace

        spec = replace(spec, layers=ns.layers)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    raise_recompile_limit(4 * len(names) + 8)
    shared = SharedGroups(torch.device("cuda", 0) if cuda else torch.device("cpu"), 1)
    results = []
    try:
        for name in names:
            torch._dynamo.reset()
            results.append(kernel_profile(name, spec, shared, ns.steps, ns.copy_sources) if ns.kernels
                           else profile_variant(name, spec, shared, ns.steps, ns.top))
    finally:
        shared.destroy()
        dist.destroy_process_group()
    if ns.kernels:
        for r in results:
            print(f"\n{r['variant']}: {r['wall_ms']:.2f} ms wall, GPU busy {r['gpu_busy_ms']:.2f} ms per step")
            for cls, row in r["classes"].items():
                print(f"  {cls:12s} {row['kernels_per_step']:7.0f} kernels {row['ms_per_step']:8.3f} ms")
            for row in [k for k in r["kernels"] if k["class"] == "copy/fill"][:6]:
                print(f"    copy/fill {row['per_step']:5.0f} x {row['ms_per_step']:7.3f} ms  {row['name'][:100]}")
            for row in r.get("copy_sources", [])[:8]:
                print(f"    copy from {row['per_step']:5.1f} x {row['ms_per_step']:7.3f} ms  {' < '.join(row['ops'])}"
                      f"  {row['input_shapes']}")
                for frame in row["stack"][:3]:
                    print(f"        {frame[-150:]}")
    for r in results if not ns.kernels else []:
        print(f"\n{r['variant']}: {r['wall_ms']:.2f} ms wall, {r['host_ms']:.2f} ms host per step (profiled)")
        print("   own ms   cum ms  calls  function")
        for row in r["top"]:
            print(f"  {row['own_ms_per_step']:7.3f} {row['cum_ms_per_step']:8.3f} {row['calls_per_step']:6.0f}  "
                  f"{row['function'][-110:]}")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"preset": ns.preset, "spec": str(spec), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
