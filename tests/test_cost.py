"""The cost model (``fsdp_compile.inspection.cost``) and the schedule simulator (``fsdp_compile.inspection.timeline``).

Graphs are hand-built (meta tensors as ``meta["val"]``) or captured from ``ThreeUnits`` at world size
2 under a fake process group, without Inductor. Snapshot: ``EXPECTTEST_ACCEPT=1`` updates it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
from expecttest import TestCase
from torch import fx

from fsdp_compile import FsdpGroups
from fsdp_compile.inspection.cost import (
    HARDWARE,
    Hardware,
    collective_seconds,
    launch_seconds,
    load_hardware,
    matmul_efficiency,
    node_bytes,
    node_flops,
    node_seconds,
    optimizer_seconds,
    write_calibration,
)
from fsdp_compile.inspection.fusion import graph_seconds
from fsdp_compile.inspection.schedule import group_labels
from fsdp_compile.inspection.timeline import Timeline, _beside_collectives, chrome_trace, simulate, table, write_png
from fsdp_compile.inspection.topology import Links, Topology

from fsdp_compile.passes.predicates import op_name

from .graph_utils import ThreeUnits, capture, fake_process_group, shard_blocks_then_root

aten = torch.ops.aten
H200 = HARDWARE["h200"]
CALIBRATION = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration"


@functools.lru_cache(maxsize=None)
def three_units(prefetch: int = 1) -> tuple[dict[str, fx.GraphModule], dict[str, str]]:
    """Forward and backward graphs of ``ThreeUnits`` at world size 2, with group labels (cached)."""
    with fake_process_group(2):
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        model = shard_blocks_then_root(ThreeUnits(), groups)
        graphs = capture(model, torch.randn(4, 8), prefetch=prefetch)
        labels = group_labels(groups)
        groups.destroy()
    return graphs, labels


def one_op(target: object, *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32,
           out: tuple[int, ...] | None = None, extra: tuple[object, ...] = ()) -> fx.Node:
    """A graph ``op(placeholders..., *extra)`` whose nodes carry meta tensors of ``shapes``."""
    g = fx.Graph()
    args = []
    for i, shape in enumerate(shapes):
        p = g.placeholder(f"x{i}")
        p.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        args.append(p)
    node = g.call_function(target, (*args, *extra))
    node.meta["val"] = torch.empty(out if out is not None else shapes[0], dtype=dtype, device="meta")
    g.output(node)
    return node


# --- collective_seconds -------------------------------------------------------------------------

def test_collective_zero_at_world_one() -> None:
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert collective_seconds(kind, 1 << 30, 1, H200) == 0.0


def test_collective_grows_with_bytes_and_is_ring_shaped() -> None:
    small, big = (collective_seconds("all_gather", n, 8, H200) for n in (1 << 20, 1 << 30))
    assert small < big
    expected = H200.collective_latency + 6 * H200.hop_latency + 7 / 8 * (1 << 30) / H200.intra_node_busbw
    assert big == pytest.approx(expected)
    assert collective_seconds("reduce_scatter", 1 << 30, 8, H200) == pytest.approx(big)
    assert collective_seconds("all_reduce", 1 << 30, 8, H200) == pytest.approx(2 * big)


def test_collective_less_with_more_bandwidth() -> None:
    fast = dataclasses.replace(H200, intra_node_busbw=2 * H200.intra_node_busbw)
    assert collective_seconds("all_gather", 1 << 28, 4, fast) < collective_seconds("all_gather", 1 << 28, 4, H200)


def test_collective_intra_vs_inter_node() -> None:
    per_byte = [collective_seconds("reduce_scatter", 1 << 30, w, H200) for w in (8, 16)]
    assert per_byte[1] > 5 * per_byte[0]  # 16 ranks span two nodes: InfiniBand, not NVLink
    inter = H200.collective_latency + 14 * H200.hop_latency + 15 / 16 * (1 << 30) / H200.inter_node_busbw
    assert per_byte[1] == pytest.approx(inter)


def test_a_world_of_hosts_uses_the_inter_host_links() -> None:
    """64 ranks: 8 hosts of 8 GPUs by default (``ranks_per_node``), every full-world group crossing hosts;
    the same 64 on one host run at the intra-host bandwidth."""
    full = 1 << 30
    across = H200.collective_latency + 62 * H200.hop_latency + 63 / 64 * full / H200.inter_node_busbw
    within = H200.collective_latency + 62 * H200.hop_latency + 63 / 64 * full / H200.intra_node_busbw
    assert Topology.of(64, H200).hosts == 8
    assert collective_seconds("all_gather", full, 64, H200) == pytest.approx(across)
    assert collective_seconds("all_gather", full, 64, H200, hosts=8) == pytest.approx(across)
    assert collective_seconds("all_gather", full, 64, H200, hosts=1) == pytest.approx(within)
    assert Topology.of(12, H200).hosts == 2 and Topology.of(9, H200).hosts == 3  # hosts divide the world


def test_collectives_on_two_communicators_share_the_links() -> None:
    """Two collectives at once each advance at shared / 2 of their solo rate (NOTE [collective time]); on
    one communicator they run one after the other at full rate; alone, one runs at its solo time."""
    links = Links(shared=1.27)
    links.issue("ag", "all_gather", 2.0, at=0.0)
    links.issue("rs", "reduce_scatter", 4.0, at=0.0)
    # together until the all-gather is done (2 / 0.635 s), then the reduce-scatter alone at full rate
    assert links.interval("ag") == pytest.approx((0.0, 2 / 0.635))
    assert links.interval("rs") == pytest.approx((0.0, 2 / 0.635 + 2.0))
    links.issue("ag2", "all_gather", 1.0, at=10.0)  # after both ended: alone
    assert links.interval("ag2") == pytest.approx((10.0, 11.0))
    serial = Links(shared=1.27)
    serial.issue("ag", "comm", 2.0, at=0.0)
    serial.issue("rs", "comm", 4.0, at=1.0)
    assert serial.interval("rs") == pytest.approx((2.0, 6.0))
    with pytest.raises(ValueError, match="issue in time order"):
        serial.issue("late", "comm", 1.0, at=0.5)


def test_collective_unknown_kind() -> None:
    with pytest.raises(ValueError, match="all_gather"):
        collective_seconds("gather", 1, 2, H200)


# --- node_seconds -------------------------------------------------------------------------------

def test_mm_flops_at_dtype_rate_and_shape() -> None:
    """FLOPs over the dtype's peak times matmul_fraction and the shape factor m/(m+128) n/(n+128) k/(k+256)."""
    m, k, n = 4096, 8192, 2048
    mm = one_op(aten.mm.default, (m, k), (k, n), dtype=torch.bfloat16, out=(m, n))
    assert node_flops(mm) == 2 * m * n * k
    shape = (m / (m + 128)) * (n / (n + 128)) * (k / (k + 256))
    assert matmul_efficiency(m, n, k, H200) == pytest.approx(0.8 * shape)
    assert node_seconds(mm, H200) == pytest.approx(2 * m * n * k / (989e12 * 0.8 * shape))
    mm32 = one_op(aten.mm.default, (m, k), (k, n), out=(m, n))
    assert node_seconds(mm32, H200) == pytest.approx(2 * m * n * k / (67e12 * 0.8 * shape))
    slow_mm = dataclasses.replace(H200, op_fraction=(("mm", 0.4),))
    assert node_seconds(mm, slow_mm) == pytest.approx(node_seconds(mm, H200) * 0.8 / 0.4)
    # small dimensions fill fewer tiles and waves: (256 x 4096) @ (4096 x 1024) runs at 0.6 of the rate of 8192^3
    assert matmul_efficiency(256, 1024, 4096, H200) < 0.6 * matmul_efficiency(8192, 8192, 8192, H200)


