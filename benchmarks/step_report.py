"""Results of ``benchmarks.step_time``: what each rank measured, the summary rows, and their outputs
(markdown table, JSON with every raw step time, PNG bar chart)."""

from __future__ import annotations

import datetime
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.workloads import peak_flops_for

if TYPE_CHECKING:
    from benchmarks.step_time import BenchOptions

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class VariantRun:
    """One rank's measurements of one variant (``reason`` set: not measured, and why)."""

    name: str
    reason: str | None = None
    first_step_s: float = 0.0
    step_s: tuple[float, ...] = ()
    blocked: tuple[float, ...] = ()
    peak_bytes: int | None = None
    state_bytes: int | None = None
    comm_share: float | None = None
    late_graphs: int = 0  # graphs Dynamo compiled during the timed steps (should be 0)
    state_parts: tuple[int, int, int] | None = None  # (params, grads kept between steps, optimizer state)
    resident_bytes: int | None = None  # GPU: allocator bytes the variant's build and first step left behind
    overlap: dict[str, Any] | None = None  # GPU: benchmarks.overlap's median measures of the profiled steps
    whole_peak_bytes: int | None = None  # GPU: peak over build, first step and timed steps, above the variant's zero
    left_behind_bytes: int | None = None  # GPU: bytes its timed steps left allocated (NOTE [one process, variants apart])


@dataclass(frozen=True)
class RankReport:
    """What one rank measured, plus where it ran."""

    rank: int
    world: int
    device_name: str
    hostname: str
    torch_version: str
    nccl_version: str | None
    flops: int
    runs: tuple[VariantRun, ...]


@dataclass(frozen=True)
class Summary:
    """One table row: a variant over all ranks (step time per step = slowest rank's)."""

    name: str
    reason: str | None
    step_s: tuple[float, ...] = ()
    median_ms: float = float("nan")
    min_ms: float = float("nan")
    max_ms: float = float("nan")
    tokens_per_s: float = float("nan")
    mfu: float | None = None
    state_mib: float | None = None
    peak_mib: float | None = None
    cold_s: float = float("nan")
    comm_share: float | None = None
    late_graphs: int = 0
    parts_mib: tuple[float, float, float] | None = None
    resident_mib: float | None = None
    whole_peak_mib: float | None = None
    left_behind: int = 0


def summarize(reports: Sequence[RankReport], opts: BenchOptions) -> list[Summary]:
    """One row per requested variant; a step's time is the slowest rank's."""
    world, flops = len(reports), reports[0].flops
    peak = peak_flops_for(reports[0].device_name, opts.spec.dtype, opts.peak_flops) if opts.cuda else None
    rows = []
    for i, run0 in enumerate(reports[0].runs):
        runs = [r.runs[i] for r in reports]
        if run0.reason:
            rows.append(Summary(run0.name, run0.reason))
            continue
        steps = tuple(max(col) for col in zip(*(r.step_s for r in runs)))
        med = statistics.median(steps)
        shares = [r.comm_share for r in runs if r.comm_share is not None]
        peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
        parts = [r.state_parts for r in runs if r.state_parts is not None]
        resident = [r.resident_bytes for r in runs if r.resident_bytes is not None]
        whole = [r.whole_peak_bytes for r in runs if r.whole_peak_bytes is not None]
        rows.append(Summary(
            run0.name, None, steps, 1e3 * med, 1e3 * min(steps), 1e3 * max(steps),
            opts.spec.tokens_per_rank * world / med, flops / med / peak if peak else None,
            max(r.state_bytes or 0 for r in runs) / 2**20, max(peaks) / 2**20 if peaks else None,
            max(r.first_step_s for r in runs), statistics.mean(shares) if shares else None,
            max(r.late_graphs for r in runs),
            tuple(max(p[i] for p in parts) / 2**20 for i in range(3)) if parts else None,  # type: ignore[arg-type]
            max(resident) / 2**20 if resident else None, max(whole) / 2**20 if whole else None,
            max((r.left_behind_bytes or 0 for r in runs), key=abs)))
    return rows


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "–" if value is None or value != value else f"{value * scale:{spec}}{suffix}"


_GPU_NOTE = ("by torch.cuda.max_memory_allocated: activations, gathered parameters, gradients, communication "
             "buffers, optimizer temporaries; resident = what the allocator holds for the variant between steps "
             "(measured around its build and first step: params, optimizer state and any buffer kept, e.g. a "
             "gradient buffer); comm wait = exposed NCCL time (no compute kernel running) "
             "per step, from a profiler trace.")
_CPU_NOTE = ("on CPU the transient working memory (process RSS sampled by a thread); comm wait = share of the "
             "step the training thread was blocked (neither running nor waiting for a CPU: collective waits).")


