"""Side-by-side training step time of fsdp-compile, FSDP2, SimpleFSDP, Megatron-FSDP and plain ``torch.compile``,
in one run (the peers: ``benchmarks.baselines``, ``pip install -e '.[bench]'``; unavailable ones say why).

Every variant trains its own copy of one model (same seed) on the same batch. On every rank: build all
variants; run each one's first step alone, timed as its *cold compile* (Inductor caches off:
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` unless set to 0); warm up; then ``rounds`` rounds in which each
variant runs ``steps`` timed steps in turn, so machine noise hits all alike. A step is forward, loss,
backward, ``AdamW.step``, ``zero_grad``; its time is the slowest rank's.

Per variant: median step time, global tokens/s, MFU (GPU: ``FlopCounterMode`` FLOPs of a step of the
unsharded model / time / peak), memory (*state*: this rank's params, gradients kept between steps and
optimizer state, by tensor storages; *resident*, GPU: what the allocator holds for the variant after its
build and first step, buffers no ``.grad`` shows included; *peak*: above what was allocated before the
variant's timed steps, by ``max_memory_allocated`` on GPU or by sampling the process RSS on CPU: the
transient working memory), cold compile time, and *comm wait*: on GPU the
exposed NCCL time (no compute kernel running) per step, from a profiler trace (``benchmarks.overlap``);
on CPU the share of the step the training thread is blocked (wall - its CPU time - its run-queue delay
from ``/proc/thread-self/schedstat``), i.e. in collective waits. (Not from a CPU profiler trace: FSDP2's
``Work.wait()`` is no profiled op there, so its waits would go uncounted.) On GPU every
``benchmarks.overlap`` measure of the profiled steps (all-gather / reduce-scatter hidden under compute and
under each other) goes to the JSON (``variants[i].ranks[r].overlap``). AdamW is fused for every variant
(``--optimizer foreach`` for the grouped kernels).

CPU:   python -m benchmarks.step_time --preset cpu             (spawns --ranks gloo ranks)
GPUs:  torchrun --nproc-per-node=8 -m benchmarks.step_time --preset gpu-llama-4096
       python -m benchmarks.step_time --preset h200-mlp --spawn 1
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before torch is imported, so that every compile is cold
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import argparse
import dataclasses
import shlex
import socket
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workloads import PRESETS, Batch, CudaPeak, ModelSpec, RssSampler, Runner, make_batch, train_flops
from benchmarks.variants import (DEFAULT_VARIANTS, OPTIMIZERS, VARIANTS, SharedGroups, build_variant,
                                 raise_recompile_limit, unavailable_reason)
from benchmarks.step_report import (RankReport, VariantRun, default_json_path, header_line, markdown_table,
                                    summarize, write_json, write_png)
from fsdp_compile.examples.launch import run_ranks

@dataclass(frozen=True)
class BenchOptions:
    """Everything one run needs; ``parse_args`` builds it from the command line."""

    spec: ModelSpec = PRESETS["cpu"]
    preset: str | None = "cpu"
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    warmup: int = 3
    rounds: int = 5
    steps: int = 5
    seed: int = 0
    profile_steps: int = 3
    device: str = "cpu"
    ranks: int = 2
    spawn: int | None = None
    peak_flops: float | None = None
    json_path: str | None = None
    png_path: str | None = None
    png: bool = True
    timeout_s: float = 3600.0
    optimizer: str = "fused"
    command: str = ""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def parse_args(argv: Sequence[str] | None = None) -> BenchOptions:
    """Command line -> options; model flags override the preset's values."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_time", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shapes (default: cpu, or none with --model)")
    p.add_argument("--model", choices=["llama", "mlp"])
    for name in ("dim", "layers", "heads", "vocab", "seq", "batch", "tokens"):
        p.add_argument(f"--{name}", type=int, help=f"model {name} (overrides the preset)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="parameter dtype of every variant")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated, from: " + ", ".join(VARIANTS) + " (default: all but the comparisons "
                        "*-bucketed, *-packed)")
    for flag, default, what in (("warmup", 3, "warm-up steps per variant"), ("rounds", 5, "rounds"),
                                ("steps", 5, "timed steps per variant per round"), ("seed", 0, "model seed"),
                                ("profile-steps", 3, "GPU: profiled steps per variant (0: skip)")):
        p.add_argument(f"--{flag}", type=int, default=default, help=what)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ranks", type=int, default=2, help="CPU: gloo ranks to spawn")
    p.add_argument("--spawn", type=int, help="GPU without torchrun: NCCL ranks to spawn (default 1)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (overrides the table)")
    p.add_argument("--json", help="results file (default: benchmarks/results/step_time-<preset>-<device>-w<N>.json)")
    p.add_argument("--png", help="bar chart (default: the JSON path with .png)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before spawned ranks are killed")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="fused", help="AdamW implementation of every variant")
    ns = p.parse_args(argv)
    preset = ns.preset or (None if ns.model else "cpu")
    spec = PRESETS[preset] if preset else ModelSpec(kind=ns.model)
    given = {k: getattr(ns, k) for k in ("dim", "layers", "heads", "vocab", "seq", "batch", "tokens", "dtype")}
    spec = replace(spec, **{k: v for k, v in given.items() if v is not None}, kind=ns.model or spec.kind)
    variants = tuple(v.strip() for v in ns.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if min(ns.rounds, ns.steps) < 1 or min(ns.warmup, ns.profile_steps) < 0:
        p.error("--rounds and --steps must be >= 1, --warmup and --profile-steps >= 0")
    device = ns.device if ns.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    return BenchOptions(
        spec=spec, preset=preset, variants=variants, warmup=ns.warmup, rounds=ns.rounds, steps=ns.steps,
        seed=ns.seed, profile_steps=ns.profile_steps, device=device, ranks=ns.ranks, spawn=ns.spawn,
        peak_flops=ns.peak_tflops * 1e12 if ns.peak_tflops else None, json_path=ns.json, png_path=ns.png,
        png=not ns.no_png, timeout_s=ns.timeout, optimizer=ns.optimizer, command=shlex.join(getattr(sys, "orig_argv", sys.argv)))


def _guarded(fn: Callable[[], Any]) -> str | None:
    """Run ``fn``; return the first error any rank met (all ranks then drop the variant alike), or ``None``."""
    error = None
    try:
        fn()
    except Exception as e:  # a variant that fails (e.g. on an older torch) is reported, not fatal
        error = f"failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _profiled_overlap(runner: Runner, spec: ModelSpec, batch: Batch, steps: int) -> dict[str, Any]:
    """GPU: the median overlap measures of ``steps`` profiled steps (``benchmarks.overlap``): exposed
    communication share, and the share of all-gather / reduce-scatter time hidden under compute and under
    each other."""
    from benchmarks.overlap import analyze, load_trace, profile_steps
    with tempfile.TemporaryDirectory() as tmp:
        path = profile_steps(lambda: runner.step(spec, batch), steps=steps, warmup=1, out_path=Path(tmp) / "t.json")
        return dataclasses.asdict(analyze(load_trace(path)).median)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


@dataclass
class _Measured:
    """Per variant, this rank's step times, blocked shares and transient memory peak."""

    times: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)
    peak: int | None = None
    late_graphs: int = 0
    left_behind: int = 0  # GPU: bytes its timed steps left allocated, the largest over the rounds (should be 0)


