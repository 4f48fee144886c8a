"""Where a variant's step time and memory go, on one GPU: kernel classes, CPU time, buffers alive at the peak.

For each variant (built as in ``benchmarks.step_time``, on one NCCL rank):

* **kernel classes per step** from a ``torch.profiler`` trace: GPU time and count of matmuls, Triton
  kernels, NCCL kernels, copies (memcpy/memset and ATen copy/cat kernels), optimizer kernels and the
  rest; and the CPU time of a step (its ``ProfilerStep`` span: the host launching the step);
* **where the GPU waits** in a step that starts and ends synchronized, as ``timed_step`` runs it: the
  step's CPU span, the GPU's busy time in it (the union of its kernels), the wait before its first kernel
  (the host's work before it launches anything: guards, hooks), and the longest gaps between kernels,
  each named by the kernel after it and the CPU op that launched that kernel;
* **the same steps without the profiler**: their median, the host's time to issue the forward call, the
  backward call and the optimizer step, and what the caching allocator did per step (device mallocs and
  frees, retries after a failed malloc, syncs of every stream), under the process's
  ``PYTORCH_CUDA_ALLOC_CONF``: whether a difference the profiled steps do not show is the host's or the
  allocator's;
* **memory at the peak** of one step from a CUDA memory snapshot
  (``torch.cuda.memory._record_memory_history``): the step's peak above what was allocated before it,
  and the allocations alive at that moment, largest first, each named by the source line that made it
  (Inductor's generated code names its buffers: ``buf12 = empty_strided_cuda(...)``).

Run on a GPU machine: ``python -m benchmarks.world1_costs --preset h200-mlp --variants compile,fsdp-compile-keep
--out DIR``; writes ``DIR/world1_costs.json`` (and with ``--snapshot NAME`` that variant's raw snapshot,
``DIR/snapshot-NAME.pickle.gz``, for ``torch.cuda._memory_viz``), prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import linecache
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workloads import PRESETS, Runner, loss_of, make_batch
from benchmarks.variants import VARIANTS, SharedGroups, build_variant, raise_recompile_limit, unavailable_reason
from benchmarks.overlap import DEVICE_CATS, Event, assign_steps, find_steps, load_trace, profile_steps, union

KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("nccl", r"nccl"),
    ("optimizer", r"multi_tensor_apply|fused_adam|FusedAdam|_fused_adamw"),
    ("matmul", r"gemm|cutlass|sm90_xmma|nvjet|xmma_|cublas|matmul"),
    ("copy", r"^Memcpy|^Memset|CatArrayBatchedCopy|copy_kernel|direct_copy|cat_|_copy_|elementwise_kernel.*copy"),
    ("triton", r"^triton_"),
)
"""(class, regex) searched in order in a device event's name; no match: ``other`` (ATen elementwise etc.)."""


def kernel_class(name: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, name):
            return cls
    return "other"


