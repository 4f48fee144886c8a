"""``explain``: the schedule and its predicted cost, without a GPU, on a fake process group."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from expecttest import TestCase

from fsdp_compile import MixedPrecisionPolicy
from fsdp_compile.__main__ import main as cli
from fsdp_compile.examples.explain import Explanation, explain
from fsdp_compile.inspection.logs import logs_on_rank, schedule_logged
from fsdp_compile.examples.models import PRESETS, ModelConfig
from fsdp_compile.inspection.cost import HARDWARE, collective_bytes, collective_seconds
from fsdp_compile.passes.predicates import collective_kind, is_collective

from .graph_utils import ThreeUnits

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def tiny(world_size: int = 8, **kw: object) -> Explanation:
    """``explain("tiny")`` (cached: several tests read one trace)."""
    return explain("tiny", world_size=world_size, **kw)


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
    # one naming of groups: the tables' labels are the trace's
    assert {e["args"]["group"] for e in events if e["ph"] == "X" and "group" in e["args"]} == {"ag", "rs"}
    assert " ag " in (tmp_path / "forward.txt").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_estimate_is_deterministic() -> None:
    assert explain("tiny", world_size=8).summary == tiny().summary


def test_attention_is_traced_as_the_fused_kernel() -> None:
    """On a GPU preset SDPA becomes the flash kernel's forward and backward ops (no materialised scores);
    for the CPU preset it stays as PyTorch traces it on a CPU (the math path)."""
    gpu = tiny()
    for kind, op in (("forward", "_scaled_dot_product_flash_attention"),
                     ("backward", "_scaled_dot_product_flash_attention_backward")):
        code = gpu.graphs[kind].code
        assert f"aten.{op}.default" in code and "aten.bmm" not in code, kind
    assert gpu.summary["attention"] == "fused"
    cpu = explain("tiny", world_size=8, hardware="cpu")
    assert "flash_attention" not in cpu.graphs["forward"].code and "aten.bmm" in cpu.graphs["forward"].code


def test_optimizer_step_is_part_of_the_step() -> None:
    with_adamw, without = tiny().summary, tiny(optimizer=None).summary
    assert with_adamw["optimizer_ms"] > 0 and without["optimizer_ms"] == 0
    assert with_adamw["step_ms"] == pytest.approx(without["step_ms"] + with_adamw["optimizer_ms"])
    assert tiny().timelines["optimizer"].spans[0].name.startswith("adamw.step")


def test_more_bandwidth_exposes_less_communication() -> None:
    slow = explain("tiny", world_size=8, calibration={"intra_node_busbw": 1e8}).summary["exposed_comm_ms"]
    assert slow > 10 * tiny().summary["exposed_comm_ms"]


def test_deeper_prefetch_holds_more_bytes() -> None:
    peaks = [tiny(prefetch=d).summary["peak_bytes_in_flight"]["all_gather"] for d in (0, 1, 2)]
    assert peaks[0] < peaks[1] < peaks[2]


def _collective_bytes(result: Explanation, kind: str) -> int:
    return sum(collective_bytes(n) for gm in result.graphs.values() for n in gm.graph.nodes
               if is_collective(n) and collective_kind(n) == kind)


def test_mixed_precision_gathers_bf16_and_reduces_fp32() -> None:
    """bf16 compute over fp32 shards, fp32 reduction (``--dtype mixed``, as emulate runs): the all-gathers
    move what bf16 moves, the reduce-scatters twice that, and the optimizer steps fp32 shards."""
    bf16 = tiny()
    mixed = tiny(dtype=torch.float32, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32))
    assert _collective_bytes(mixed, "all_gather") == _collective_bytes(bf16, "all_gather")
    assert _collective_bytes(mixed, "reduce_scatter") == 2 * _collective_bytes(bf16, "reduce_scatter")
    assert mixed.summary["optimizer_ms"] == pytest.approx(2 * bf16.summary["optimizer_ms"])


def test_a_world_of_64_ranks_spans_8_hosts() -> None:
    """By default 64 ranks sit on 8 hosts of the preset's 8 GPUs: every collective crosses hosts, at the
    inter-host bandwidth; the same world on one host moves at the intra-host one."""
    spread, one_host = tiny(64), tiny(64, hosts=1)
    assert spread.summary["hosts"] == 8 and one_host.summary["hosts"] == 1
    h200 = HARDWARE["h200"]
    for result, hosts, busbw in ((spread, 8, h200.inter_node_busbw), (one_host, 1, h200.intra_node_busbw)):
        gathers = [s for s in result.timelines["forward"].spans if s.op == "all_gather"]  # one at a time
        assert gathers and all(s.end - s.start == pytest.approx(collective_seconds("all_gather", s.bytes, 64, h200,
                                                                                   hosts=hosts)) for s in gathers)
        assert collective_seconds("all_gather", 1 << 30, 64, h200, hosts=hosts) == pytest.approx(
            h200.collective_latency + 62 * h200.hop_latency + 63 / 64 * (1 << 30) / busbw)


def test_explain_schedules_as_the_backend_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reduce_scatter_bytes="auto"`` keeps one unit in flight, as ``make_backend()`` does on a GPU: the
    cost model picks settings only for ``prefetch="auto"`` (then the cap too, as the backend would)."""
    from fsdp_compile.inspection import autotune

    asked = []
    choose = autotune.choose
    monkeypatch.setattr(autotune, "choose", lambda *a, **kw: asked.append(kw) or choose(*a, **kw))
    explain("tiny", world_size=4)
    assert not asked
    explain("tiny", world_size=4, prefetch="auto")
    assert asked and asked[0]["reduce_scatter_bytes"] == "auto"