def test_h200_preset_reproduces_its_kernel_measurements() -> None:
    """The preset against the H200 numbers it rests on (benchmarks/calibration/h200_kernels.json): every
    matmul over 0.1 ms within 20% (rms under 10%), each causal attention pass within 30%, AdamW within 10%."""
    data = json.loads((CALIBRATION / "h200_kernels.json").read_text())
    errors = []
    for r in data["matmul"]:
        if r["ms"] > 0.1:
            mm = one_op(aten.mm.default, (r["m"], r["k"]), (r["k"], r["n"]), dtype=torch.bfloat16, out=(r["m"], r["n"]))
            errors.append(node_seconds(mm, H200) * 1e3 / r["ms"] - 1)
    assert len(errors) > 80 and max(map(abs, errors)) < 0.2
    assert (sum(e * e for e in errors) / len(errors)) ** 0.5 < 0.1
    for r in (r for r in data["attention"] if r["backend"] == "default"):
        q = torch.empty(r["b"], r["h"], r["s"], r["d"], dtype=torch.bfloat16, device="meta")
        fwd, bwd = attention_nodes(q)
        assert node_seconds(fwd, H200) * 1e3 == pytest.approx(r["fwd_ms"], rel=0.3)
        assert node_seconds(bwd, H200) * 1e3 == pytest.approx(r["bwd_ms"], rel=0.3)
    foreach = next(r for r in data["adamw"] if r["world"] == 2 and not r["fused"])
    assert optimizer_seconds([(foreach["numel"], 2)], H200, "adamw") * 1e3 == pytest.approx(foreach["ms"], rel=0.1)


