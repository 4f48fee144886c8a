"""How much communication is hidden under computation, measured on a profiler's device timeline.

Input: the Chrome-trace JSON that ``torch.profiler.profile.export_chrome_trace`` writes (``load_trace``),
or a live profile (``events_from_profiler``). Device events (GPU kernels, memcpys, memsets by default) are
put into four classes by name (``classify``, table ``NCCL_COMM_PATTERNS``): all-gather, reduce-scatter,
other communication, and compute (everything else). Each class becomes the *union* of its intervals, so
kernels on different streams that run at the same time are counted once. With ``|X|`` the length of a
union, ``AG``/``RS``/``COMM``/``COMPUTE`` the unions, the report gives, per step:

* ``all_gather_hidden_by_compute = |AG ∩ COMPUTE| / |AG|`` (same for reduce-scatter): the share of the
  collective's time during which at least one compute kernel runs;
* ``all_gather_hidden_by_reduce_scatter = |AG ∩ RS| / |AG|`` and ``reduce_scatter_hidden_by_all_gather
  = |AG ∩ RS| / |RS|``: the share of each collective running concurrently with the other;
* ``exposed_comm_ms = |COMM \\ COMPUTE|``: time when some communication runs and no compute does, also as
  a share of the step's span (first device event start to last device event end);
* totals: all-gather, reduce-scatter, other-communication, compute and step time, in ms.

A share is ``None`` when its denominator is zero (no such communication, or an empty step): "nothing to
hide" is not the same as "fully hidden". Steps come from ``ProfilerStep#N`` CPU annotations (see
``assign_steps`` for how device events are mapped to them); without any, the whole trace is one step.
The report holds each step, the field-wise median across steps, and the whole trace taken as one set.

CLI: ``python -m benchmarks.overlap TRACE.json [--json OUT.json]`` prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Interval = tuple[float, float]

DEVICE_CATS: frozenset[str] = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Chrome-trace categories of events that run on the device timeline of a CUDA trace."""

NCCL_COMM_PATTERNS: tuple[tuple[str, str], ...] = (
    ("all_gather", r"AllGather"),
    ("reduce_scatter", r"ReduceScatter"),
    ("other_comm", r"nccl"),
)
"""(class, regex) pairs searched in order in an event's name; the first match wins, no match = compute.

Case-sensitive on purpose: NCCL kernels are named like ``ncclDevKernel_AllGather_RING_LL(...)``, while
Inductor kernels that merely *prepare* a collective are lower-case (``triton_poi_fused_all_gather_copy_in_0``)
and are compute. Pass your own table to ``analyze(comm_patterns=...)`` for other libraries."""

GLOO_COMM_PATTERNS: tuple[tuple[str, str], ...] = (
    ("all_gather", r"^(gloo:|c10d::_?)all_?gather"),
    ("reduce_scatter", r"^(gloo:|c10d::_?)reduce_scatter"),
    ("other_comm", r"^(gloo:|c10d::)"),
)
"""A rough table for CPU-only gloo traces, with ``device_cats=CPU_CATS`` (CLI: ``--cpu``): gloo's work runs
on its own threads as ``gloo:<op>`` annotations (``reduce_scatter_tensor`` shows up as ``gloo:all_reduce``,
so as other communication), the calling thread blocks in ``c10d::<op>``; every other CPU op is compute."""

CPU_CATS: frozenset[str] = frozenset({"cpu_op", "user_annotation"})
STEP_CATS = CPU_CATS  # where ProfilerStep#N annotations live (older torch: cpu_op)
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
CLASSES: tuple[str, ...] = ("all_gather", "reduce_scatter", "other_comm", "compute")


@dataclass(frozen=True)
class Event:
    """One complete ("X") trace event. For device events ``tid`` is the stream; times in microseconds."""

    name: str
    cat: str
    ts_us: float
    dur_us: float
    pid: int | str
    tid: int | str
    correlation: int | None = None  # links a kernel to its CPU launch (cudaLaunchKernel...) event

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us


@dataclass(frozen=True)
class StepSpan:
    """A ``ProfilerStep#index`` annotation's CPU time span, in microseconds."""

    index: int
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Overlap:
    """The measures for one step (``step`` = its index) or for a set of steps (``step`` = None)."""

    step: int | None
    step_ms: float
    compute_ms: float
    all_gather_ms: float
    reduce_scatter_ms: float
    other_comm_ms: float
    exposed_comm_ms: float
    exposed_comm_share: float | None
    all_gather_hidden_by_compute: float | None
    reduce_scatter_hidden_by_compute: float | None
    all_gather_hidden_by_reduce_scatter: float | None
    reduce_scatter_hidden_by_all_gather: float | None


