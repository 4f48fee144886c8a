"""Sharded, compiled training on several gloo ranks equals single-process training on the global batch.

Each case runs in spawned processes (fsdp_compile/examples/launch.py: a deadline instead of a hang, and every
rank's traceback on failure). The reference runs eagerly in each rank's process on the whole global
batch; fp32 losses must agree to a relative 1e-5 over every step, and the first step's sharded grads
must equal the matching rows of the reference grads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_compile.examples.launch import run_ranks
from .workers import TINY, Case, train_case, train_cases

RTOL = 1e-5


def check(results: list[dict[str, Any]], *, steps: int, rtol: float = RTOL) -> None:
    for rank, r in enumerate(results):
        assert len(r["losses"]) == steps
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=rtol, atol=0,
            msg=lambda m, rank=rank: f"rank {rank}: losses differ from the reference\n{m}",
        )
        assert sorted(r["grads0"]) == r["ref_grad_names"], "every trainable param gets a grad, and only those"
        for name, grad in r["grads0"].items():
            torch.testing.assert_close(grad, r["ref_grads0"][name], rtol=rtol, atol=1e-7 if rtol <= RTOL else 1e-5,
                                       msg=lambda m, name=name: f"rank {rank}: grad of {name}\n{m}")


FX = {"inductor": False}

# NOTE [schedules under Inductor]: every schedule runs here; those whose code Inductor could get wrong in
# its own way (the default, the delayed one-communicator baseline, tiny caps, params alone) run under
# Inductor, the rest as the scheduled FX graphs, which run the same collectives in the same order
# (tests/test_inductor_order.py checks that Inductor keeps that order).
SCHEDULES = {
    "default": ({}, {}),
    "delayed-one-communicator": ({"schedule": "delayed"}, {"dedicated": "none"}),
    "dedicated-all-gather": ({**FX}, {"dedicated": "all_gather"}),
    "prefetch-0": ({"prefetch": 0, **FX}, {}),
    "prefetch-2": ({"prefetch": 2, **FX}, {}),
    "tiny-caps": ({"prefetch": 2, "prefetch_bytes": 1, "reduce_scatter_bytes": 1}, {}),
    "no-reduce-scatter-cap": ({"reduce_scatter_bytes": None, **FX}, {}),
    "params-alone": ({"bucket_alone_bytes": 1}, {}),  # NOTE [large params alone]: no buckets at all
    "bucket-packed-apart": ({"inplace_gather": False, **FX}, {}),  # the all-gather bucket packed out of place
    "whole-graph": ({"outline": False, **FX}, {}),  # no outlined units (NOTE [outlined units])
}

TWO_RANKS: dict[str, Case] = {
    "llama-sgd": Case(optim="sgd"),
    "accumulate": Case(microbatches=2, steps=4, backend_kw=FX),
    "stacked": Case(model="llama-stacked", optim="adamw", steps=5),  # one BlockStack: NOTE [stacked blocks]
    # blocks of one class with two feed-forward classes: two outlined bodies (NOTE [outlining by proof])
    "alternating": Case(model="llama-alternating", cfg=TINY.with_(n_layers=4), optim="adamw", steps=3),
    # outlined blocks accumulating without sync: each read passes its accumulator (NOTE [outlining by proof])
    "outlined-no-sync": Case(microbatches=2, steps=3, no_sync=True, backend_kw=FX),
    # a stack accumulating without sync runs its blocks one by one (NOTE [stacked blocks])
    "stacked-no-sync": Case(model="llama-stacked", microbatches=2, steps=3, no_sync=True, backend_kw=FX),
    # the root keeps what backward reads (the output head) gathered from forward, as FSDP2's root does
    "root-kept": Case(optim="adamw", steps=5, root_kw={"reshard_after_forward": False}),
    **{f"schedule-{name}": Case(optim="adamw", steps=5, backend_kw=kw, group_kw=gkw)
       for name, (kw, gkw) in SCHEDULES.items()},
}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict[str, Any]]]:
    """Every case of ``TWO_RANKS`` in one spawn of 2 ranks (start-up is much of a case's time)."""
    per_rank = run_ranks(train_cases, 2, list(TWO_RANKS.values()), timeout=1800)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(TWO_RANKS)}


