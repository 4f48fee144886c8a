"""The emulated world (fsdp_compile/emulate): its time model, its bookkeeping on CPU, its streams on a GPU.

The bookkeeping tests run anywhere: collectives on CPU tensors move their data at once and are counted.
The timing tests need CUDA (the emulated collectives are kernels): they run on the GPU machine and are
skipped on CPU-only machines (CI).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import FsdpGroups
from fsdp_compile.emulate import EmulatedTopology, init_emulated_world, ledger
from fsdp_compile.emulate.measure import exposed_seconds, timeline_of_trace
from fsdp_compile.inspection.hardware import HARDWARE, load_hardware
from tests.graph_utils import ThreeUnits, capture, collectives, shard_blocks_then_root

from fsdp_compile.passes.predicates import is_all_gather, is_reduce_scatter

H200 = HARDWARE["h200"]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="emulated collectives are timed by CUDA kernels")


@pytest.fixture
def world8() -> Iterator[EmulatedTopology]:
    topo = init_emulated_world(EmulatedTopology(world=8, hardware=H200))
    try:
        yield topo
    finally:
        dist.destroy_process_group()


# --- the time model --------------------------------------------------------------------------------


def test_a_collective_takes_the_ring_time_of_its_links() -> None:
    topo = EmulatedTopology(world=16, hardware=H200, hosts=2)
    full = 1 << 30
    within, across = list(range(8)), list(range(16))
    ring = lambda n, bw: H200.collective_latency + (n - 2) * H200.hop_latency + (n - 1) / n * full / bw  # noqa: E731
    assert topo.solo_seconds("all_gather", full, within) == pytest.approx(ring(8, H200.intra_node_busbw))
    assert topo.solo_seconds("reduce_scatter", full, across) == pytest.approx(ring(16, H200.inter_node_busbw))
    assert topo.solo_seconds("all_reduce", full, within) == pytest.approx(2 * ring(8, H200.intra_node_busbw))
    assert topo.solo_seconds("all_gather", full, [3]) == 0.0
    assert topo.spans_hosts([0, 8]) and not topo.spans_hosts([8, 15])


def test_the_measured_pair_of_h200s_is_reproduced_by_the_model() -> None:
    """The two-H200 microbenchmarks (NCCL 2.28): a 1 GiB all-gather alone 2.03 ms; with a 1 GiB
    reduce-scatter on a second communicator 3.24 ms for both; on one communicator 4.10 ms."""
    hw = load_hardware("h200", "benchmarks/calibration/h200x2.json")
    topo = EmulatedTopology(world=2, hardware=hw)
    ag = topo.solo_seconds("all_gather", 1 << 30, [0, 1])
    rs = topo.solo_seconds("reduce_scatter", 1 << 30, [0, 1])
    assert ag * 1e3 == pytest.approx(2.03, rel=0.05)
    assert (ag + rs) / topo.shared * 1e3 == pytest.approx(3.24, rel=0.05)  # each at half the links' shared rate
    assert (ag + rs) * 1e3 == pytest.approx(4.10, rel=0.05)  # one after the other


def test_a_world_that_does_not_divide_into_hosts_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the hosts"):
        EmulatedTopology(world=12, hardware=H200, hosts=8)


def test_exposed_time_is_communication_that_no_other_work_covers() -> None:
    comm = [(0.0, 4.0), (3.0, 6.0), (10.0, 11.0)]
    busy = [(1.0, 2.0), (5.0, 12.0)]
    assert exposed_seconds(comm, busy) == pytest.approx(1.0 + 3.0)  # [0,1) and [2,5)
    assert exposed_seconds(comm, []) == pytest.approx(7.0)
    # stream 7 is a communicator's: the copy before a kind's kernel is that collective's data
    events = [{"ph": "X", "cat": "kernel", "name": "elementwise_copy", "ts": 0, "dur": 1e6, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": "emulated_all_gather", "ts": 1e6, "dur": 3e6, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": "reduce_kernel", "ts": 5e6, "dur": 1e6, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": "emulated_reduce_scatter", "ts": 6e6, "dur": 1e6, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": "ampere_gemm", "ts": 1e6, "dur": 1e6, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9e6, "tid": 1}]
    comm_by_kind, other = timeline_of_trace(events)
    assert {k: sorted(v) for k, v in comm_by_kind.items()} == {"all_gather": [(0.0, 1.0), (1.0, 4.0)],
                                                                "reduce_scatter": [(5.0, 6.0), (6.0, 7.0)]}
    assert other == [(1.0, 2.0)]


# --- bookkeeping, without a GPU -------------------------------------------------------------------


def test_every_collective_of_our_graphs_reaches_the_emulated_backend(world8: EmulatedTopology) -> None:
    groups = FsdpGroups.create()
    torch.manual_seed(0)
    model = shard_blocks_then_root(ThreeUnits(), groups)
    ledger().clear()
    graphs = capture(model, torch.randn(4, 8))
    in_graphs = [n for gm in graphs.values() for n in collectives(gm)]
    assert ledger().calls["all_gather"] == sum(map(is_all_gather, in_graphs)) > 0
    assert ledger().calls["reduce_scatter"] == sum(map(is_reduce_scatter, in_graphs)) > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    groups.destroy()


def test_fsdp2_collectives_reach_the_emulated_backend(world8: EmulatedTopology) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ThreeUnits()
    mesh = init_device_mesh("cpu", (8,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds no parameters of its own: no unit of its own
    ledger().clear()
    model(torch.randn(4, 8)).sum().backward()
    # forward: one all-gather per layer; backward: one again per layer (each was resharded after its
    # forward; the root, which keeps its parameters, has none), and one reduce-scatter per layer
    assert ledger().calls["all_gather"] == 3 + 3
    assert ledger().calls["reduce_scatter"] == 3


def test_simple_fsdps_collectives_reach_the_emulated_backend(world8: EmulatedTopology) -> None:
    """SimpleFSDP reads each parameter as a ``Shard(0)`` DTensor redistributed to ``Replicate``: an
    all-gather forward, a reduce-scatter backward (the same calls, without torchtitan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (8,))
    local = torch.randn(2, 8, requires_grad=True)
    ledger().clear()
    full = DTensor.from_local(local, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    full.to_local(grad_placements=[Partial()]).sum().backward()  # each rank's gradient is a partial sum
    assert dict(ledger().calls) == {"all_gather": 1, "reduce_scatter": 1}
    assert full.to_local().shape == (16, 8)
    assert local.grad is not None and local.grad.shape == (2, 8)


def test_eager_collectives_move_rank_0s_data(world8: EmulatedTopology) -> None:
    x = torch.arange(4.0)
    out = torch.empty(32)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out.view(8, 4), x.expand(8, 4))
    rs = torch.empty(4)
    dist.reduce_scatter_tensor(rs, torch.ones(32), op=dist.ReduceOp.AVG)
    assert torch.equal(rs, torch.ones(4))
    t = torch.ones(3)
    dist.all_reduce(t)  # eight equal buffers summed
    assert torch.equal(t, torch.full((3,), 8.0))
    dist.barrier()
    objs: list[object] = [None] * 8
    dist.all_gather_object(objs, {"rank": 0})
    assert objs == [{"rank": 0}] * 8
    assert {"all_gather", "reduce_scatter", "all_reduce", "barrier"} <= set(ledger().calls)