def test_extrapolation_matches_a_full_trace_and_tables_say_so() -> None:
    """(NOTE [periodic blocks]) 2 and 3 traced blocks, extended to 5, predict what tracing 5 gives; the
    tables and the picture's title say that they show the traced blocks."""
    five = PRESETS["tiny"].with_(n_layers=5)
    full = explain(five, world_size=8, trace_layers=None).summary
    extended = explain(five, world_size=8, trace_layers=3)
    assert extended.summary["extrapolated_from_layers"] == [2, 3]
    for key in ("step_ms", "compute_ms", "optimizer_ms", "exposed_comm_ms"):
        assert extended.summary[key] == pytest.approx(full[key], rel=0.02), key
    for text in extended.tables.values():
        assert text.startswith("# 3 of the model's 5 identical blocks traced; times here are theirs.")


@pytest.mark.parametrize("prefetch", [1, 2, "auto"])
def test_too_few_traced_blocks_are_traced_deeper(prefetch: object) -> None:
    """(NOTE [periodic blocks]) 1 and 2 blocks have no middle to extend (the schedule's first gathers and
    last reduce-scatters differ between them): explain traces more, as many as the prefetch needs."""
    eight = PRESETS["tiny"].with_(n_layers=8)
    full = explain(eight, world_size=64, trace_layers=None, prefetch=prefetch).summary
    asked = explain(eight, world_size=64, trace_layers=2, prefetch=prefetch).summary
    assert asked["extrapolated_from_layers"] == {1: [2, 3], 2: [3, 4], "auto": [4, 5]}[prefetch]
    assert asked["step_ms"] == pytest.approx(full["step_ms"], rel=0.01)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        explain("llama9")
    with pytest.raises(TypeError, match="example_input"):
        explain(ThreeUnits())
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        explain("tiny", optimizer="lion")


class PinnedTest(TestCase):
    def test_issue_shapes_at_two_ranks(self) -> None:
        """Pins the estimate for fixed shapes (the issue's Llama blocks: D=4096, 32 heads, vocab 32000,
        2048 tokens per rank, 2 ranks, bf16, AdamW), 2 blocks to keep the trace short. A change of the
        cost model shows here; benchmarks/calibration/check_explain.py compares it with measured steps."""
        cfg = ModelConfig(vocab_size=32000, dim=4096, n_layers=2, n_heads=32, max_seq_len=2048)
        s = explain(cfg, world_size=2, seq=2048, trace_layers=None).summary
        per = {k: round(v["step_seconds"] * 1e3, 2) for k, v in s["per_graph"].items()}
        self.assertExpectedInline(
            f"step {s['step_ms']:.2f} ms, exposed comm {s['exposed_comm_ms']:.2f} ms, per graph {per}",
            "step 17.65 ms, exposed comm 0.80 ms, per graph {'forward': 4.33, 'backward': 8.63, 'optimizer': 4.69}")