def test_llama_two_ranks_sgd(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["llama-sgd"], steps=TWO_RANKS["llama-sgd"].steps)


def test_stacked_blocks_match_the_reference(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    """One BlockStack of the blocks, traced once and compiled by Inductor as calls of one body (NOTE
    [stacked blocks])."""
    check(two_ranks["stacked"], steps=TWO_RANKS["stacked"].steps)


def test_blocks_that_alternate_two_classes_match_the_reference(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["alternating"], steps=TWO_RANKS["alternating"].steps)


def test_outlined_blocks_accumulate_without_sync(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["outlined-no-sync"], steps=TWO_RANKS["outlined-no-sync"].steps)


def test_stacked_blocks_accumulate_without_sync(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["stacked-no-sync"], steps=TWO_RANKS["stacked-no-sync"].steps)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_matches_the_reference(name: str, two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    """AdamW, 5 steps, each schedule (the default one is the two-rank Llama AdamW case)."""
    check(two_ranks[f"schedule-{name}"], steps=5)


def test_a_root_kept_gathered_into_backward_matches_the_reference(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["root-kept"], steps=5)


def test_gradients_accumulate_across_calls(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["accumulate"], steps=4)


@pytest.mark.slow
def test_four_ranks_llama_and_uneven() -> None:
    """Llama with SGD and AdamW at 4 ranks (FX graphs); and, under Inductor, vocabulary 1001, width 10
    over 4 ranks (padding), a frozen embedding, a buffer, a module used twice and a param shared by two
    modules of one unit."""
    cases = [Case(optim="sgd", backend_kw=FX), Case(optim="adamw", backend_kw=FX), Case(model="uneven", steps=6)]
    sgd, adamw, uneven = zip(*run_ranks(train_cases, 4, cases, timeout=1800))
    check(list(sgd), steps=cases[0].steps)
    check(list(adamw), steps=cases[1].steps)
    check(list(uneven), steps=cases[2].steps)
    assert "emb.weight" not in uneven[0]["grads0"]


def test_slow_path_trains_correctly_and_warns_once() -> None:
    """Uncompiled, then compiled by plain Inductor, in one process: both train exactly, and the slow
    path warns once per process."""
    eager, inductor = zip(*run_ranks(train_cases, 2, [Case(run="eager", steps=3), Case(run="inductor", steps=3)]))
    for results in (eager, inductor):
        check(list(results), steps=3)
    for rank_results in zip(eager, inductor):
        warned = [w for r in rank_results for w in r["warnings"]
                  if "use torch.compile(model, backend=fsdp_backend)" in w.lower()]
        assert len(warned) == 1, warned


def test_a_warm_start_loads_each_ranks_own_graphs_and_trains_exactly(tmp_path: Any, monkeypatch: Any) -> None:
    """(NOTE [warm start]) Two process starts of 2 ranks over one cache directory. The second loads its
    compiled graphs from AOTAutograd's cache, each rank its own (their in-place all-gathers differ), runs
    their lockstep check-ins, and trains exactly as the reference."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    case = Case(steps=3)
    first = run_ranks(train_case, 2, case)
    second = run_ranks(train_case, 2, case)
    assert [r["aot_cache"] for r in first] == [{"miss": 1, "saved": 1}] * 2
    assert [r["aot_cache"] for r in second] == [{"hit": 1}] * 2
    assert len(list((tmp_path / "aotautograd").iterdir())) == 2  # one entry per rank
    check(first, steps=3)
    check(second, steps=3)
    # The check-in inside a compiled graph waits for peers as long as the group's timeout says: a
    # start with another timeout compiles its own graphs.
    other_timeout = run_ranks(train_case, 2, Case(steps=1), pg_timeout_s=77.0)
    assert [r["aot_cache"] for r in other_timeout] == [{"miss": 1, "saved": 1}] * 2


def test_world_size_one_elides_collectives() -> None:
    """One rank: no collective at all, gradients straight into the shards (no packing copies)."""
    check(run_ranks(train_case, 1, Case(steps=4)), steps=4)