def test_groups_of_a_two_host_mesh_know_which_span_hosts() -> None:
    topo = init_emulated_world(EmulatedTopology(world=16, hardware=H200, hosts=2))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("replicate", "shard"))
        replicate, shard = (dist.get_process_group_ranks(mesh.get_group(i)) for i in range(2))
        assert topo.spans_hosts(replicate) and not topo.spans_hosts(shard)
    finally:
        dist.destroy_process_group()


def test_a_second_world_is_refused_while_one_is_initialised(world8: EmulatedTopology) -> None:
    with pytest.raises(RuntimeError, match="destroy_process_group"):
        init_emulated_world(EmulatedTopology(world=2, hardware=H200))


# --- on a GPU: time and stream order ---------------------------------------------------------------


def _elapsed_ms(fn, n: int = 7) -> float:  # type: ignore[no-untyped-def]
    """Median device time of ``fn``'s work: a GEMM queued first keeps the GPU busy while the host launches
    ``fn``, so the host's launch time is not counted (as it is hidden in a training step)."""
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(n + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        for _ in range(4):
            x @ x
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


@GPU
def test_a_consumer_after_wait_starts_only_when_the_collective_has_ended(world8: EmulatedTopology) -> None:
    inp = torch.ones(1 << 24, dtype=torch.bfloat16, device="cuda")  # 32 MiB per rank, 256 MiB gathered
    out = torch.empty(8 << 24, dtype=torch.bfloat16, device="cuda")
    model_ms = world8.solo_seconds("all_gather", out.numel() * 2, list(range(8))) * 1e3
    ag = torch.ops._c10d_functional.all_gather_into_tensor
    consumer_ms = _elapsed_ms(lambda: out.sum())
    waited = _elapsed_ms(lambda: torch.ops._c10d_functional.wait_tensor(ag(inp, 8, dist.group.WORLD.group_name)).sum())
    assert waited >= model_ms + 0.95 * consumer_ms
    assert waited == pytest.approx(model_ms + consumer_ms, rel=0.05)
    not_waited = _elapsed_ms(lambda: (ag(inp, 8, dist.group.WORLD.group_name), inp.sum()))
    assert not_waited < 0.5 * model_ms  # the caller's stream did not wait
    torch.cuda.synchronize()


@GPU
def test_two_communicators_share_the_links_and_one_runs_one_at_a_time() -> None:
    hw = load_hardware("h200", "benchmarks/calibration/h200x2.json")
    topo = init_emulated_world(EmulatedTopology(world=2, hardware=hw))
    try:
        g_ag, g_rs = dist.new_group(), dist.new_group()
        n = 1 << 28  # 512 MiB of bf16 gathered, 512 MiB reduce-scattered
        inp, out = torch.ones(n // 2, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
        big, small = torch.ones(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")

        def both(rs_group: dist.ProcessGroup) -> None:
            a = dist.all_gather_into_tensor(out, inp, group=g_ag, async_op=True)
            b = dist.reduce_scatter_tensor(small, big, group=rs_group, async_op=True)
            a.wait()
            b.wait()

        solo = topo.solo_seconds("all_gather", 2 * n, [0, 1]) * 1e3
        assert _elapsed_ms(lambda: both(g_rs)) == pytest.approx(2 * solo / topo.shared, rel=0.05)
        assert _elapsed_ms(lambda: both(g_ag)) == pytest.approx(2 * solo, rel=0.05)
    finally:
        dist.destroy_process_group()


def test_variants_run_one_per_command_add_up_to_one_summary(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from fsdp_compile.examples.emulate import _write_summary

    path, args = tmp_path / "summary-w8.json", {"world": 8, "tokens": 8192, "variant": "fsdp-compile"}
    _write_summary(path, args, [{"label": "fsdp-compile", "median_ms": 1.0}])
    _write_summary(path, {**args, "variant": "fsdp2-compile"}, [{"label": "fsdp2-compile", "median_ms": 2.0}])
    _write_summary(path, args, [{"label": "fsdp-compile", "median_ms": 3.0}])
    assert {r["label"]: r["median_ms"] for r in json.loads(path.read_text())["runs"]} == \
        {"fsdp2-compile": 2.0, "fsdp-compile": 3.0}
    _write_summary(path, {**args, "tokens": 4096}, [{"label": "fsdp-compile", "median_ms": 4.0}])
    assert [r["median_ms"] for r in json.loads(path.read_text())["runs"]] == [4.0]  # other settings: a new table


def test_an_emulated_group_answers_torchs_device_queries(world8: EmulatedTopology) -> None:
    """Inductor's collective estimate (SimpleFSDP's overlap bucketing) asks a group for its default device,
    then whether its C++ backend estimates times: an emulated group has a device and says no (torch
    2.11 does not catch an error there); any other use of the missing backend raises."""
    group = dist.new_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert dist.distributed_c10d._get_pg_default_device(group) == torch.device(device)
    backend = group._get_backend(torch.device(device))
    assert backend.supports_time_estimate is False
    with pytest.raises(RuntimeError, match="no C\\+\\+ backend"):
        backend.supports_tensor_alloc(torch.device(device))


def test_backend_options_reach_each_variants_process() -> None:
    import argparse

    from fsdp_compile.examples.emulate import _argv, add_arguments, backend_options

    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args(["--world", "64", "--option", "bucket_alone_bytes=None", "--option", "prefetch=2",
                       "--no-root-reshard"])
    assert backend_options(ns.option) == {"bucket_alone_bytes": None, "prefetch": 2}
    child = p.parse_args(_argv(ns, "fsdp-compile", "r.json")[1:])
    assert backend_options(child.option) == {"bucket_alone_bytes": None, "prefetch": 2} and child.world == 64
    assert not child.root_reshard and p.parse_args(_argv(p.parse_args([]), "fsdp-compile", "r.json")[1:]).root_reshard
    assert not child.warm_cache and p.parse_args(_argv(p.parse_args(["--warm-cache"]), "fsdp-compile", "r.json")[1:]).warm_cache
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        backend_options(["prefetch"])
