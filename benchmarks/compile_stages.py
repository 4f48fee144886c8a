"""One cold-compile measurement, in the fresh process it runs in: ``python -m benchmarks.compile_time --child``.

The variants, how each prepares the model, the first training step timed by stage from torch.compile's
own timing table, and what the garbage collector took meanwhile. ``benchmarks/compile_time.py`` runs
these children in rounds and summarises them (its docstring says what each stage holds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

STAGES = ("dynamo", "aot", "partition", "passes", "agreement", "inductor", "kernels", "other")

# name -> (how the model is prepared, make_backend options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "compile": ("plain", {}),
    "fsdp-compile": ("fsdp", {}),  # the default: identical blocks outlined (NOTE [outlined units])
    "fsdp-compile-whole": ("fsdp", {"outline": False}),  # one whole-model graph, every block inline
    "fsdp-compile-stacked": ("stacked", {}),  # the blocks as one BlockStack: traced once (NOTE [stacked blocks])
    "fsdp2-compile": ("fsdp2", {}),
    # torchtitan's SimpleFSDP under Inductor's overlap bucketing (benchmarks/baselines.py; CUDA only)
    "simplefsdp": ("simplefsdp", {}),
}
DEFAULT_VARIANTS = ("compile", "fsdp-compile", "fsdp-compile-whole", "fsdp2-compile")


def stages_from(metrics: dict[str, float], total: float) -> dict[str, float]:
    """Split ``total`` seconds of a first step into :data:`STAGES` from torch.compile's timing table."""
    g = metrics.get
    kernels = g("compile_file", 0.0) + g("async_compile.wait", 0.0) + g("async_compile.precompile", 0.0)
    if "fsdp.partition" in metrics:
        partition = g("fsdp.partition", 0.0)
    else:
        partition = g("_recursive_joint_graph_passes", 0.0) + g("min_cut_rematerialization_partition", 0.0)
    out = {
        "dynamo": g("_compile.compile_inner", 0.0) - g("OutputGraph.call_user_compiler", 0.0),
        "aot": g("aot_collect_metadata", 0.0) + g("aot_trace_joint_graph", 0.0),
        "partition": partition,
        "passes": g("fsdp.passes", 0.0) + g("fsdp.outline", 0.0),
        "agreement": g("fsdp.agreement", 0.0),
        "inductor": g("compile_fx_inner", 0.0) - kernels,
        "kernels": kernels,
    }
    out["other"] = total - sum(out.values())
    return out