@dataclass(frozen=True)
class OverlapReport:
    """``steps``: one ``Overlap`` per step; ``median``: field-wise median over steps (Nones skipped);
    ``overall``: all analyzed device events as one interval set (ratios of totals, not of steps)."""

    median: Overlap
    overall: Overlap
    steps: tuple[Overlap, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "median": dataclasses.asdict(self.median),
            "overall": dataclasses.asdict(self.overall),
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty ones dropped, touching ones merged."""
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(end - start for start, end in union(intervals))


def intersect_len(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """``|union(a) ∩ union(b)|``, by a two-pointer sweep over both unions."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract_len(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """``|union(a) \\ union(b)|``: the time covered by ``a`` and not by ``b``."""
    ua = union(a)
    return max(0.0, length(ua) - intersect_len(ua, b))


def _event(raw: Mapping[str, Any]) -> Event | None:
    if raw.get("ph") != "X" or "ts" not in raw:
        return None
    args = raw.get("args") or {}
    corr = args.get("correlation")
    return Event(
        name=str(raw.get("name", "")),
        cat=str(raw.get("cat", "")),
        ts_us=float(raw["ts"]),
        dur_us=max(0.0, float(raw.get("dur", 0.0))),
        pid=raw.get("pid", 0),
        tid=raw.get("tid", 0),
        correlation=int(corr) if isinstance(corr, (int, float)) else None,
    )


def load_trace(path: str | os.PathLike[str]) -> list[Event]:
    """The complete ("X") events of a Chrome trace (``.json`` or ``.json.gz``), in file order."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    raws = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in map(_event, raws) if e is not None]


def events_from_profiler(prof: Any) -> list[Event]:
    """The events of a finished ``torch.profiler.profile`` (exported to a temporary Chrome trace)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return load_trace(path)


def classify(name: str, comm_patterns: Sequence[tuple[str, str]] = NCCL_COMM_PATTERNS) -> str:
    """The class of a device event: the first matching pattern's class, else ``"compute"``."""
    for cls, pattern in comm_patterns:
        if re.search(pattern, name):
            return cls
    return "compute"


def find_steps(events: Iterable[Event]) -> list[StepSpan]:
    """``ProfilerStep#N`` CPU annotations as spans, sorted by start; the first of duplicate indices kept."""
    spans: dict[int, StepSpan] = {}
    for e in events:
        m = STEP_NAME.match(e.name)
        if m and e.cat in STEP_CATS and int(m.group(1)) not in spans:
            spans[int(m.group(1))] = StepSpan(int(m.group(1)), e.ts_us, e.end_us)
    return sorted(spans.values(), key=lambda s: s.start_us)


def assign_steps(device: Sequence[Event], others: Iterable[Event], spans: Sequence[StepSpan]) -> dict[int, list[Event]]:
    """Group device events by the step whose CPU span contains their *launch* time.

    The launch time is the start of the CPU event (cudaLaunchKernel and friends, never a ``gpu_*`` event)
    with the same ``correlation`` id: a kernel launched in step N belongs to step N even when the GPU runs
    it after the CPU has moved on. Events without a launch event (CPU traces) use their own start. Events
    outside every span are dropped."""
    launch = {
        e.correlation: e.ts_us for e in others if e.correlation is not None and not e.cat.startswith("gpu")
    }
    groups: dict[int, list[Event]] = {s.index: [] for s in spans}
    for e in device:
        t = launch.get(e.correlation, e.ts_us) if e.correlation is not None else e.ts_us
        for s in spans:
            if s.start_us <= t < s.end_us:
                groups[s.index].append(e)
                break
    return groups


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def measure(events: Sequence[Event], comm_patterns: Sequence[tuple[str, str]], step: int | None = None) -> Overlap:
    """The ``Overlap`` measures of one set of device events (times converted to ms)."""
    by_class: dict[str, list[Interval]] = {c: [] for c in CLASSES}
    for e in events:
        by_class.setdefault(classify(e.name, comm_patterns), []).append((e.ts_us / 1e3, e.end_us / 1e3))
    ag, rs, compute = union(by_class["all_gather"]), union(by_class["reduce_scatter"]), union(by_class["compute"])
    comm = union(iv for c, ivs in by_class.items() if c != "compute" for iv in ivs)
    span = max((e.end_us for e in events), default=0.0) - min((e.ts_us for e in events), default=0.0)
    ag_ms, rs_ms, both = length(ag), length(rs), intersect_len(ag, rs)
    exposed = subtract_len(comm, compute)
    return Overlap(
        step=step,
        step_ms=span / 1e3,
        compute_ms=length(compute),
        all_gather_ms=ag_ms,
        reduce_scatter_ms=rs_ms,
        other_comm_ms=length(by_class["other_comm"]),
        exposed_comm_ms=exposed,
        exposed_comm_share=_share(exposed, span / 1e3),
        all_gather_hidden_by_compute=_share(intersect_len(ag, compute), ag_ms),
        reduce_scatter_hidden_by_compute=_share(intersect_len(rs, compute), rs_ms),
        all_gather_hidden_by_reduce_scatter=_share(both, ag_ms),
        reduce_scatter_hidden_by_all_gather=_share(both, rs_ms),
    )


def median_overlap(steps: Sequence[Overlap]) -> Overlap:
    """Field-wise median over ``steps``, skipping ``None`` values (``None`` if a field has no value)."""
    values: dict[str, Any] = {"step": None}
    for f in dataclasses.fields(Overlap)[1:]:
        present = [getattr(s, f.name) for s in steps if getattr(s, f.name) is not None]
        values[f.name] = statistics.median(present) if present else None
    return Overlap(**values)


def analyze(
    events: Iterable[Event],
    *,
    comm_patterns: Sequence[tuple[str, str]] = NCCL_COMM_PATTERNS,
    device_cats: Iterable[str] = DEVICE_CATS,
    is_device: Callable[[Event], bool] | None = None,
    steps: Sequence[StepSpan] | Literal["auto"] | None = "auto",
) -> OverlapReport:
    """Measure communication/compute overlap of ``events``.

    ``is_device`` (default: ``event.cat in device_cats``) picks the device-timeline events; step
    annotations are never device events. ``steps="auto"`` finds ``ProfilerStep#N`` spans (whole trace if
    none), ``None`` forces one whole-trace step, a sequence of ``StepSpan`` is used as given."""
    events = list(events)
    cats = frozenset(device_cats)
    pick = is_device or (lambda e: e.cat in cats)
    device = [e for e in events if pick(e) and not STEP_NAME.match(e.name)]
    spans = find_steps(events) if steps == "auto" else list(steps or [])
    if spans:
        groups = assign_steps(device, (e for e in events if not pick(e)), spans)
        per_step = tuple(measure(evs, comm_patterns, idx) for idx, evs in groups.items())
        device = [e for evs in groups.values() for e in evs]
    else:
        per_step = (measure(device, comm_patterns),)
    return OverlapReport(median_overlap(per_step), measure(device, comm_patterns), per_step)


def profile_steps(
    step_fn: Callable[[], object],
    steps: int = 5,
    warmup: int = 2,
    out_path: str | os.PathLike[str] = "overlap_trace.json",
) -> Path:
    """Run ``step_fn`` ``warmup + steps`` times under ``torch.profiler`` (CUDA activity when available),
    record the last ``steps`` as ``ProfilerStep#N``, export the Chrome trace to ``out_path``, return it."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = Path(out_path)

    def export(prof: profile) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out))

    sched = schedule(wait=0, warmup=warmup, active=steps, repeat=1)
    with profile(activities=activities, schedule=sched, on_trace_ready=export) as prof:
        for i in range(warmup + steps):
            step_fn()
            if cuda and i == warmup + steps - 1:
                torch.cuda.synchronize()  # the last step's kernels finish inside the recorded window
            prof.step()
    return out


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" if "hidden" in name or name.endswith("_share") else f"{value:.3f}"


def markdown_table(report: OverlapReport) -> str:
    """Rows: measures; columns: median, overall, then each step."""
    cols = [("median", report.median), ("overall", report.overall)]
    cols += [(f"step {s.step}" if s.step is not None else "trace", s) for s in report.steps]
    lines = ["| measure | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for f in dataclasses.fields(Overlap)[1:]:
        lines.append(f"| {f.name} | " + " | ".join(_fmt(f.name, getattr(o, f.name)) for _, o in cols) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Chrome-trace JSON written by torch.profiler (.json or .json.gz)")
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    parser.add_argument("--cpu", action="store_true", help="CPU gloo trace: cpu ops are the timeline")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {"comm_patterns": GLOO_COMM_PATTERNS, "device_cats": CPU_CATS} if args.cpu else {}
    report = analyze(load_trace(args.trace), **kwargs)
    print(markdown_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
