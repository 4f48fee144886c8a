"""benchmarks.overlap: interval arithmetic and overlap measures on synthetic and real profiler traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.overlap import (
    CPU_CATS,
    GLOO_COMM_PATTERNS,
    Event,
    StepSpan,
    analyze,
    classify,
    intersect_len,
    load_trace,
    main,
    profile_steps,
    subtract_len,
    union,
)

AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def kernel(name: str, start_ms: float, end_ms: float, stream: int, corr: int | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"stream": stream, "device": 0}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
            "ts": 1000.0 * start_ms, "dur": 1000.0 * (end_ms - start_ms), "args": args}


def cpu(
    name: str, start_ms: float, end_ms: float, cat: str = "user_annotation", corr: int | None = None
) -> dict[str, Any]:
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1,
            "ts": 1000.0 * start_ms, "dur": 1000.0 * (end_ms - start_ms), "args": args}


def write_trace(tmp_path: Path, events: list[dict[str, Any]], name: str = "trace.json") -> Path:
    path = tmp_path / name
    meta = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "gpu"}},
            {"ph": "i", "name": "Record Window End", "pid": 1, "tid": 1, "ts": 0.0, "s": "t"}]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": meta + events}))
    return path


# ---------------------------------------------------------------- intervals


def test_union_merges_overlapping_touching_and_drops_empty() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9), (8, 6)]) == [(0, 4), (5, 7)]
    assert union([]) == []


def test_intersect_and_subtract_lengths() -> None:
    a = [(0, 10), (20, 30)]
    b = [(5, 25), (28, 40), (6, 7)]  # overlapping inputs are unioned first
    assert intersect_len(a, b) == 5 + 5 + 2
    assert intersect_len(b, a) == 12
    assert subtract_len(a, b) == 20 - 12
    assert subtract_len(b, a) == 32 - 12
    assert intersect_len(a, []) == 0 and subtract_len([], a) == 0 and subtract_len(a, []) == 20


def test_classify_default_table() -> None:
    assert classify(AG) == "all_gather"
    assert classify(RS) == "reduce_scatter"
    assert classify(AR) == "other_comm"
    assert classify("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t") == "other_comm"
    assert classify(GEMM) == "compute"
    assert classify("triton_poi_fused_all_gather_copy_in_0") == "compute"  # prepares, does not communicate
    assert classify("gloo:all_gather", GLOO_COMM_PATTERNS) == "all_gather"
    assert classify("c10d::_reduce_scatter_base_", GLOO_COMM_PATTERNS) == "reduce_scatter"
    assert classify("c10d::allreduce_", GLOO_COMM_PATTERNS) == "other_comm"


# ---------------------------------------------------------------- measures


def test_known_overlap_on_three_streams(tmp_path: Path) -> None:
    path = write_trace(tmp_path, [kernel(GEMM, 0, 10, 7), kernel(AG, 2, 4, 20), kernel(RS, 9, 13, 21)])
    events = load_trace(path)
    assert len(events) == 3 and all(isinstance(e, Event) for e in events)
    assert {e.tid for e in events} == {7, 20, 21}
    r = analyze(events)
    assert len(r.steps) == 1 and r.steps[0].step is None
    m = r.median
    assert m.all_gather_hidden_by_compute == pytest.approx(1.0)
    assert m.reduce_scatter_hidden_by_compute == pytest.approx(0.25)
    assert m.exposed_comm_ms == pytest.approx(3.0)
    assert m.step_ms == pytest.approx(13.0)
    assert m.exposed_comm_share == pytest.approx(3.0 / 13.0)
    assert (m.all_gather_ms, m.reduce_scatter_ms, m.compute_ms, m.other_comm_ms) == pytest.approx((2, 4, 10, 0))
    assert m.all_gather_hidden_by_reduce_scatter == 0.0 and m.reduce_scatter_hidden_by_all_gather == 0.0
    assert r.overall == m


def test_all_gather_and_reduce_scatter_overlap_each_other(tmp_path: Path) -> None:
    # AG 0-4 and RS 2-10 share 2-4; compute 3-6 covers AG 3-4 and RS 3-6; an all-reduce 12-14 is exposed.
    events = load_trace(write_trace(tmp_path, [
        kernel(AG, 0, 4, 20), kernel(RS, 2, 10, 21), kernel(GEMM, 3, 6, 7), kernel(AR, 12, 14, 22)]))
    m = analyze(events).median
    assert m.all_gather_hidden_by_reduce_scatter == pytest.approx(2 / 4)
    assert m.reduce_scatter_hidden_by_all_gather == pytest.approx(2 / 8)
    assert m.all_gather_hidden_by_compute == pytest.approx(1 / 4)
    assert m.reduce_scatter_hidden_by_compute == pytest.approx(3 / 8)
    assert m.other_comm_ms == pytest.approx(2)
    # comm = 0-10 and 12-14 (12 ms), of which 3-6 runs under compute.
    assert m.exposed_comm_ms == pytest.approx(12 - 3)
    assert m.step_ms == pytest.approx(14)


def test_compute_on_two_streams_is_counted_once(tmp_path: Path) -> None:
    events = load_trace(write_trace(tmp_path, [
        kernel(GEMM, 0, 6, 7), kernel("elementwise_kernel", 4, 8, 8), kernel("void at::native::reduce", 5, 7, 8),
        kernel(AG, 5, 10, 20), kernel(AG, 6, 9, 24)]))  # AG kernels on two streams: union 5-10
    m = analyze(events).median
    assert m.compute_ms == pytest.approx(8)
    assert m.all_gather_ms == pytest.approx(5)
    assert m.all_gather_hidden_by_compute == pytest.approx(3 / 5)
    assert m.exposed_comm_ms == pytest.approx(2)


def test_empty_zero_length_and_no_communication(tmp_path: Path) -> None:
    empty = analyze(load_trace(write_trace(tmp_path, [], "empty.json")))
    assert len(empty.steps) == 1
    e = empty.median
    assert (e.step_ms, e.compute_ms, e.all_gather_ms, e.exposed_comm_ms) == (0, 0, 0, 0)
    assert e.exposed_comm_share is None and e.all_gather_hidden_by_compute is None
    assert e.reduce_scatter_hidden_by_all_gather is None

    # Zero-length kernels add no time; without communication every "hidden" share is None, not 1.0.
    zero = analyze(load_trace(write_trace(tmp_path, [
        kernel(GEMM, 1, 1, 7), kernel(AG, 2, 2, 20), kernel(GEMM, 0, 4, 7)], "zero.json"))).median
    assert zero.all_gather_ms == 0 and zero.compute_ms == pytest.approx(4)
    assert zero.all_gather_hidden_by_compute is None and zero.reduce_scatter_hidden_by_compute is None
    assert zero.exposed_comm_ms == 0 and zero.exposed_comm_share == 0


def test_two_profiler_steps_and_median(tmp_path: Path) -> None:
    # Step 1 (CPU 0-10): AG fully hidden. Step 2 (CPU 10-20): AG half hidden, and one AG kernel that the
    # GPU runs after the CPU span ended but that was launched (correlation 5) inside step 2.
    trace = [
        cpu("ProfilerStep#1", 0, 10), cpu("ProfilerStep#2", 10, 20),
        kernel(GEMM, 1, 5, 7), kernel(AG, 2, 4, 20),
        kernel(GEMM, 11, 13, 7), kernel(AG, 12, 14, 20),
        cpu("cudaLaunchKernel", 15, 15.1, cat="cuda_runtime", corr=5), kernel(AG, 21, 23, 20, corr=5),
        kernel(GEMM, 30, 31, 7),  # outside every step: ignored
    ]
    r = analyze(load_trace(write_trace(tmp_path, trace)))
    assert [s.step for s in r.steps] == [1, 2]
    s1, s2 = r.steps
    assert s1.all_gather_hidden_by_compute == pytest.approx(1.0)
    assert s2.all_gather_hidden_by_compute == pytest.approx(1 / 4)
    assert s1.exposed_comm_ms == pytest.approx(0) and s2.exposed_comm_ms == pytest.approx(3)
    assert (s1.step_ms, s2.step_ms) == pytest.approx((4, 12))
    assert r.median.step is None
    assert r.median.all_gather_hidden_by_compute == pytest.approx((1.0 + 0.25) / 2)
    assert r.median.exposed_comm_ms == pytest.approx(1.5)
    assert r.overall.all_gather_hidden_by_compute == pytest.approx(3 / 6)
    assert r.overall.compute_ms == pytest.approx(6)  # the kernel at 30 ms is in no step
    # steps=None: one whole-trace step including the stray kernel.
    whole = analyze(load_trace(write_trace(tmp_path, trace)), steps=None)
    assert len(whole.steps) == 1 and whole.median.compute_ms == pytest.approx(7)
    # Explicit spans.
    given = analyze(load_trace(write_trace(tmp_path, trace)), steps=[StepSpan(9, 0.0, 10_000.0)])  # microseconds
    assert [s.step for s in given.steps] == [9] and given.median.all_gather_ms == pytest.approx(2)


def test_cpu_predicate_and_gzip(tmp_path: Path) -> None:
    trace = [cpu("aten::mm", 0, 10, cat="cpu_op"), cpu("gloo:all_gather", 8, 12, cat="user_annotation")]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace}, f)
    events = load_trace(path)
    assert analyze(events).median.compute_ms == 0  # no device kernels by default
    m = analyze(events, comm_patterns=GLOO_COMM_PATTERNS, is_device=lambda e: e.cat in CPU_CATS).median
    assert m.all_gather_hidden_by_compute == pytest.approx(0.5)
    assert m.exposed_comm_ms == pytest.approx(2)


def test_to_dict_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path, [kernel(GEMM, 0, 10, 7), kernel(AG, 2, 4, 20), kernel(RS, 9, 13, 21)])
    out = tmp_path / "report.json"
    assert main([str(path), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| measure | median | overall | trace |")
    assert "| reduce_scatter_hidden_by_compute | 25.0% | 25.0% | 25.0% |" in table
    assert "| exposed_comm_ms | 3.000 |" in table
    d = json.loads(out.read_text())
    assert d == analyze(load_trace(path)).to_dict()
    assert d["median"]["all_gather_hidden_by_compute"] == 1.0 and len(d["steps"]) == 1


def test_profile_steps_real_cpu_profiler(tmp_path: Path) -> None:
    x = torch.randn(32, 32)

    def step() -> None:
        (x @ x).relu_().sum()

    path = profile_steps(step, steps=3, warmup=1, out_path=tmp_path / "sub" / "trace.json")
    assert path.exists()
    events = load_trace(path)
    assert any(e.name.startswith("aten::") for e in events)
    report = analyze(events)  # no device kernels on CPU: must not crash
    assert [s.step for s in report.steps] == [1, 2, 3]
    assert report.median.all_gather_hidden_by_compute is None and report.median.exposed_comm_ms == 0
    cpu_report = analyze(events, device_cats={"cpu_op"})
    assert cpu_report.median.compute_ms > 0 and cpu_report.median.all_gather_ms == 0