def _allocated(cuda: bool) -> int:
    if not cuda:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _build_all(names: Sequence[str], opts: BenchOptions, shared: SharedGroups,
               reasons: dict[str, str], resident: dict[str, int]) -> dict[str, Runner]:
    """Every available variant's model, each built from the same seed; failures go to ``reasons``; the
    device memory each build leaves allocated goes to ``resident`` (GPU)."""
    runners: dict[str, Runner] = {}
    for n in names:
        if n not in reasons:
            before = _allocated(opts.cuda)
            err = _guarded(lambda n=n: runners.__setitem__(
                n, build_variant(n, opts.spec, shared, opts.seed, optimizer=opts.optimizer)))
            if err:
                reasons[n] = err
            resident[n] = _allocated(opts.cuda) - before
    return runners


def _cold_steps(runners: dict[str, Runner], batch: Batch, opts: BenchOptions, reasons: dict[str, str],
                bar: Any, per_variant: int, resident: dict[str, int], cold_peak: dict[str, int]) -> dict[str, float]:
    """Each variant's first step (its compile), one variant at a time; a failed variant is dropped. What the
    step leaves allocated (optimizer state, persistent buffers) is added to ``resident``; the step's peak
    above the variant's own zero (what its build left allocated, plus the step's growth) goes to
    ``cold_peak`` (GPU)."""
    first: dict[str, float] = {}
    for n in list(runners):
        bar.set_description(f"first step {n}")
        before = _allocated(opts.cuda)
        if opts.cuda:
            torch.cuda.reset_peak_memory_stats()
        err = _guarded(lambda n=n: first.__setitem__(n, runners[n].timed_step(opts.spec, batch, opts.cuda)[0]))
        if opts.cuda:
            cold_peak[n] = resident[n] + torch.cuda.max_memory_allocated() - before
        resident[n] += _allocated(opts.cuda) - before
        if err:
            reasons[n] = err
            del runners[n]
        bar.update(per_variant if err else 1)
    return first


