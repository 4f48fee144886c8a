"""The default backend trains every model as eager does, outlining only blocks proven alike.

NOTE [outlining by proof] (passes/capture/outline.py). Each pattern of ``exactness_workers.PATTERNS`` is a
model of four blocks of one class that differ, or come to differ after the first compile, in something
their forward does; it trains 3 SGD steps (with weight decay) sharded with the default backend and unsharded eagerly, on 1
and 2 gloo ranks (the scheduled FX graphs; a few under Inductor too). What each must show: the numbers
of eager, and which blocks shared a body (``calls``: for each forward compiled, how many blocks call
each body; the first block's input is the embedding's output, so alike blocks are all four).
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_compile.examples.launch import run_ranks

from .exactness_workers import CAPTURE_PATHS, PATTERNS, Run, backward_twice, lengths_per_rank, train_patterns

TOLERANCE = 1e-5  # relative; a block run as another block's body is off by 0.1 to 2

CALLS = {
    "alike": [[4]],
    "activation-class": [[3]],  # block 1 runs ReLU where the others run Tanh: its own code
    "mlp-class-alternates": [[2, 2]],  # two bodies: the dense blocks', the expert blocks'
    "factory-default-argument": [[]],  # four classes that differ in a default argument: none alike
    "hook-on-a-submodule": [[3]],
    "negative-zero": [[3]],  # -0.0 is not 0.0
    "table-keyed-by-block": [[3]],
    "parameters-read-without-grad": [[3]],
    "a-parameter-never-read": [[3]],  # block 2 has a parameter more
    # changed after the first compile: Dynamo's guards (it traced every block) recompile, and the
    # changed block gets its own code
    "later-float-attribute": [[4], [3]],
    "later-dropout-p": [[4], [3]],
    "later-submodule-class": [[4], [3]],
    "later-config-field": [[4], [3]],
    "later-list-item": [[4], [3]],
    "table-later-value": [[3], [3]],
    "later-hook": [[4], [3]],
}
UNDER_INDUCTOR = ["alike", "mlp-class-alternates", "later-float-attribute"]


def test_every_pattern_is_listed() -> None:
    assert sorted(CALLS) == sorted(PATTERNS)


@pytest.fixture(scope="module")
def one_rank() -> dict[str, dict[str, Any]]:
    return run_ranks(train_patterns, 1, [Run(p) for p in PATTERNS], timeout=900)[0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    runs = [Run(p) for p in PATTERNS] + [Run(p, inductor=True) for p in UNDER_INDUCTOR]
    return run_ranks(train_patterns, 2, runs, timeout=1200)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_one_rank_matches_eager(one_rank: dict[str, dict[str, Any]], pattern: str) -> None:
    assert one_rank[pattern]["worst"] < TOLERANCE
    assert one_rank[pattern]["grads_differ"] == []
    assert one_rank[pattern]["calls"] == CALLS[pattern]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", list(PATTERNS) + [f"{p}-inductor" for p in UNDER_INDUCTOR])
def test_two_ranks_match_eager(two_ranks: list[dict[str, dict[str, Any]]], pattern: str) -> None:
    for rank in two_ranks:
        assert rank[pattern]["worst"] < TOLERANCE, (pattern, rank[pattern])
        assert rank[pattern]["grads_differ"] == [], (pattern, rank[pattern])
        assert rank[pattern]["calls"] == CALLS[pattern.removesuffix("-inductor")]


@pytest.mark.slow
def test_backward_twice_accumulates_as_eager_on_every_capture_path() -> None:
    """``loss.backward(retain_graph=True); loss.backward()`` on a two-block Llama, 2 ranks, one spawn:
    outlined, inline, BlockStack and whole-graph under Inductor, outlined as FX graphs; after a plain
    backward, and after a warm start whose graphs a plain backward compiled (NOTE [no donated buffers])."""
    for rank in run_ranks(backward_twice, 2, list(CAPTURE_PATHS), timeout=900):
        for path, got in rank.items():
            assert got["error"] < TOLERANCE, (path, got)
            inductor = CAPTURE_PATHS[path][2].get("inductor", True)
            assert got["cache"] == ({"miss": 1, "saved": 1, "hit": 1} if inductor else {}), (path, got)


@pytest.mark.slow
@pytest.mark.parametrize("inductor", [False, True])
def test_dynamic_lengths_that_differ_per_rank(inductor: bool) -> None:
    """``dynamic=True``, sequence lengths that differ per rank and step, on an outlined Llama, 2 ranks."""
    assert max(run_ranks(lengths_per_rank, 2, inductor, timeout=600)) < TOLERANCE
