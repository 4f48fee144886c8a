"""Time training steps in an emulated world: step time, MFU, memory, and exposed communication.

Profiled steps give each collective kind's exposed time: how long it ran while no other kernel, copy or memset
did. They are written as a Perfetto trace.
"""

from __future__ import annotations

import gzip
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_compile.emulate.group import emulated_topology, ledger

__all__ = ["StepReport", "measure_steps", "exposed_seconds", "timeline_of_trace"]

GIB = 2**30
_PREFIX = "emulated_"  # the emulated collectives' kernels (NOTE [emulated kernel])
_KIND_OF = {"emulated_all_gather": "all_gather", "emulated_reduce_scatter": "reduce_scatter",
            "emulated_all_reduce": "all_reduce", "emulated_other": "other"}

Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def exposed_seconds(collective: Iterable[Interval], busy: Iterable[Interval]) -> float:
    """Length of the union of ``collective`` intervals not covered by any ``busy`` interval."""
    cover = _union(busy)
    total, j = 0.0, 0
    for s, e in _union(collective):
        while j < len(cover) and cover[j][1] <= s:
            j += 1
        k, t = j, s
        while t < e:
            if k < len(cover) and cover[k][0] < e:
                total += max(0.0, min(cover[k][0], e) - t)
                t = max(t, cover[k][1])
                k += 1
            else:
                total += e - t
                t = e
    return total


def timeline_of_trace(events: Iterable[dict[str, Any]]) -> tuple[dict[str, list[Interval]], list[Interval]]:
    """From Chrome-trace events: each collective kind's GPU intervals and every other GPU activity's (s)."""
    comm: dict[str, list[Interval]] = {}
    busy: list[Interval] = []
    streams: dict[Any, list[tuple[Interval, str]]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        span = (ev["ts"] * 1e-6, (ev["ts"] + ev.get("dur", 0)) * 1e-6)
        streams.setdefault((ev.get("pid"), ev.get("tid")), []).append((span, str(ev.get("name", ""))))
    for spans in streams.values():
        if not any(name.startswith(_PREFIX) for _, name in spans):
            busy += [span for span, _ in spans]
            continue
        # a communicator's stream: the copies before a kind's kernel are its data (NOTE [emulated kernel])
        kind = "other"
        for span, name in sorted(spans, reverse=True):
            kind = next((k for n, k in _KIND_OF.items() if name.startswith(n)), kind)
            comm.setdefault(kind, []).append(span)
    return comm, busy


@dataclass
class StepReport:
    """What ``measure_steps`` found; times in ms per step, memory in GiB."""

    label: str
    world: int
    hosts: int
    step_ms: list[float]
    median_ms: float
    mfu: float | None
    whole_run_peak_gib: float
    steady_transient_gib: float
    resident_gib: float
    cold_s: float
    exposed_ms: dict[str, float] = field(default_factory=dict)
    collective_ms: dict[str, float] = field(default_factory=dict)
    calls_per_step: dict[str, float] = field(default_factory=dict)
    trace: str | None = None

    def row(self) -> str:
        mfu = f"{100 * self.mfu:.1f}%" if self.mfu is not None else "-"
        ag, rs = self.exposed_ms.get("all_gather", 0.0), self.exposed_ms.get("reduce_scatter", 0.0)
        return (f"{self.label:24} {self.median_ms:9.1f} {mfu:>6} {ag:8.1f} / {rs:<8.1f} "
                f"{self.whole_run_peak_gib:8.1f} {self.steady_transient_gib:9.1f}")

    @staticmethod
    def header() -> str:
        return f"{'variant':24} {'step ms':>9} {'MFU':>6} {'exposed AG / RS ms':>19} {'peak GiB':>8} {'transient':>9}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_steps(step: Callable[[], None], *, label: str, steps: int = 10, warmup: int = 3,
                  flops_per_step: float | None = None, peak_flops: float = 989e12,
                  trace: str | Path | None = None, trace_steps: int = 2) -> StepReport:
    """Run ``step`` (one training step of this rank) cold, ``warmup`` times, ``steps`` timed times, then
    ``trace_steps`` profiled. Needs CUDA and ``init_emulated_world``. MFU: ``flops_per_step`` (this rank's) over
    the median step and ``peak_flops``."""
    topo = emulated_topology()
    if topo is None or not torch.cuda.is_available():
        raise RuntimeError("measure_steps: needs a CUDA device and init_emulated_world(...) first")

    def timed() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    torch.cuda.reset_peak_memory_stats()  # the whole run starts at the first step, after building
    cold = timed()
    for _ in range(warmup):
        timed()
    resident = torch.cuda.memory_allocated()
    whole_run = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ledger().clear()
    times = [timed() * 1e3 for _ in range(steps)]
    calls = {k: v / steps for k, v in ledger().calls.items()}
    peak = torch.cuda.max_memory_allocated()
    median = statistics.median(times)
    report = StepReport(label=label, world=topo.world, hosts=topo.hosts, step_ms=times, median_ms=median,
                        mfu=flops_per_step / (median * 1e-3) / peak_flops if flops_per_step else None,
                        whole_run_peak_gib=max(whole_run, peak) / GIB, steady_transient_gib=(peak - resident) / GIB,
                        resident_gib=resident / GIB, cold_s=cold, calls_per_step=calls)
    if trace_steps > 0:
        _profile(step, trace_steps, report, trace)
    return report


def _profile(step: Callable[[], None], n: int, report: StepReport, trace: str | Path | None) -> None:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    raw = Path(tempfile.gettempdir()) / f"emulated-trace-{time.time_ns()}.json"
    prof.export_chrome_trace(str(raw))
    text = raw.read_text()
    raw.unlink()
    comm, busy = timeline_of_trace(json.loads(text).get("traceEvents", []))
    report.exposed_ms = {k: exposed_seconds(v, busy) * 1e3 / n for k, v in comm.items()}
    report.collective_ms = {k: sum(e - s for s, e in _union(v)) * 1e3 / n for k, v in comm.items()}
    if trace is not None:  # gzipped: Perfetto opens .json.gz as it is
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace, "wt") as f:
            f.write(text)
        report.trace = str(trace)