def attention_nodes(q: torch.Tensor, causal: bool = True) -> tuple[fx.Node, fx.Node]:
    """The forward and backward flash-attention nodes of SDPA on ``q`` (also as k and v), traced on meta."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, causal, out[6], out[7])
    gm = make_fx(fwd_bwd)(q, q.clone(), q.clone(), q.clone())
    names = [op_name(n) for n in gm.graph.nodes]
    nodes = list(gm.graph.nodes)
    return (nodes[names.index("_scaled_dot_product_flash_attention")],
            nodes[names.index("_scaled_dot_product_flash_attention_backward")])


def test_attention_costs_the_fused_kernel() -> None:
    """Flash attention: 4 b h s^2 d FLOPs forward (2.5x backward), half of them when causal, at the
    attention fractions of peak times s / (s + attention_half_seq); never the (s x s) scores' bytes."""
    b, h, s, d = 1, 32, 2048, 128
    q = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta")
    fwd, bwd = attention_nodes(q)
    full_fwd, _ = attention_nodes(q, causal=False)
    assert node_flops(full_fwd) == 4 * b * h * s * s * d and node_flops(fwd) == 2 * b * h * s * s * d
    assert node_flops(bwd) == 5 * b * h * s * s * d
    seq = s / (s + H200.attention_half_seq)
    assert node_seconds(fwd, H200) == pytest.approx(2 * b * h * s * s * d / (989e12 * 0.87 * seq))
    assert node_seconds(bwd, H200) == pytest.approx(5 * b * h * s * s * d / (989e12 * 0.79 * seq))


def test_view_costs_nothing() -> None:
    assert node_seconds(one_op(aten.view.default, (1024, 1024), out=(1 << 20,), extra=([1 << 20],)), H200) == 0.0
    assert node_seconds(one_op(aten.permute.default, (64, 32), out=(32, 64), extra=([1, 0],)), H200) == 0.0


def test_elementwise_is_memory_bound() -> None:
    add = one_op(aten.add.Tensor, (1 << 24,), (1 << 24,))
    assert node_flops(add) == 0
    expected = 3 * (1 << 24) * 4 / (H200.memory_bandwidth * H200.memory_fraction)
    assert node_seconds(add, H200) == pytest.approx(expected)
    tiny = one_op(aten.add.Tensor, (4,), (4,))
    assert node_seconds(tiny, H200) == H200.kernel_latency  # no kernel is faster than its launch