def _timed_rounds(runners: dict[str, Runner], batch: Batch, opts: BenchOptions, bar: Any) -> dict[str, _Measured]:
    """Warm-up, then ``rounds`` rounds in which every variant runs ``steps`` timed steps in turn.

    NOTE [one process, variants apart]: the variants alternate in one process, all of them built, so a
    step's memory is read relative to what was allocated before it (``max_memory_allocated`` is absolute).
    That is only sound if no variant's steps leave memory behind, which each round checks: bytes allocated
    after a variant's steps minus before go to the report, and the table warns where they are not 0
    (then compare those variants in processes of their own, as ``benchmarks.llama8b`` does)."""
    cuda = opts.cuda
    for n, runner in runners.items():
        bar.set_description(f"warm-up {n}")
        for _ in range(opts.warmup):
            runner.step(opts.spec, batch)
            bar.update()
    out = {n: _Measured() for n in runners}
    for r in range(opts.rounds):
        for n, runner in runners.items():
            bar.set_description(f"round {r + 1}/{opts.rounds} {n}")
            graphs, before = _graphs_compiled(), _allocated(cuda)
            with CudaPeak() if cuda else RssSampler() as probe:
                for _ in range(opts.steps):
                    wall, blk = runner.timed_step(opts.spec, batch, cuda)
                    out[n].times.append(wall)
                    out[n].blocked.append(blk)
                    bar.update()
            out[n].late_graphs += _graphs_compiled() - graphs
            left = _allocated(cuda) - before  # NOTE [one process, variants apart]
            out[n].left_behind = max(out[n].left_behind, left, key=abs)
            if probe.growth is not None:
                out[n].peak = max(out[n].peak or 0, probe.growth)
    return out


