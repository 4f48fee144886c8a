"""``explain``: the schedule and its predicted cost, without a GPU, on a fake process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_compile.explain import explain

from .graph_utils import ThreeUnits


def test_tables_for_a_module() -> None:
    """A user's module: one table per graph, the simulated rows of ``timeline.table`` (whose exact
    text tests/test_cost.py pins)."""
    torch.manual_seed(0)
    result = explain(ThreeUnits(), example_input=torch.randn(4, 8), world_size=2, hardware="h200")
    assert set(result.tables) == {"forward", "backward"}
    assert result.tables["forward"].count("all_gather_into_tensor") == 3
    assert result.tables["backward"].count("reduce_scatter_tensor") == 3
    assert result.summary["step_ms"] > 0 and result.summary["hardware"] == "h200"


def test_outputs_written(tmp_path: Path) -> None:
    result = explain("tiny", world_size=4, hardware="cpu", dtype=torch.float32, out_dir=tmp_path)
    names = {p.name for p in result.files}
    assert {"forward.txt", "backward.txt", "trace.json", "summary.json"} <= names
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    assert events and all(e["ph"] in ("X", "M") for e in events)
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"} >= {
        "compute", "all_gather", "reduce_scatter"}
    assert all(e["dur"] >= 0 and "ts" in e for e in events if e["ph"] == "X")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_estimate_is_deterministic() -> None:
    a = explain("tiny", world_size=8, hardware="h200").summary
    b = explain("tiny", world_size=8, hardware="h200").summary
    assert a == b


def test_more_bandwidth_exposes_less_communication() -> None:
    exposed = [
        explain("tiny", world_size=8, hardware="h200", calibration={"intra_node_busbw": bw}).summary["exposed_comm_ms"]
        for bw in (1e8, 1e9, 1e10, 1e11)
    ]
    assert exposed == sorted(exposed, reverse=True) and exposed[0] > exposed[-1]


def test_deeper_prefetch_holds_more_bytes() -> None:
    peaks = [explain("tiny", world_size=8, prefetch=d).summary["peak_bytes_in_flight"]["all_gather"] for d in (0, 1, 2)]
    assert peaks[0] < peaks[1] < peaks[2]


def test_extrapolation_matches_a_full_trace() -> None:
    """NOTE [periodic blocks]: 3 and 4 traced blocks, extended to 6, predict what tracing 6 gives."""
    cfg = {"world_size": 8, "hardware": "h200"}
    from fsdp_compile.models import PRESETS

    six = PRESETS["tiny"].with_(n_layers=6)
    full = explain(six, trace_layers=None, **cfg).summary
    extended = explain(six, trace_layers=4, **cfg).summary
    assert extended["extrapolated_from_layers"] == [3, 4]
    for key in ("step_ms", "compute_ms", "exposed_comm_ms"):
        assert extended[key] == pytest.approx(full[key], rel=0.02), key


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        explain("llama9")
    with pytest.raises(TypeError, match="example_input"):
        explain(ThreeUnits())


def test_auto_prefetch_follows_the_cost_model(groups: object) -> None:
    """Slow links: prefetching pays, "auto" prefetches. Instant links: nothing to hide, depth 0."""
    import dataclasses

    from fsdp_compile.autotune import choose
    from fsdp_compile.cost import HARDWARE

    from .graph_utils import capture, shard_blocks_then_root

    model = shard_blocks_then_root(ThreeUnits(), groups)  # type: ignore[arg-type]
    bucketed = capture(model, torch.randn(4, 8), disabled_passes=["prefetch", "reduce_scatter", "streams"])
    slow_compute = dataclasses.replace(HARDWARE["h200"], peak_flops_fp32=1e6, memory_bandwidth=1e6)
    instant_links = dataclasses.replace(slow_compute, collective_latency=0.0, intra_node_busbw=1e18)
    kw = {"prefetch": "auto", "prefetch_bytes": None, "schedule": "eager", "reduce_scatter_bytes": "auto"}
    assert choose(bucketed["forward"], slow_compute, **kw).prefetch >= 1
    assert choose(bucketed["forward"], instant_links, **kw).prefetch == 0
    cap = choose(bucketed["backward"], slow_compute, **kw).reduce_scatter_bytes
    assert cap is None or isinstance(cap, int)


def test_dump_dir_writes_each_graph(groups: object, tmp_path: Path) -> None:
    from .graph_utils import capture, shard_blocks_then_root

    capture(shard_blocks_then_root(ThreeUnits(), groups), torch.randn(4, 8), dump_dir=tmp_path,  # type: ignore[arg-type]
            hardware="h200")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith("forward_") and n.endswith(".rank0.txt") for n in names), names
    assert any(n.startswith("backward_") and n.endswith(".rank0.json") for n in names), names
    text = next(p for p in tmp_path.iterdir() if p.name.startswith("backward_") and p.suffix == ".txt").read_text()
    assert "reduce_scatter" in text and "estimated on h200" in text


SCRIPT = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from fsdp_compile import FsdpGroups, make_backend
from tests.graph_utils import ThreeUnits, shard_blocks_then_root
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = shard_blocks_then_root(ThreeUnits(), FsdpGroups.create())
torch.compile(model, backend=make_backend(inductor=False))(torch.randn(4, 8)).sum().backward()
"""


def test_torch_logs_artifact() -> None:
    """TORCH_LOGS=fsdp_schedule prints each compiled graph's table (the artifact is registered at
    torch import through the package's ``torch.backends`` entry point)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TORCH_LOGS": "fsdp_schedule", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fsdp-compile forward schedule" in done.stderr
    assert "fsdp-compile backward schedule" in done.stderr and "reduce_scatter" in done.stderr