def test_trailing_unpack_rows_are_one_line() -> None:
    """Without a reduce-scatter cap every wait sinks to the end, and so do the copies out of each
    unit's reduced buffer (the root's three: NOTE [gradients in stretches]): one line for them, naming the units."""
    text = explain(PRESETS["tiny"].with_(n_layers=4), world_size=8, reduce_scatter_bytes=None).tables["backward"]
    last = text.splitlines()[-1]
    assert "unpack x7 (" in last and " 0-4 " in last and "reduce_scatter" in last
    assert "unpack (" not in "\n".join(text.splitlines()[-5:])


def test_cli_takes_the_backend_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["explain", "--model", "tiny", "--world-size", "4", "--prefetch", "auto", "--prefetch-bytes", "1M",
                "--reduce-scatter-bytes", "none", "--optimizer", "sgd", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prefetch auto" in out and "the sgd optimizer step's" in out and "exposed comm" in out
    assert cli(["explain", "--model", "tiny", "--world-size", "4", "--hosts", "2", "--dtype", "mixed",
                "--optimizer", "adamw-fused", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny at 4 ranks on 2 host(s) of h200, mixed" in out and "the adamw-fused optimizer step's" in out
    with pytest.raises(SystemExit):
        cli(["explain", "--prefetch", "deep"])
    assert "give a number of units" in capsys.readouterr().err


def test_cli_prints_the_summary_and_never_overwrites_its_default_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The console's figures are summary.json's (compute includes the optimizer step, as there); with no
    --out, a second run writes beside the first, not over it."""
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert cli(["explain", "--model", "demo", "--world-size", "4", "--trace-layers", "2"]) == 0  # (3 traced)
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["explain", "explain-2"]
    s = json.loads((tmp_path / "out" / "explain-2" / "summary.json").read_text())
    assert (f"estimated step     {s['step_ms']:.2f} ms = compute {s['compute_ms']:.2f} ms (the adamw optimizer "
            f"step's {s['optimizer_ms']:.2f} ms included) + exposed comm {s['exposed_comm_ms']:.2f} ms") in out
    assert "the model's 4 blocks are identical: copies of 2 and 3 blocks were traced" in out


def test_dump_dir_writes_each_graph(groups: object, tmp_path: Path) -> None:
    from .graph_utils import capture, shard_blocks_then_root

    capture(shard_blocks_then_root(ThreeUnits(), groups), torch.randn(4, 8), dump_dir=tmp_path,  # type: ignore[arg-type]
            hardware="h200")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith("forward_") and n.endswith(".rank0.txt") for n in names), names
    assert any(n.startswith("backward_") and n.endswith(".rank0.json") for n in names), names
    text = next(p for p in tmp_path.iterdir() if p.name.startswith("backward_") and p.suffix == ".txt").read_text()
    assert "reduce_scatter" in text and "estimated on h200" in text and " rs " in text
    assert " rep " not in text, text  # a 1-D mesh: compute rows have no group


def test_auto_prefetch_follows_the_cost_model(groups: object) -> None:
    """Slow links: prefetching pays, "auto" prefetches. Instant links: nothing to hide, depth 0."""
    import dataclasses

    from fsdp_compile.compiler.pipeline import BackendOptions, scheduler
    from fsdp_compile.inspection.autotune import choose
    from fsdp_compile.inspection.cost import HARDWARE

    from .graph_utils import capture, shard_blocks_then_root

    model = shard_blocks_then_root(ThreeUnits(), groups)  # type: ignore[arg-type]
    bucketed = capture(model, torch.randn(4, 8), disabled_passes=["prefetch", "reduce_scatter", "streams"])
    # seconds of compute per unit, a second per collective: hiding collectives is worth a deeper prefetch
    slow_compute = dataclasses.replace(HARDWARE["h200"], peak_flops_fp32=1e6, memory_bandwidth=1e6, collective_latency=1.0)
    instant_links = dataclasses.replace(slow_compute, collective_latency=0.0, intra_node_busbw=1e18)
    kw = {"prefetch": "auto", "reduce_scatter_bytes": "auto", "schedule": scheduler(BackendOptions(prefetch="auto"))}
    assert choose(bucketed["forward"], slow_compute, **kw).prefetch >= 1
    assert choose(bucketed["forward"], instant_links, **kw).prefetch == 0
    cap = choose(bucketed["backward"], slow_compute, **kw).reduce_scatter_bytes
    assert cap is None or isinstance(cap, int)


def test_log_ranks_setting() -> None:
    assert logs_on_rank(0, None) and not logs_on_rank(1, None) and not logs_on_rank(1, "")
    assert logs_on_rank(3, "all") and logs_on_rank(3, "0,3") and not logs_on_rank(2, "0, 3")
    with pytest.raises(ValueError, match="FSDP_COMPILE_LOG_RANKS"):
        logs_on_rank(0, "first")


SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from fsdp_compile import FsdpGroups, make_backend
from tests.graph_utils import ThreeUnits, shard_blocks_then_root
for rank, setting in [(0, None), (1, None), (1, "all")]:
    print(f"=== rank {rank}, FSDP_COMPILE_LOG_RANKS={setting}", file=sys.stderr, flush=True)
    if setting is not None:
        os.environ["FSDP_COMPILE_LOG_RANKS"] = setting
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    torch._dynamo.reset()
    model = shard_blocks_then_root(ThreeUnits(), FsdpGroups.create())
    torch.compile(model, backend=make_backend(inductor=False))(torch.randn(4, 8)).sum().backward()
    dist.destroy_process_group()
"""


def test_schedules_are_logged_where_our_loggers_ask() -> None:
    """A level on the package's loggers (what TORCH_LOGS=fsdp_compile sets) turns the tables on; the root
    logger's level does not (NOTE [schedules in TORCH_LOGS])."""
    root, package = logging.getLogger(), logging.getLogger("fsdp_compile")
    levels = root.level, package.level
    try:
        root.setLevel(logging.INFO)
        package.setLevel(logging.NOTSET)
        assert not schedule_logged()
        package.setLevel(logging.INFO)
        assert schedule_logged()
        package.setLevel(logging.WARNING)
        assert not schedule_logged()
    finally:
        root.setLevel(levels[0])
        package.setLevel(levels[1])


def test_torch_logs_prints_the_schedule() -> None:
    """TORCH_LOGS=fsdp_compile, beside another setting, prints each compiled graph's table, groups labelled
    as in explain (NOTE [schedules in TORCH_LOGS]: torch finds the package and turns its loggers on); rank 0
    alone unless FSDP_COMPILE_LOG_RANKS says otherwise."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep what is on it
    env = {**os.environ, "TORCH_LOGS": "recompiles,fsdp_compile", "PYTHONPATH": path}
    env.pop("FSDP_COMPILE_LOG_RANKS", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _, rank0, rank1, rank1_all = done.stderr.split("=== rank ")
    for text, rank in ((rank0, 0), (rank1_all, 1)):
        assert f"fsdp-compile forward schedule (rank {rank})" in text and "fsdp-compile backward schedule" in text
        assert " rs " in text and " ag " in text  # labels, not the process groups' names
    assert "schedule" not in rank1


def test_a_root_kept_gathered_is_not_gathered_again_in_backward() -> None:
    """``root_reshard_after_forward=False``: the root's parameters that backward reads (the output head)
    stay gathered from forward, so backward gathers one unit fewer and forward is unchanged."""
    kept = tiny(root_reshard_after_forward=False)
    assert kept.tables["forward"].count("all_gather_into_tensor") == tiny().tables["forward"].count(
        "all_gather_into_tensor")
    assert kept.tables["backward"].count("all_gather_into_tensor") < tiny().tables["backward"].count(
        "all_gather_into_tensor")
