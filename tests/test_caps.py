"""Bytes in flight, computed from the scheduled graphs' tensor metadata, never exceed the caps.

The model (a 3-block Llama-style transformer at world size 2, fake process group) is captured once,
lowered and bucketed but not yet scheduled; each test schedules copies of those graphs with the pure
passes and measures the peaks with ``fsdp_compile.inspection.schedule.in_flight_peaks``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import fx

from fsdp_compile import FsdpGroups
from fsdp_compile.examples.models import Transformer
from fsdp_compile.inspection.schedule import in_flight_peaks
from fsdp_compile.passes.collective_regions import regions
from fsdp_compile.passes.schedule.prefetch import prefetch_pass
from fsdp_compile.passes.schedule.reduce_scatter import reduce_scatter_pass

from .graph_utils import SMALL, capture, fake_process_group, shard_blocks_then_root


@pytest.fixture(scope="module")
def unscheduled() -> Iterator[dict[str, fx.GraphModule]]:
    with fake_process_group(2):
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        model = shard_blocks_then_root(Transformer(SMALL.with_(n_layers=3)), groups)
        yield capture(model, torch.zeros(2, 4, dtype=torch.long),
                      disabled_passes=["prefetch", "reduce_scatter", "streams"])


def _largest(gm: fx.GraphModule, kind: str) -> int:
    return max(r.out_bytes if kind == "all_gather" else r.in_bytes for r in regions(gm, kind))


def _scheduled(gm: fx.GraphModule, pass_fn: object, **kw: object) -> fx.GraphModule:
    out = pass_fn(copy.deepcopy(gm), **kw)  # type: ignore[operator]
    out.graph.lint()
    return out


@pytest.mark.parametrize("cap_buckets", [1, 1.5, 2, 3])
def test_reduce_scatter_cap(unscheduled: dict[str, fx.GraphModule], cap_buckets: float) -> None:
    bwd = unscheduled["backward"]
    bucket = _largest(bwd, "reduce_scatter")
    uncapped = in_flight_peaks(_scheduled(bwd, reduce_scatter_pass, max_bytes=None))["reduce_scatter"]
    assert uncapped > 3 * bucket  # without a cap every wait sinks to the end: the cap has work to do
    cap = int(cap_buckets * bucket)
    peak = in_flight_peaks(_scheduled(bwd, reduce_scatter_pass, max_bytes=cap))["reduce_scatter"]
    assert 0 < peak <= max(cap, bucket)


@pytest.mark.parametrize("depth, cap_buckets", [(1, None), (2, None), (3, None), (3, 2), (3, 1)])
def test_prefetch_cap(unscheduled: dict[str, fx.GraphModule], depth: int, cap_buckets: float | None) -> None:
    for kind, gm in unscheduled.items():
        bucket = _largest(gm, "all_gather")
        cap = None if cap_buckets is None else int(cap_buckets * bucket)
        peak = in_flight_peaks(_scheduled(gm, prefetch_pass, depth=depth, max_bytes=cap))["all_gather"]
        assert peak <= (depth + 1) * bucket, kind
        if cap is not None:
            assert peak <= max(cap, bucket), kind


def test_deeper_prefetch_holds_more_bytes(unscheduled: dict[str, fx.GraphModule]) -> None:
    fwd = unscheduled["forward"]
    peaks = [in_flight_peaks(_scheduled(fwd, prefetch_pass, depth=d))["all_gather"] for d in (0, 1, 2)]
    assert peaks[0] < peaks[1] < peaks[2]