def test_embedding_reads_the_rows_it_gathers() -> None:
    g = fx.Graph()
    weight, idx = g.placeholder("weight"), g.placeholder("idx")
    weight.meta["val"] = torch.empty(32000, 4096, dtype=torch.bfloat16, device="meta")
    idx.meta["val"] = torch.empty(2048, dtype=torch.long, device="meta")
    emb = g.call_function(aten.embedding.default, (weight, idx))
    emb.meta["val"] = torch.empty(2048, 4096, dtype=torch.bfloat16, device="meta")
    assert node_bytes(emb) == 2 * 2048 * 4096 * 2 + 2048 * 8  # rows read, rows written, the indices


def test_fused_chain_moves_its_inputs_and_outputs_once() -> None:
    """rmsnorm-like ``x -> pow -> mean -> rsqrt -> mul(x) -> mul(w)`` fuses: x and w are read once and
    the result written once, in one kernel; costed alone, each op reads and writes a full tensor."""
    n, d = 2048, 4096
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"] = torch.empty(n, d, device="meta")
    w.meta["val"] = torch.empty(d, device="meta")

    def op(target: object, *args: object, shape: tuple[int, ...] = (n, d)) -> fx.Node:
        node = g.call_function(target, args)
        node.meta["val"] = torch.empty(shape, device="meta")
        return node

    sq = op(aten.pow.Tensor_Scalar, x, 2)
    mean = op(aten.mean.dim, sq, [-1], True, shape=(n, 1))
    inv = op(aten.rsqrt.default, mean, shape=(n, 1))
    out = op(aten.mul.Tensor, op(aten.mul.Tensor, x, inv), w)
    mm = op(aten.mm.default, out, op(aten.t.default, op(aten.view.default, w, [d, 1]), shape=(1, d)), shape=(n, n))
    g.output(mm)
    gm = fx.GraphModule(torch.nn.Module(), g)
    costs = graph_seconds(gm, H200)
    fused = sum(sec for node, sec in costs.items() if node is not mm)
    moved = (n * d + d + n * d) * 4  # x and w read, the result written
    assert fused == pytest.approx(moved / (H200.memory_bandwidth * H200.memory_fraction) + H200.kernel_latency)
    alone = sum(node_seconds(node, H200) for node in costs if node is not mm)
    assert alone > 2.5 * fused
    assert costs[mm] == node_seconds(mm, H200)


def test_optimizer_step_is_memory_bound() -> None:
    shards = [torch.empty(1000, 1000, dtype=torch.bfloat16, device="meta"), (500_000, 2)]
    expected = 21 * 1_500_000 * 2 / (H200.memory_bandwidth * H200.foreach_fraction)
    assert optimizer_seconds(shards, H200, "adamw") == pytest.approx(expected)
    assert optimizer_seconds(shards, H200, "sgd") < optimizer_seconds(shards, H200, "adam") < expected
    assert optimizer_seconds(shards, H200, "adamw-fused") == pytest.approx(expected * 7 / 21)  # one read, one write each
    with pytest.raises(ValueError, match="adamw"):
        optimizer_seconds(shards, H200, "lion")


# --- simulate -----------------------------------------------------------------------------------

def slow_compute(hw: Hardware = H200) -> Hardware:
    """Compute made slow (512 FLOP addmm = 512 us) so one unit's compute hides a 100 us all-gather; no
    kernel floor, no slowdown beside collectives, no shape factor: the arithmetic below stays exact."""
    return dataclasses.replace(hw, peak_flops_fp32=1e6, matmul_fraction=1.0, collective_latency=100e-6,
                               kernel_latency=0.0, overlap_slowdown=0.0, matmul_half_mn=0, matmul_half_k=0)


def test_simulate_is_deterministic() -> None:
    graphs, _ = three_units()
    for gm in graphs.values():
        assert simulate(gm, H200) == simulate(gm, H200)


