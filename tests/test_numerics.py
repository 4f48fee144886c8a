"""Sharded, compiled training on several gloo ranks equals single-process training on the global batch.

Each case runs in spawned processes (fsdp_compile/launch.py: a deadline instead of a hang, and every
rank's traceback on failure). The reference runs eagerly in each rank's process on the whole global
batch; fp32 losses must agree to a relative 1e-5 over every step, and the first step's sharded grads
must equal the matching rows of the reference grads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_compile.launch import run_ranks
from .workers import Case, train_case

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


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_llama_two_ranks(optim: str) -> None:
    case = Case(optim=optim)
    check(run_ranks(train_case, 2, case), steps=case.steps)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_llama_four_ranks(optim: str) -> None:
    case = Case(optim=optim)
    check(run_ranks(train_case, 4, case), steps=case.steps)


def test_gradients_accumulate_across_calls() -> None:
    case = Case(microbatches=2, steps=4)
    check(run_ranks(train_case, 2, case), steps=case.steps)


def test_uneven_frozen_buffers_shared_at_four_ranks() -> None:
    """Vocabulary 1001 and width 10 over 4 ranks (padding), a frozen embedding, a buffer, a module
    used twice and a param shared by two modules of one unit."""
    case = Case(model="uneven", steps=6)
    results = run_ranks(train_case, 4, case)
    check(results, steps=case.steps)
    assert "emb.weight" not in results[0]["grads0"]


@pytest.mark.parametrize("run", ["eager", "inductor"])
def test_slow_path_trains_correctly_and_warns_once(run: str) -> None:
    case = Case(run=run, steps=3)
    results = run_ranks(train_case, 2, case)
    check(results, steps=case.steps)
    for r in results:
        slow = [w for w in r["warnings"] if "use torch.compile(model, backend=fsdp_backend)" in w.lower()]
        assert len(slow) == 1, r["warnings"]


SCHEDULES = {
    "default": ({}, {}),
    "delayed-one-communicator": ({"schedule": "delayed"}, {"dedicated": "none"}),
    "dedicated-all-gather": ({}, {"dedicated": "all_gather"}),
    "prefetch-0": ({"prefetch": 0}, {}),
    "prefetch-2": ({"prefetch": 2}, {}),
    "tiny-caps": ({"prefetch": 2, "prefetch_bytes": 1, "reduce_scatter_bytes": 1}, {}),
    "no-reduce-scatter-cap": ({"reduce_scatter_bytes": None}, {}),
    "params-alone": ({"bucket_alone_bytes": 1}, {}),  # NOTE [large params alone]: no buckets at all
    "bucket-packed-apart": ({"inplace_gather": False}, {}),  # the all-gather bucket packed out of place
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_matches_the_reference(name: str) -> None:
    backend_kw, group_kw = SCHEDULES[name]
    case = Case(optim="adamw", steps=5, backend_kw=backend_kw, group_kw=group_kw)
    check(run_ranks(train_case, 2, case), steps=case.steps)


def test_world_size_one_elides_collectives() -> None:
    """One rank: no collective at all, gradients straight into the shards (no packing copies)."""
    check(run_ranks(train_case, 1, Case(steps=4)), steps=4)