def _comm_shares(runners: dict[str, Runner], measured: dict[str, _Measured], batch: Batch, opts: BenchOptions,
                 bar: Any, overlaps: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """GPU: exposed-communication share from a profiled trace (every overlap measure goes to ``overlaps``);
    CPU: median blocked share of the timed steps."""
    if not opts.cuda:
        return {n: statistics.median(m.blocked) for n, m in measured.items()}
    shares: dict[str, float | None] = {}
    for n, runner in runners.items():
        bar.set_description(f"profile {n}")
        if opts.profile_steps:
            overlaps[n] = _profiled_overlap(runner, opts.spec, batch, opts.profile_steps)
        shares[n] = overlaps[n]["exposed_comm_share"] if n in overlaps else None
        bar.update(opts.profile_steps + 1)
    return shares


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def run_rank(rank: int, world: int, opts: BenchOptions) -> list[RankReport] | None:
    """Measure every variant on this rank (process group initialised); rank 0 returns all ranks' reports."""
    from tqdm import tqdm
    for noise in ("dynamo_pgo force disabled", ".*Profiler clears events"):
        warnings.filterwarnings("ignore", message=noise)
    cuda = opts.cuda
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    raise_recompile_limit(len(opts.variants))
    torch.compile(lambda x: (x * 2).sum())(torch.ones(4, device=device))  # one-time Inductor set-up
    batch = make_batch(opts.spec, seed=opts.seed + 1 + rank, device=device)
    shared = SharedGroups(device, world)
    reasons = {n: r for n in opts.variants if (r := unavailable_reason(n, world, device))}
    resident: dict[str, int] = {}
    runners = _build_all(opts.variants, opts, shared, reasons, resident)
    per_variant = 1 + opts.warmup + opts.rounds * opts.steps + (opts.profile_steps + 1) * cuda
    bar = tqdm(total=len(runners) * per_variant, disable=rank != 0, unit="step", desc="step_time")
    cold_peak: dict[str, int] = {}
    first = _cold_steps(runners, batch, opts, reasons, bar, per_variant, resident, cold_peak)
    measured = _timed_rounds(runners, batch, opts, bar)
    overlaps: dict[str, dict[str, Any]] = {}
    comm = _comm_shares(runners, measured, batch, opts, bar, overlaps)
    bar.close()
    runs = tuple(
        VariantRun(n, reason=reasons[n]) if n in reasons else
        VariantRun(n, first_step_s=first[n], step_s=tuple(measured[n].times), blocked=tuple(measured[n].blocked),
                   peak_bytes=measured[n].peak, state_bytes=runners[n].state_bytes(), comm_share=comm[n],
                   late_graphs=measured[n].late_graphs, state_parts=runners[n].state_parts(),
                   resident_bytes=resident[n] if cuda else None, overlap=overlaps.get(n),
                   whole_peak_bytes=max(cold_peak[n], resident[n] + (measured[n].peak or 0)) if cuda else None,
                   left_behind_bytes=measured[n].left_behind if cuda else None)
        for n in opts.variants)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    report = RankReport(rank, world, _device_name(device), socket.gethostname(), torch.__version__, nccl,
                        train_flops(opts.spec), runs)
    shared.destroy()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report)
    return gathered if rank == 0 else None


def report(reports: Sequence[RankReport], opts: BenchOptions) -> Path:
    """Print the header and table; write the JSON and PNG; return the JSON path."""
    rows = summarize(reports, opts)
    header = header_line(reports[0], opts)
    print(header + "\n\n" + markdown_table(rows, len(reports), opts.cuda))
    path = Path(opts.json_path) if opts.json_path else default_json_path(opts, reports[0].device_name, len(reports))
    write_json(path, header, rows, reports, opts)
    print(f"\nwrote {path}")
    if opts.png:
        png = Path(opts.png_path) if opts.png_path else path.with_suffix(".png")
        print(write_png(png, rows, f"{opts.preset or opts.spec.kind}, {reports[0].device_name}, world {len(reports)}"))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run under torchrun (``RANK`` set), or spawn NCCL (``--spawn``) or gloo (``--ranks``) ranks."""
    opts = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if opts.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if opts.cuda else "gloo")
        try:
            reports = run_rank(dist.get_rank(), dist.get_world_size(), opts)
        finally:
            dist.destroy_process_group()
    else:
        cuda = opts.cuda
        world = (opts.spawn or 1) if cuda else opts.ranks
        reports = run_ranks(run_rank, world, opts, timeout=opts.timeout_s, pg_timeout_s=900.0,
                            backend="nccl" if cuda else "gloo")[0]
    if reports is not None:
        report(reports, opts)
    return 0


if __name__ == "__main__":
    from benchmarks import step_time  # the importable module, so spawned ranks unpickle the same classes

    raise SystemExit(step_time.main())