def test_more_bandwidth_exposes_less() -> None:
    graphs, _ = three_units()
    for gm in graphs.values():
        exposed = [simulate(gm, dataclasses.replace(H200, intra_node_busbw=bw)).exposed_comm_seconds
                   for bw in (1e6, 1e9, 1e12, 1e15)]
        assert exposed == sorted(exposed, reverse=True) and exposed[0] > exposed[-1]


def test_prefetch_hides_all_gathers_and_holds_more_bytes() -> None:
    hw = slow_compute()
    none, _ = three_units(prefetch=0)
    one, _ = three_units(prefetch=1)
    t0, t1 = simulate(none["forward"], hw), simulate(one["forward"], hw)
    # No prefetch: every all-gather is waited in full. Prefetch 1: only the first one.
    assert t0.exposed_comm_seconds == pytest.approx(3 * 100e-6, rel=1e-3)
    assert t1.exposed_comm_seconds == pytest.approx(100e-6, rel=1e-3)
    assert t1.step_seconds < t0.step_seconds
    assert t1.in_flight["all_gather"] > t0.in_flight["all_gather"]
    assert simulate(one["backward"], hw).exposed_comm_seconds < simulate(none["backward"], hw).exposed_comm_seconds


def test_compute_beside_a_collective_runs_slower() -> None:
    """``overlap_slowdown``: compute that runs while a collective is in flight takes 1 + s times as long."""
    graphs, _ = three_units(prefetch=1)
    base = slow_compute()
    plain, slowed = (simulate(graphs["forward"], dataclasses.replace(base, overlap_slowdown=s)) for s in (0.0, 0.5))
    assert slowed.compute_seconds > plain.compute_seconds
    # the extra time is half of the compute that overlaps a collective, at most half of all compute
    assert slowed.compute_seconds - plain.compute_seconds <= 0.5 * plain.compute_seconds + 1e-12
    assert _beside_collectives(0.0, 1.0, [(0.0, 0.5)], 1.0) == pytest.approx(1.25)  # 0.25 of work beside it
    assert _beside_collectives(0.0, 1.0, [(2.0, 3.0)], 1.0) == 1.0  # a later collective: no effect


def _overlaps(tl: Timeline) -> bool:
    comm = sorted((s for s in tl.spans if s.stream != "compute"), key=lambda s: s.start)
    return any(b.start < a.end for a, b in zip(comm, comm[1:]))


def test_shared_comm_stream_serialises() -> None:
    graphs, _ = three_units()
    bwd = graphs["backward"]
    hw = dataclasses.replace(H200, collective_latency=1e-3)
    separate = simulate(bwd, hw)
    assert {"all_gather", "reduce_scatter"} <= set(separate.comm_seconds)
    assert _overlaps(separate)  # unit 2's reduce-scatter runs beside unit 1's all-gather
    launches = [n for n in bwd.graph.nodes if n.meta.get("fsdp", {}).get("stream") in ("all_gather", "reduce_scatter")]
    saved = [n.meta["fsdp"]["stream"] for n in launches]
    try:
        for n in launches:
            n.meta["fsdp"]["stream"] = "comm"
        shared = simulate(bwd, hw)
    finally:
        for n, s in zip(launches, saved):
            n.meta["fsdp"]["stream"] = s
    assert set(shared.comm_seconds) == {"comm"} and not _overlaps(shared)
    assert shared.step_seconds > separate.step_seconds
    # one communicator: each collective at its solo time; two: those side by side share the links
    topology = Topology.of(2, hw)
    assert shared.comm_seconds["comm"] == pytest.approx(sum(launch_seconds(n, topology) for n in launches))
    assert sum(separate.comm_seconds.values()) > shared.comm_seconds["comm"]


def test_summary() -> None:
    graphs, _ = three_units()
    s = simulate(graphs["forward"], slow_compute()).summary()
    assert s["exposed_comm_pct"] == pytest.approx(100 * s["exposed_comm_seconds"] / s["step_seconds"])
    assert s["peak_bytes_in_flight"] == {"all_gather": 576, "reduce_scatter": 0}


# --- outputs ------------------------------------------------------------------------------------