def kernel_breakdown(trace: Path) -> dict[str, Any]:
    """Per class: median over the profiled steps of GPU ms and of kernel count; and the median CPU ms of a step."""
    events = load_trace(trace)
    spans = find_steps(events)
    device = [e for e in events if e.cat in DEVICE_CATS]
    groups = assign_steps(device, [e for e in events if e.cat not in DEVICE_CATS], spans)
    per_step: list[dict[str, tuple[float, int]]] = []
    for evs in groups.values():
        acc: dict[str, list[float]] = defaultdict(list)
        for e in evs:
            acc[kernel_class(e.name)].append(e.dur_us)
        per_step.append({c: (sum(v) / 1e3, len(v)) for c, v in acc.items()})
    classes = sorted({c for s in per_step for c in s})
    out: dict[str, Any] = {
        c: {"gpu_ms": statistics.median(s.get(c, (0.0, 0))[0] for s in per_step),
            "kernels": statistics.median(s.get(c, (0.0, 0))[1] for s in per_step)} for c in classes}
    out["cpu_step_ms"] = statistics.median((s.end_us - s.start_us) / 1e3 for s in spans) if spans else None
    top: dict[str, dict[str, list[float]]] = {"top_non_matmul": defaultdict(list), "top_matmul": defaultdict(list)}
    for evs in groups.values():
        for e in evs:
            cls = kernel_class(e.name)
            if cls in ("copy", "triton", "other", "matmul"):
                top["top_matmul" if cls == "matmul" else "top_non_matmul"][e.name[:120]].append(e.dur_us)
    n = max(1, len(groups))
    for key, kernels in top.items():  # each kernel name's ms and count per step (layouts show in matmul names)
        out[key] = sorted(((k, sum(v) / 1e3 / n, len(v) // n) for k, v in kernels.items()), key=lambda x: -x[1])[:15]
    return out


def _launcher(launch: Event, cpu_ops: Sequence[Event]) -> str:
    """The innermost CPU op (shortest span) on the launch's thread that contains the launch."""
    inside = [o for o in cpu_ops if o.tid == launch.tid and o.ts_us <= launch.ts_us < o.end_us]
    return min(inside, key=lambda o: o.dur_us).name[:100] if inside else launch.name


def idle_breakdown(trace: Path, top: int = 10) -> dict[str, Any]:
    """Per synchronized step (medians): CPU span, GPU busy ms, the wait before the first kernel, the idle
    ms between kernels; and the longest gaps of all steps, per step, by (kernel after, launching op)."""
    events = load_trace(trace)
    spans = find_steps(events)
    device = [e for e in events if e.cat in DEVICE_CATS]
    others = [e for e in events if e.cat not in DEVICE_CATS]
    groups = assign_steps(device, others, spans)
    launches = {e.correlation: e for e in others
                if e.correlation is not None and e.cat in ("cuda_runtime", "cuda_driver")}
    cpu_ops = [e for e in others if e.cat == "cpu_op"]
    rows: list[dict[str, float]] = []
    gaps: dict[tuple[str, str], float] = defaultdict(float)
    for span in spans:
        evs = sorted(groups.get(span.index, []), key=lambda e: e.ts_us)
        if not evs:
            continue
        busy = union((e.ts_us, e.end_us) for e in evs)
        first_at = {iv[0]: None for iv in busy}
        after = {e.ts_us: e for e in evs if e.ts_us in first_at}
        for (_, end), (start, _) in zip(busy, busy[1:]):
            nxt = after[start]
            launch = launches.get(nxt.correlation)
            op = _launcher(launch, cpu_ops) if launch is not None else "?"
            gaps[(nxt.name[:80], op)] += (start - end) / 1e3
        rows.append({"cpu_span_ms": (span.end_us - span.start_us) / 1e3,
                     "gpu_busy_ms": sum(b - a for a, b in busy) / 1e3,
                     "before_first_kernel_ms": (busy[0][0] - span.start_us) / 1e3,
                     "between_kernels_ms": (busy[-1][1] - busy[0][0] - sum(b - a for a, b in busy)) / 1e3})
    n = max(1, len(rows))
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    out["largest_gaps"] = [{"ms_per_step": round(ms / n, 4), "kernel_after": k, "launched_by": op}
                           for (k, op), ms in sorted(gaps.items(), key=lambda kv: -kv[1])[:top]]
    return out


ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
"""Counters of ``torch.cuda.memory_stats()`` that mean work outside the step's kernels: a device malloc or
free (a free waits for the device), a retry after a failed malloc (the cache freed first), a sync of all streams."""


def per_step_counts(before: dict[str, Any], after: dict[str, Any], steps: int) -> dict[str, float]:
    """:data:`ALLOCATOR_COUNTERS` per step between two ``torch.cuda.memory_stats()`` (0 where absent)."""
    return {k: (after.get(k, 0) - before.get(k, 0)) / max(steps, 1) for k in ALLOCATOR_COUNTERS}


HOST_PARTS = ("forward_call_ms", "backward_call_ms", "optimizer_call_ms")
"""What the host spends issuing each part of a step (launches are asynchronous: not the GPU's time)."""


def unprofiled_steps(runner: Runner, spec: Any, batch: Any, steps: int = 10) -> dict[str, Any]:
    """``steps`` synchronized steps without the profiler: the median ms, the median host time of each of
    :data:`HOST_PARTS`, and the allocator's work per step."""
    before = torch.cuda.memory_stats()
    rows = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_of(spec, runner.forward, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        runner.opt.step()
        runner.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        rows.append((time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2))
    medians = [statistics.median(column) * 1e3 for column in zip(*rows)]
    return {"step_ms": medians[0], **dict(zip(HOST_PARTS, medians[1:])),
            **per_step_counts(before, torch.cuda.memory_stats(), steps),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def _label(frames: Sequence[dict[str, Any]]) -> str:
    """The first frame of generated or project code, as ``file:line: source``."""
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name or "/fsdp_compile/" in name or "/passes/" in name or "/benchmarks/" in name:
            src = linecache.getline(name, int(f.get("line", 0))).strip()
            return f"{Path(name).name}:{f.get('line')}: {src[:140]}"
    for f in frames:
        name = f.get("filename", "")
        if "site-packages/torch/" not in name and name.endswith(".py"):
            return f"{Path(name).name}:{f.get('line')}: {f.get('name')}"
    for f in frames:  # no Python frame: the first C++ function past the allocator (autograd, an ATen op)
        fn = f.get("name", "")
        if ("autograd" in fn or "at::native" in fn or "at::_ops" in fn) and "empty" not in fn:
            return f"C++: {fn[:140]}"
    return (frames[0].get("name", "?") if frames else "?")[:140]


def live_at_peak(snapshot: dict[str, Any], baseline: int) -> dict[str, Any]:
    """Replay the recorded allocations of device 0: the peak of live bytes (plus ``baseline``, what was
    allocated before recording) and the allocations alive at it, grouped by the line that made them."""
    traces = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for ev in traces:
        action, addr, size = ev["action"], ev["addr"], ev["size"]
        if action == "alloc":
            live[addr] = (size, _label(ev.get("frames", [])))
            current += size
            if current > peak:
                peak, peak_live = current, dict(live)
        elif action == "free_completed" and addr in live:
            current -= live.pop(addr)[0]
    groups: dict[str, list[int]] = defaultdict(list)
    for size, label in peak_live.values():
        groups[label].append(size)
    rows = sorted(((label, sum(s), len(s)) for label, s in groups.items()), key=lambda r: -r[1])
    return {"peak_above_start_mib": peak / 2**20, "baseline_mib": baseline / 2**20,
            "live_at_peak": [{"mib": round(b / 2**20, 1), "count": n, "made_by": label} for label, b, n in rows[:25]]}


def snapshot_step(runner: Runner, spec: Any, batch: Any, keep: Path | None) -> dict[str, Any]:
    """One step under the memory recorder; returns :func:`live_at_peak` (and saves the snapshot to ``keep``)."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        runner.step(spec, batch)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if keep is not None:
        with gzip.open(keep, "wb") as f:
            pickle.dump(snap, f)
    return live_at_peak(snap, baseline)


def synced_step(runner: Runner, spec: Any, batch: Any) -> None:
    torch.cuda.synchronize()
    runner.step(spec, batch)
    torch.cuda.synchronize()


def measure(names: Sequence[str], preset: str, out: Path, snapshot_of: Sequence[str], optimizer: str,
            batch_size: int | None = None) -> dict:
    spec = PRESETS[preset] if batch_size is None else dataclasses.replace(PRESETS[preset], batch=batch_size)
    device = torch.device("cuda", 0)
    raise_recompile_limit(len(names))
    shared = SharedGroups(device, 1)
    batch = make_batch(spec, seed=1, device=device)
    results: dict[str, Any] = {}
    for name in names:  # one after the other in one process: each must leave nothing allocated
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        reason = unavailable_reason(name, 1, device)
        if reason:
            results[name] = {"reason": reason}
            continue
        try:
            runner = build_variant(name, spec, shared, seed=0, optimizer=optimizer)
            losses = []
            for _ in range(3):  # warm-up; the losses let variants be compared (same seed, same batch)
                loss = loss_of(spec, runner.forward, batch)
                loss.backward()
                runner.opt.step()
                runner.opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
            unprofiled = unprofiled_steps(runner, spec, batch)
            with tempfile.TemporaryDirectory() as tmp:
                trace = profile_steps(lambda: runner.step(spec, batch), steps=3, warmup=1,
                                      out_path=Path(tmp) / "t.json")
                results[name] = {"kernels": kernel_breakdown(trace), "losses": losses, "unprofiled": unprofiled}
                synced = profile_steps(lambda: synced_step(runner, spec, batch), steps=3, warmup=1,
                                       out_path=Path(tmp) / "s.json")
                results[name]["idle"] = idle_breakdown(synced)
            keep = out / f"snapshot-{name}.pickle.gz" if name in snapshot_of else None
            results[name]["memory"] = snapshot_step(runner, spec, batch, keep)
        except Exception as e:  # report and go on with the next variant
            results[name] = {"reason": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        finally:
            runner = None  # type: ignore[assignment]
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            left = torch.cuda.memory_allocated() - start
            if name in results and left:  # then the next variants' figures are not sound
                results[name]["left_behind_bytes"] = left
    shared.destroy()
    return results


def print_tables(results: dict[str, Any]) -> None:
    classes = sorted({c for r in results.values() for c in r.get("kernels", {})
                      if c not in ("cpu_step_ms", "top_non_matmul", "top_matmul")})
    print("| variant | " + " | ".join(f"{c} ms (n)" for c in classes) + " | CPU step ms | peak MiB |")
    print("|---" * (len(classes) + 3) + "|")
    for name, r in results.items():
        if "reason" in r:
            print(f"| {name} | not measured: {r['reason']} |")
            continue
        k = r["kernels"]
        cells = [f"{k[c]['gpu_ms']:.2f} ({k[c]['kernels']:.0f})" if c in k else "–" for c in classes]
        print(f"| {name} | " + " | ".join(cells) + f" | {k['cpu_step_ms']:.1f} | {r['memory']['peak_above_start_mib']:.0f} |"
              f" losses {['%.6g' % x for x in r['losses']]}")
    for name, r in results.items():
        if r.get("left_behind_bytes"):
            print(f"\nWARNING: {name} left {r['left_behind_bytes']} bytes allocated once freed: measure the "
                  "variants after it in processes of their own")
        if "memory" in r:
            print(f"\n{name}: alive at the peak ({r['memory']['peak_above_start_mib']:.0f} MiB above the step's start)")
            for row in r["memory"]["live_at_peak"][:12]:
                print(f"  {row['mib']:8.1f} MiB x{row['count']:<3} {row['made_by']}")
            plain = r.get("unprofiled")
            if plain:
                counts = ", ".join(f"{k[4:]} {plain[k]:g}" for k in ALLOCATOR_COUNTERS)
                host = ", ".join(f"{k[:-3].replace('_', ' ')} {plain[k]:.2f} ms" for k in HOST_PARTS if k in plain)
                print(f"  without the profiler: {plain['step_ms']:.2f} ms per synchronized step; host: {host}; per "
                      f"step {counts} (PYTORCH_CUDA_ALLOC_CONF={plain['alloc_conf'] or 'unset'})")
            idle = r.get("idle", {})
            if idle:
                times = ", ".join(f"{k} {v:.2f}" for k, v in idle.items() if k != "largest_gaps")
                print(f"  synchronized step: {times}")
                for g in idle["largest_gaps"][:8]:
                    print(f"    gap {g['ms_per_step']:7.3f} ms/step before {g['kernel_after']} ({g['launched_by']})")
            for key in ("top_non_matmul", "top_matmul"):
                print(f"  {key.replace('_', ' ')} kernels (ms/step, n):")
                for kname, ms, n in r["kernels"][key][:8]:
                    print(f"    {ms:7.3f} {n:4d}  {kname}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.world1_costs", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200-mlp")
    p.add_argument("--variants", default="compile,fsdp-compile,fsdp-compile-keep")
    p.add_argument("--snapshot", default="fsdp-compile-keep", help="variants whose raw snapshot is saved")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused")
    p.add_argument("--batch", type=int, help="sequences per step (overrides the preset)")
    p.add_argument("--out", default=".")
    ns = p.parse_args(argv)
    names = [v for v in ns.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        results = measure(names, ns.preset, out, ns.snapshot.split(","), ns.optimizer, ns.batch)
    finally:
        dist.destroy_process_group()
    (out / "world1_costs.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print_tables(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