def markdown_table(rows: Sequence[Summary], world: int, cuda: bool) -> str:
    """The results table, then one line per unavailable variant and how memory/comm wait were measured."""
    done = [r for r in rows if r.reason is None]
    base = done[0] if done else None
    ref = next((r for r in done if r.name == "compile"), None) if world == 1 and base and base.name != "compile" else None
    head = ["variant", "median ms", f"vs {base.name if base else '-'}"] + (["vs compile"] if ref else [])
    head += ["tokens/s", "MFU", "state MiB", "params+grads+opt MiB", "resident MiB", "whole-run peak MiB",
             "steady transient MiB", "cold compile s", "comm wait"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratios = [r.median_ms / x.median_ms if r.reason is None else None for x in (base, ref) if x is not None]
        cells = [r.name, _fmt(r.median_ms, ".1f")] + [_fmt(x, ".2f", suffix="x") for x in ratios]
        parts = "+".join(f"{x:.1f}" for x in r.parts_mib) if r.parts_mib else "–"
        cells += [_fmt(r.tokens_per_s, ",.0f"), _fmt(r.mfu, ".1f", 100, "%"), _fmt(r.state_mib, ".1f"), parts,
                  _fmt(r.resident_mib, ".0f"), _fmt(r.whole_peak_mib, ".0f"), _fmt(r.peak_mib, ".1f"), _fmt(r.cold_s, ".1f"), _fmt(r.comm_share, ".0f", 100, "%")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n* {r.name}: not measured: {r.reason}" for r in rows if r.reason]
    lines += [f"\n* {r.name}: WARNING: its timed steps left {r.left_behind} bytes allocated: memory figures of the "
              "variants after it are not sound; measure them in processes of their own" for r in rows if r.left_behind]
    lines += [f"\n* {r.name}: WARNING: {r.late_graphs} graphs compiled during its timed steps (times include "
              "compiling)" for r in rows if r.late_graphs]
    lines.append("\nstate = this rank's params + gradients kept between steps + optimizer state (storages of the "
                 "tensors, DTensors' local shards); whole-run peak = the variant's peak over its build, first step "
                 "and timed steps, above what was allocated before its build; steady transient = peak above what "
                 "was allocated before the variant's timed steps, " + (_GPU_NOTE if cuda else _CPU_NOTE))
    return "\n".join(lines)


def header_line(report: RankReport, opts: BenchOptions) -> str:
    """Date, host, device, versions, world size, model and the exact command line."""
    nccl = f" | NCCL {report.nccl_version}" if report.nccl_version else ""
    return (f"{datetime.datetime.now().isoformat(timespec='seconds')} | {report.hostname} | {report.device_name} | "
            f"torch {report.torch_version}{nccl} | world {report.world} | {opts.preset or opts.spec.kind}: "
            f"{opts.spec.describe()} | {opts.command}")


def default_json_path(opts: BenchOptions, device_name: str, world: int) -> Path:
    """``benchmarks/results/step_time-<preset or model>-<device>-w<world>.json``."""
    dev = "cpu" if opts.device == "cpu" else re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return RESULTS_DIR / f"step_time-{opts.preset or opts.spec.kind}-{dev}-w{world}.json"


def write_json(path: Path, header: str, rows: Sequence[Summary], reports: Sequence[RankReport],
               opts: BenchOptions) -> None:
    """All raw step times (per rank too), the summary rows and the run's settings."""
    r0 = reports[0]
    meta = {"header": header, "hostname": r0.hostname, "device": r0.device_name, "torch": r0.torch_version,
            "nccl": r0.nccl_version, "world": r0.world, "flops_per_rank_step": r0.flops,
            **{f.name: getattr(opts, f.name) for f in fields(opts) if f.name != "spec"}, "model": asdict(opts.spec)}
    variants = [{**asdict(row), "ranks": [asdict(rep.runs[i]) for rep in reports]} for i, row in enumerate(rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "variants": variants}, indent=1, default=str) + "\n", encoding="utf-8")


def write_png(path: Path, rows: Sequence[Summary], title: str) -> str:
    """Bar chart of median step time, whiskers min..max; returns what happened (for printing)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        return "PNG skipped: matplotlib is not installed (pip install -e '.[plot]')"
    done = [r for r in rows if r.reason is None]
    fig = Figure(figsize=(1.2 * len(done) + 2, 4), layout="tight")
    ax = fig.subplots()
    err = [[r.median_ms - r.min_ms for r in done], [r.max_ms - r.median_ms for r in done]]
    ax.bar([r.name for r in done], [r.median_ms for r in done], yerr=err, capsize=4, color="tab:blue")
    ax.set(ylabel="step time, ms (median; whiskers: min..max)", title=title)
    ax.tick_params(axis="x", labelrotation=30)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return f"wrote {path}"