def test_chrome_trace_is_valid() -> None:
    graphs, _ = three_units()
    timelines = {name: simulate(gm, H200) for name, gm in graphs.items()}
    trace = json.loads(json.dumps(chrome_trace(timelines)))
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "M"}
    procs = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(procs) == {"forward", "backward"}
    threads = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(threads) == {(procs["forward"], "compute"), (procs["forward"], "all_gather"),
                            (procs["backward"], "compute"), (procs["backward"], "all_gather"),
                            (procs["backward"], "reduce_scatter")}
    assert len(set(threads.values())) == 3
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] > 0 and e["ts"] >= 0 and (e["pid"], e["tid"]) in {(p, t) for (p, _), t in threads.items()}


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    graphs, _ = three_units()
    path = tmp_path / "timeline.png"
    write_png({name: simulate(gm, H200) for name, gm in graphs.items()}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class TableTest(TestCase):
    def test_three_units_forward_h200(self) -> None:
        graphs, labels = three_units()
        fwd = graphs["forward"]
        # Unit 1's all-gather queues behind unit 0's on the all-gather stream. On this tiny model every
        # kernel takes the least a kernel takes (3 us), 1.2x that beside a collective: unit 0's wait is
        # exposed in full (15 us collective latency), unit 1's is hidden behind unit 0's compute.
        self.assertExpectedInline(table(fwd, simulate(fwd, H200), labels), """\
order  node                      unit  collective  group  stream      bytes  est. start (us)  est. end (us)
    0  all_gather_into_tensor    0     all_gather  ag     all_gather    288            0.000         15.000
    1  all_gather_into_tensor_1  1     all_gather  ag     all_gather    288           15.000         30.001
    2  wait_tensor               0     all_gather  ag     compute                      0.000         15.000
    3  unpack (3 nodes)          0     all_gather  ag     compute                     15.000         18.600
    4  addmm relu (3 nodes)                               compute                     18.600         25.800
    5  all_gather_into_tensor_2  2     all_gather  ag     all_gather    288           30.001         45.001
    6  wait_tensor_1             1     all_gather  ag     compute                     25.800         30.001
    7  unpack (3 nodes)          1     all_gather  ag     compute                     30.001         33.601
    8  addmm relu (3 nodes)                               compute                     33.601         40.801
    9  wait_tensor_2             2     all_gather  ag     compute                     40.801         45.001
   10  unpack (3 nodes)          2     all_gather  ag     compute                     45.001         48.001
   11  addmm relu le (4 nodes)                            compute                     48.001         57.001""")


# --- load_hardware ------------------------------------------------------------------------------

def test_load_hardware_presets() -> None:
    assert load_hardware() is H200
    assert load_hardware("cpu").name == "cpu" and load_hardware("h100").memory_bandwidth == 3.35e12
    with pytest.raises(ValueError, match="h200"):
        load_hardware("tpu")


def test_calibration_from_dict_and_file(tmp_path: Path) -> None:
    hw = load_hardware("h200", {"intra_node_busbw": 300e9, "op_fraction": {"mm": 0.7}})
    assert hw.intra_node_busbw == 300e9 and hw.fraction_of("mm", 0.0) == 0.7
    assert hw.memory_bandwidth == H200.memory_bandwidth  # the rest from the preset
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"collective_latency": 25e-6}))
    assert load_hardware("h100", path).collective_latency == 25e-6
    write_calibration(hw, path)
    assert load_hardware("cpu", path) == hw
    example = Path(__file__).parent.parent / "benchmarks" / "calibration" / "example.json"
    assert load_hardware("h200", example).name == "h200-measured"


def test_calibration_rejects_unknown_and_bad_fields() -> None:
    with pytest.raises(ValueError, match="intra_node_busbw"):  # the message lists valid fields
        load_hardware("h200", {"nvlink_bw": 1.0})
    with pytest.raises(ValueError, match="matmul_fraction"):
        load_hardware("h200", {"matmul_fraction": 1.5})
