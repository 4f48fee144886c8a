"""benchmarks.baselines: SimpleFSDP's compile settings and joint-graph tagging, and why each peer is not measured
on CPU (both need CUDA: see the reasons); world1_costs' snapshot replay. And the other peers, the ranks
(``fsdp_compile.safety.peers``): its hooks on the process last only while an ``FsdpGroups`` does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from benchmarks import baselines
from benchmarks.variants import unavailable_reason
from benchmarks.world1_costs import idle_breakdown, kernel_class, live_at_peak, per_step_counts

c10d = torch.ops._c10d_functional


def _gather_graph() -> fx.GraphModule:
    """``param -> cast -> all_gather -> wait -> slice -> mm`` and an all-gather of a computed value."""
    g = fx.Graph()
    param, x = g.placeholder("param"), g.placeholder("x")
    cast = g.call_function(torch.ops.prims.convert_element_type.default, (param, torch.bfloat16))
    gather = g.call_function(c10d.all_gather_into_tensor.default, (cast, 2, "0"))
    wait = g.call_function(c10d.wait_tensor.default, (gather,))
    narrow = g.call_function(torch.ops.aten.slice.Tensor, (wait, 0, 0, 4))
    y = g.call_function(torch.ops.aten.mm.default, (x, narrow))
    relu = g.call_function(torch.ops.aten.relu.default, (y,))
    act = g.call_function(c10d.all_gather_into_tensor.default, (relu, 2, "0"))
    act_wait = g.call_function(c10d.wait_tensor.default, (act,))
    g.output((act_wait,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_reshard_after_forward_tags_parameter_gathers_only() -> None:
    gm = baselines.reshard_after_forward_pass(_gather_graph())
    tagged = {n.target for n in gm.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE}
    assert tagged == {torch.ops.prims.convert_element_type.default, c10d.all_gather_into_tensor.default,
                      c10d.wait_tensor.default, torch.ops.aten.slice.Tensor}
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert "recompute" in gathers[0].meta and "recompute" not in gathers[1].meta  # an activation: left alone


def test_simple_fsdp_settings_are_torchtitans_auto_bucketing(monkeypatch: pytest.MonkeyPatch) -> None:
    options = baselines.simple_fsdp_inductor_options("cuda")
    assert options["reorder_for_peak_memory"] is False and options["allow_buffer_reuse"] is False
    assert options["reorder_for_compute_comm_overlap"] is False
    seen: dict[str, object] = {}
    import torch._inductor.fx_passes.overlap_scheduling as overlap

    monkeypatch.setattr(overlap, "schedule_overlap_bucketing", lambda gm, **kw: seen.update(kw, gm=gm))
    gm = _gather_graph()
    options["post_grad_custom_post_pass"](gm.graph)
    assert seen["gm"] is gm and seen["collective_bucketing"] is True and seen["insert_overlap_deps"] is True


def test_peers_report_why_they_do_not_run_on_cpu() -> None:
    cpu = torch.device("cpu")
    for name in baselines.PEERS:
        reason = unavailable_reason(name, 2, cpu)
        assert reason is not None and ("CUDA" in reason or "not installed" in reason), reason
    if importlib.util.find_spec("torchtitan") is not None:
        assert "Triton" in (baselines.peer_reason("simplefsdp", cpu) or "")
    with pytest.raises(ValueError, match="unknown peer"):
        baselines.peer_reason("deepspeed", cpu)


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs the bench extra (torchtitan)")
def test_simple_fsdp_file_loads_without_torchtitans_dependencies() -> None:
    module = baselines._simple_fsdp_module()
    assert callable(module.data_parallel) and module.__name__ == "_bench_simple_fsdp"


def test_live_at_peak_replays_allocations() -> None:
    frames = [{"filename": "/tmp/torchinductor_x/ab/cab.py", "line": 1, "name": "call"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames},
             {"action": "alloc", "addr": 2, "size": 50, "frames": []},
             {"action": "free_completed", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 3, "size": 20, "frames": []}]
    out = live_at_peak({"device_traces": [trace]}, baseline=2**20)
    assert out["peak_above_start_mib"] == pytest.approx(150 / 2**20) and out["baseline_mib"] == 1.0
    assert sorted(r["count"] for r in out["live_at_peak"]) == [1, 1]  # 100 B (generated code) and 50 B


def test_idle_breakdown_names_the_wait_and_the_gaps(tmp_path: Path) -> None:
    def x(name: str, cat: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
                "args": {} if corr is None else {"correlation": corr}}
    events = [x("ProfilerStep#1", "user_annotation", 0, 100),  # kernels at 10-30 and 50-60: waits 10 and 20
              x("aten::mm", "cpu_op", 1, 3), x("cudaLaunchKernel", "cuda_runtime", 2, 1, corr=1),
              x("guard_check", "cpu_op", 4, 30), x("cuLaunchKernel", "cuda_driver", 33, 1, corr=2),
              x("gemm", "kernel", 10, 20, tid=7, corr=1), x("triton_poi_0", "kernel", 50, 10, tid=7, corr=2)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = idle_breakdown(trace)
    assert out["before_first_kernel_ms"] == pytest.approx(0.01) and out["gpu_busy_ms"] == pytest.approx(0.03)
    assert out["between_kernels_ms"] == pytest.approx(0.02)
    assert out["largest_gaps"] == [{"ms_per_step": 0.02, "kernel_after": "triton_poi_0", "launched_by": "guard_check"}]


def test_allocator_counts_per_step() -> None:
    before = {"num_device_alloc": 10, "num_device_free": 2, "num_alloc_retries": 0}
    after = {"num_device_alloc": 30, "num_device_free": 12, "num_alloc_retries": 5, "num_sync_all_streams": 5}
    assert per_step_counts(before, after, 10) == {"num_device_alloc": 2.0, "num_device_free": 1.0,
                                                  "num_alloc_retries": 0.5, "num_sync_all_streams": 0.5}


def test_kernel_classes() -> None:
    assert kernel_class("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert kernel_class("nvjet_tst_256x128_64x4") == "matmul"
    assert kernel_class("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_class("triton_poi_fused_cat_0") == "copy"  # a pack
    assert kernel_class("triton_red_fused_gelu_sum_2") == "triton"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<8, GeluCUDAKernelImpl>") == "other"
    assert kernel_class("void at::native::_fused_adamw_kernel") == "optimizer"


def _hooks_follow_the_groups(rank: int, world: int) -> None:
    import sys
    import threading

    from fsdp_compile import FsdpGroups

    def beating() -> bool:
        return any(t.name == "fsdp_compile-heartbeat" and t.is_alive() for t in threading.enumerate())

    users_hook = sys.excepthook  # what the process had before any FsdpGroups
    first, second = FsdpGroups.create(), FsdpGroups.create()
    assert sys.excepthook is not users_hook and beating()
    first.destroy()
    assert sys.excepthook is not users_hook  # the second still needs it
    second.destroy()
    assert sys.excepthook is users_hook
    third = FsdpGroups.create()  # again, and a hook of someone else's over ours
    theirs = sys.excepthook
    sys.excepthook = lambda *a: theirs(*a)
    wrapper = sys.excepthook
    third.destroy()
    assert sys.excepthook is wrapper


def test_the_rank_hooks_last_as_long_as_the_groups() -> None:
    """(NOTE [peers]) ``sys.excepthook`` and the heartbeat are ours from ``FsdpGroups.create()`` to the
    last ``destroy()``, then the user's hook is back (a hook installed over ours meanwhile is kept). In a
    process of its own: groups another test left alive here would hold the hook."""
    from fsdp_compile.examples.launch import run_ranks

    run_ranks(_hooks_follow_the_groups, 1, timeout=120)