def _init_group(device: str, world: int) -> None:
    """NCCL at world 1 on a GPU; else a fake process group of ``world`` ranks (CPU, or a GPU standing for
    rank 0 of ``world``: every variant then compiles the collectives of that world, which move no data)."""
    import torch.distributed as dist

    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    if device == "cuda" and world == 1:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _prepare(variant: str, model: Any, device: str, world: int) -> Any:
    import torch

    how, backend_kw = VARIANTS[variant]
    if how == "plain":
        return torch.compile(model)
    if how in ("fsdp2", "simplefsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        from benchmarks.baselines import build_simple_fsdp

        mesh = init_device_mesh(device, (world,))
        if how == "simplefsdp":
            return build_simple_fsdp(model, mesh)
        for block in model.layers:
            fsdp2_fully_shard(block, mesh=mesh)
        fsdp2_fully_shard(model, mesh=mesh)
        return torch.compile(model)
    from fsdp_compile import FsdpGroups, fully_shard, make_backend

    from benchmarks.workloads import stack_blocks

    groups = FsdpGroups.create()
    for block in [stack_blocks(model)] if how == "stacked" else model.layers:
        fully_shard(block, groups=groups)
    fully_shard(model, groups=groups)
    kw = dict(backend_kw)
    if device == "cuda" and world == 1:
        kw["elide_single_rank"] = False  # world 1 compiles the collectives of world N
    return torch.compile(model, backend=make_backend(**kw))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one variant at one depth in this (fresh) process; the result as a JSON-able dict."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from benchmarks.workloads import ModelSpec, build_model, loss_of, make_batch
    from fsdp_compile._compat import compile_time_metrics

    device = args.device
    clock = time.perf_counter
    if args.clock == "cpu":
        # NOTE [CPU clock]: on a shared machine, wall time measures the neighbours. Compiling is one
        # thread's work (kernels aside, which are cached on CPU), so that thread's CPU time is timed
        # instead: torch.compile's own table reads time.time_ns, which is pointed at the thread clock.
        time.time_ns = time.thread_time_ns
        clock = time.thread_time
    _init_group(device, args.world)
    x = torch.ones(8, device=device, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum())(x).backward()  # one-time set-up, not counted
    torch._dynamo.reset()
    spec = ModelSpec("llama", dim=args.dim, layers=args.layers, heads=args.heads, vocab=args.vocab, seq=args.seq,
                     batch=args.batch, dtype=args.dtype)
    torch.manual_seed(0)
    model = build_model(spec, device)
    forward = _prepare(args.variant, model, device, args.world)
    batch = make_batch(spec, seed=1, device=device)
    before = compile_time_metrics()
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    from fsdp_compile.compiler.backend import observe_graphs

    # Observing the compiled graphs bypasses AOTAutograd's cache (NOTE [warm start]): not on warm starts.
    warm_start = os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE") == "1"
    collector = _CollectorClock(clock)
    t0, w0 = clock(), time.perf_counter()
    with contextlib.nullcontext([]) if warm_start else observe_graphs() as seen, collector:
        loss_of(spec, forward, batch).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    total, wall = clock() - t0, time.perf_counter() - w0
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    after = compile_time_metrics()
    schedule = {kind: _collectives(gm) for kind, gm in seen}
    metrics = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}
    graphs = int(counters["stats"]["unique_graphs"])
    for _ in range(2):  # later steps must not compile again
        loss_of(spec, forward, batch).backward()
    late = int(counters["stats"]["unique_graphs"]) - graphs
    step_ms = []
    for _ in range(args.steps):  # forward + backward only: the compiled code's speed, no optimizer
        if device == "cuda":
            torch.cuda.synchronize()
        s0 = time.perf_counter()
        loss_of(spec, forward, batch).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - s0) * 1e3)
    dist.destroy_process_group()
    return {"variant": args.variant, "layers": args.layers, "total_s": total, "wall_s": wall, "clock": args.clock,
            "stages": stages_from(metrics, total), "step_ms": step_ms, "schedule": schedule,
            "graphs": graphs, "late_graphs": late, "metrics": metrics, "gc": collector.summary(),
            "aot_cache": {k: int(v) for k, v in counters["aot_autograd"].items() if "autograd_cache" in k}}



class _CollectorClock:
    """Time Python's garbage collector spends inside the ``with`` block, on ``clock`` (``gc.callbacks``):
    its share of the compile, included in the stages it interrupted, and its collections by generation."""

    def __init__(self, clock: Any) -> None:
        self.clock, self.seconds, self.collections, self._start = clock, 0.0, [0, 0, 0], 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = self.clock()
        else:
            self.seconds += self.clock() - self._start
            self.collections[info["generation"]] += 1

    def __enter__(self) -> _CollectorClock:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "collections": self.collections}


def _collectives(gm: Any) -> dict[str, int]:
    """How many all-gathers, reduce-scatters and subgraph calls a scheduled graph holds, its nodes and its
    outputs (a forward's: the user's and the saved tensors)."""
    import torch

    from fsdp_compile.passes.predicates import is_all_gather, is_reduce_scatter

    nodes = list(gm.graph.nodes)
    return {"all_gather": sum(map(is_all_gather, nodes)), "reduce_scatter": sum(map(is_reduce_scatter, nodes)),
            "invoke_subgraph": sum(n.target is torch.ops.higher_order.invoke_subgraph for n in nodes),
            "nodes": len(nodes), "outputs": len(gm.graph.find_nodes(op="output")[0].args[0])}
