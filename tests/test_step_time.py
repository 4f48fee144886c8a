"""benchmarks.step_time: options and presets, statistics, table, JSON and PNG writers on fake measurements,
the RSS sampler; one slow end-to-end run on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import step_time as st
from benchmarks.workloads import (PRESETS, ModelSpec, RssSampler, loss_of, make_batch, peak_flops_for, read_rss_bytes,
                               run_delay_s, train_flops)
from benchmarks.variants import DEFAULT_VARIANTS, VARIANTS, SharedGroups, build_variant, own_forward, unavailable_reason

# --- options and presets -----------------------------------------------------------------------------


def test_defaults_are_the_cpu_preset() -> None:
    opts = st.parse_args([])
    assert opts.preset == "cpu" and opts.spec == PRESETS["cpu"]
    spec = opts.spec
    assert (spec.kind, spec.layers, spec.dim, spec.heads, spec.vocab, spec.seq, spec.batch, spec.dtype) == (
        "llama", 4, 256, 4, 512, 64, 4, "fp32")
    assert (opts.warmup, opts.rounds, opts.steps) == (3, 5, 5)
    assert opts.variants == DEFAULT_VARIANTS and opts.ranks == 2 and opts.png
    assert set(DEFAULT_VARIANTS) < set(VARIANTS) and "fsdp-compile-packed" not in DEFAULT_VARIANTS
    assert opts.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert shlex.split(opts.command) == list(getattr(sys, "orig_argv", sys.argv))  # this process's, quoted


def test_gpu_presets() -> None:
    mlp = st.parse_args(["--preset", "h200-mlp"]).spec
    assert (mlp.kind, mlp.dim, mlp.layers, mlp.tokens, mlp.dtype, mlp.tokens_per_rank) == (
        "mlp", 4096, 4, 8192, "bf16", 8192)
    small, big = PRESETS["gpu-llama-4096"], PRESETS["gpu-llama-8192"]
    assert (small.dim, small.heads, small.seq, big.dim, big.heads, big.seq) == (4096, 32, 2048, 8192, 64, 4096)
    assert small.dtype == big.dtype == "bf16" and small.kind == big.kind == "llama"


def test_model_flags_override_the_preset() -> None:
    opts = st.parse_args(["--preset", "cpu", "--dim", "128", "--layers", "2", "--dtype", "bf16"])
    assert opts.preset == "cpu"
    assert (opts.spec.dim, opts.spec.layers, opts.spec.dtype, opts.spec.heads) == (128, 2, "bf16", 4)
    mlp = st.parse_args(["--model", "mlp", "--dim", "64", "--tokens", "32"])
    assert mlp.preset is None and (mlp.spec.kind, mlp.spec.dim, mlp.spec.tokens) == ("mlp", 64, 32)
    assert mlp.spec.describe() == "mlp 4 blocks D64, 32 tokens/rank, fp32"


def test_variants_flag_and_bad_values() -> None:
    opts = st.parse_args(["--variants", "fsdp2-eager, fsdp-compile", "--rounds", "2", "--steps", "1",
                          "--no-png", "--peak-tflops", "100"])
    assert opts.variants == ("fsdp2-eager", "fsdp-compile") and (opts.rounds, opts.steps) == (2, 1)
    assert not opts.png and opts.peak_flops == 100e12
    for bad in (["--variants", "fsdp3"], ["--rounds", "0"], ["--warmup", "-1"], ["--preset", "nope"]):
        with pytest.raises(SystemExit):
            st.parse_args(bad)
    with pytest.raises(ValueError, match="multiple of heads"):
        ModelSpec(dim=30, heads=4)


def test_unavailable_variants() -> None:
    assert unavailable_reason("compile", 2) == "only at world size 1 (this run: 2)"
    assert unavailable_reason("fsdp-compile-keep", 4) is not None
    for name in ("compile", "fsdp-compile", "fsdp-compile-delayed", "fsdp2-compile"):
        assert unavailable_reason(name, 1) is None


def test_fsdp2_eager_needs_separate_reduce_scatter_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_separate_reduce_scatter_group", raising=False)
    reason = unavailable_reason("fsdp2-eager", 2)
    assert reason is not None and "set_separate_reduce_scatter_group" in reason
    assert unavailable_reason("fsdp2-eager-one-group", 2) is None


def test_peak_flops_table() -> None:
    assert peak_flops_for("NVIDIA H200", "bf16") == 989e12
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert peak_flops_for("AMD EPYC", "bf16") is None
    assert peak_flops_for("NVIDIA H200", "bf16", override=1e15) == 1e15


def test_mlp_flops_match_the_matmuls() -> None:
    d, layers, tokens = 8, 2, 16
    spec = ModelSpec("mlp", dim=d, layers=layers, tokens=tokens)
    forward = layers * 2 * (2 * tokens * d * 4 * d)
    # backward: weight and input grads (2x forward), except the input grad of the first matmul
    assert train_flops(spec) == 3 * forward - 2 * tokens * d * 4 * d


def test_variants_start_from_the_same_parameters_and_batch() -> None:
    spec = ModelSpec("llama", dim=16, layers=1, heads=2, vocab=32, seq=8, batch=2)
    shared = SharedGroups(torch.device("cpu"), 1)
    a, b = (build_variant("compile", spec, shared, seed=3) for _ in range(2))
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.state_bytes() == sum(p.numel() * 4 for p in a.model.parameters())
    x1, x2 = make_batch(spec, seed=5, device="cpu"), make_batch(spec, seed=5, device="cpu")
    assert all(torch.equal(u, v) for u, v in zip(x1, x2))
    mlp = ModelSpec("mlp", dim=8, layers=1, tokens=4, dtype="bf16")
    mlp_runner = build_variant("compile", mlp, shared, seed=0)
    loss = loss_of(mlp, mlp_runner.model, make_batch(mlp, seed=0, device="cpu"))
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert next(mlp_runner.model.parameters()).dtype == torch.bfloat16


class _Loop(torch.nn.Module):
    """A loop that graph-breaks (``breaks=True``) or not: Dynamo skips a frame with a break in a loop."""

    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = x + 1
            if self.breaks:
                torch._dynamo.graph_break()
        return x


@pytest.mark.parametrize("own", [False, True])
def test_own_forward_shields_a_variant_from_another_ones_frame_skip(own: bool) -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    breaking, clean = _Loop(breaks=True), _Loop(breaks=False)
    if own:
        own_forward(clean)
    first, second = CompileCounter(), CompileCounter()
    torch.compile(breaking, backend=first)(torch.ones(3))  # marks _Loop.forward's code "skip"
    assert torch.equal(torch.compile(clean, backend=second)(torch.ones(3)), torch.full((3,), 3.0))
    assert (first.frame_count, second.frame_count) == (0, 1 if own else 0)
    torch._dynamo.reset()


def test_run_delay_is_monotonic() -> None:
    a = run_delay_s()
    sum(range(100_000))
    assert 0.0 <= a <= run_delay_s()


# --- statistics, table, JSON, PNG on fake measurements ------------------------------------------------


def _reports(world: int = 2, device: str = "AMD EPYC") -> list[st.RankReport]:
    times = [(0.010, 0.012, 0.011), (0.011, 0.010, 0.013)]
    reports = []
    for rank in range(world):
        runs = (
            st.VariantRun("fsdp-compile", first_step_s=30.0 + rank, step_s=times[rank % 2], blocked=(0.2, 0.3, 0.4),
                          peak_bytes=(rank + 1) * 2**20, state_bytes=3 * 2**20, comm_share=0.1 * (rank + 1)),
            st.VariantRun("fsdp2-eager", reason="torch 2.11 has no FSDPModule.set_separate_reduce_scatter_group"),
            st.VariantRun("compile", first_step_s=20.0, step_s=(0.005, 0.006, 0.007), blocked=(0.0, 0.0, 0.0),
                          peak_bytes=None, state_bytes=6 * 2**20, comm_share=0.0),
        )
        reports.append(st.RankReport(rank, world, device, "host", "2.13.0", "2.21.5" if "H200" in device else None,
                                     flops=int(989e12 * 0.012), runs=runs))
    return reports


def test_summary_takes_the_slowest_rank_per_step() -> None:
    opts = st.BenchOptions()
    row, missing, compiled = st.summarize(_reports(), opts)
    assert row.step_s == (0.011, 0.012, 0.013)
    assert row.median_ms == pytest.approx(12.0) and (row.min_ms, row.max_ms) == pytest.approx((11.0, 13.0))
    assert row.tokens_per_s == pytest.approx(opts.spec.tokens_per_rank * 2 / 0.012)
    assert row.mfu is None  # CPU: no MFU
    assert (row.state_mib, row.peak_mib, row.cold_s) == (3.0, 2.0, 31.0)
    assert row.comm_share == pytest.approx(0.15)
    assert missing.reason and missing.step_s == () and compiled.peak_mib is None


def test_mfu_on_a_known_gpu() -> None:
    bf16 = st.BenchOptions(spec=PRESETS["h200-mlp"], device="cuda")
    assert st.summarize(_reports(device="NVIDIA H200"), bf16)[0].mfu == pytest.approx(1.0)  # 989 TFLOP / s
    fp32 = st.BenchOptions(spec=PRESETS["cpu"], device="cuda", peak_flops=2 * 989e12)  # the override wins
    assert st.summarize(_reports(device="NVIDIA H200"), fp32)[0].mfu == pytest.approx(0.5)


def test_markdown_table() -> None:
    rows = st.summarize(_reports(), st.BenchOptions())
    table = st.markdown_table(rows, world=2, cuda=False)
    lines = table.splitlines()
    assert lines[0].startswith("| variant | median ms | vs fsdp-compile | tokens/s | MFU |")
    assert "vs compile" not in lines[0]
    assert lines[2].startswith("| fsdp-compile | 12.0 | 1.00x |") and "| 31.0 | 15% |" in lines[2]
    assert lines[3].startswith("| fsdp2-eager | – | – |")
    assert "| compile | 6.0 | 0.50x |" in table
    assert "* fsdp2-eager: not measured: torch 2.11 has no" in table
    assert "transient working memory" in table and "blocked" in table
    world1 = st.markdown_table(rows, world=1, cuda=True)
    assert "| vs fsdp-compile | vs compile |" in world1 and "| 12.0 | 1.00x | 2.00x |" in world1
    assert "max_memory_allocated" in world1
    late = st.summarize([replace(r, runs=(replace(r.runs[0], late_graphs=2),)) for r in _reports()], st.BenchOptions())
    assert "* fsdp-compile: WARNING: 2 graphs compiled during its timed steps" in st.markdown_table(late, 2, False)


def test_header_and_paths() -> None:
    opts = st.BenchOptions(command="python -m benchmarks.step_time --preset cpu")
    header = st.header_line(_reports()[0], opts)
    assert "| host | AMD EPYC | torch 2.13.0 | world 2 | cpu: llama L4 D256" in header
    assert header.endswith("| python -m benchmarks.step_time --preset cpu") and "NCCL" not in header
    assert "| NCCL 2.21.5 |" in st.header_line(_reports(device="NVIDIA H200")[0], opts)
    assert st.default_json_path(opts, "AMD EPYC", 2).name == "step_time-cpu-cpu-w2.json"
    gpu = st.BenchOptions(spec=PRESETS["h200-mlp"], preset="h200-mlp", device="cuda")
    assert st.default_json_path(gpu, "NVIDIA H200", 1).name == "step_time-h200-mlp-nvidia-h200-w1.json"
    assert st.default_json_path(st.BenchOptions(preset=None), "x", 2).name == "step_time-llama-cpu-w2.json"


def test_json_keeps_every_raw_step_time(tmp_path: Path) -> None:
    reports, opts = _reports(), st.BenchOptions()
    rows = st.summarize(reports, opts)
    path = tmp_path / "sub" / "out.json"
    st.write_json(path, "header", rows, reports, opts)
    data = json.loads(path.read_text())
    assert data["meta"]["header"] == "header" and data["meta"]["world"] == 2
    assert data["meta"]["model"]["dim"] == 256 and data["meta"]["variants"] == list(DEFAULT_VARIANTS)
    first = data["variants"][0]
    assert first["name"] == "fsdp-compile" and first["step_s"] == [0.011, 0.012, 0.013]
    assert [r["step_s"] for r in first["ranks"]] == [[0.010, 0.012, 0.011], [0.011, 0.010, 0.013]]
    assert data["variants"][1]["reason"].startswith("torch 2.11")


def test_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = st.summarize(_reports(), st.BenchOptions())
    if importlib.util.find_spec("matplotlib") is not None:
        assert st.write_png(tmp_path / "a.png", rows, "title") == f"wrote {tmp_path / 'a.png'}"
        assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    assert "matplotlib is not installed" in st.write_png(tmp_path / "b.png", rows, "title")
    assert not (tmp_path / "b.png").exists()


# --- RSS sampler -------------------------------------------------------------------------------------


def test_read_rss_bytes(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  9999 kB\nVmRSS:\t    1234 kB\nThreads:\t1\n")
    assert read_rss_bytes(str(status)) == 1234 * 1024
    assert read_rss_bytes(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_rss_sampler_sees_a_transient_allocation() -> None:
    with RssSampler(interval_s=0.001) as sampler:
        big = torch.ones(32 * 2**20)  # 128 MiB, touched
        time.sleep(0.05)
        del big
    assert sampler.growth is not None and sampler.growth > 100 * 2**20
    with RssSampler() as idle:
        time.sleep(0.01)
    assert idle.growth is not None and idle.growth < 32 * 2**20


def test_rss_sampler_without_proc(tmp_path: Path) -> None:
    with RssSampler(status_path=str(tmp_path / "missing")) as sampler:
        pass
    assert sampler.growth is None


# --- end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_end_to_end_two_gloo_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line, in this process (its 2 ranks are spawned): JSON and table for two variants."""
    from benchmarks.variants import unavailable_reason

    # torch 2.11 (the GPUs' torch) has no separate reduce-scatter group for FSDP2: its one-group variant there
    fsdp2 = "fsdp2-eager" if unavailable_reason("fsdp2-eager", 2) is None else "fsdp2-eager-one-group"
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--model", "llama", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
            "--seq", "16", "--batch", "2", "--ranks", "2",
            "--variants", f"fsdp-compile,{fsdp2},simplefsdp,megatron-fsdp",
            "--rounds", "1", "--steps", "1", "--warmup", "1", "--json", str(out), "--no-png", "--timeout", "900"]
    assert st.main(argv) == 0
    stdout = capsys.readouterr().out
    data = json.loads(out.read_text())
    by_name = {v["name"]: v for v in data["variants"]}
    assert set(by_name) == {"fsdp-compile", fsdp2, "simplefsdp", "megatron-fsdp"}
    assert data["meta"]["world"] == 2 and data["meta"]["optimizer"] == "fused"
    for peer in ("simplefsdp", "megatron-fsdp"):  # both need CUDA; the table says why
        reason = by_name.pop(peer)["reason"]
        assert reason and ("CUDA" in reason or "not installed" in reason), reason
        assert f"* {peer}: not measured: " in stdout
    for v in by_name.values():
        assert v["reason"] is None and v["median_ms"] > 0 and v["cold_s"] > 0
        assert len(v["ranks"]) == 2 and all(t > 0 for r in v["ranks"] for t in r["step_s"])
    assert "| fsdp-compile |" in stdout and f"| {fsdp2} |" in stdout
