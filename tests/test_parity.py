"""FSDP parity on gloo: mixed precision, reshard options, no-sync accumulation, activation
checkpointing and graph breaks, each against a single-process reference doing the same arithmetic.

The 2-rank cases share one spawn (``workers.train_cases``: start-up is most of a case's time) and
run the scheduled graphs without Inductor, except one mixed-precision case whose casts Inductor
compiles: what these tests check is the schedule, the partition and the
casts, which the FX graphs run as they are; tests/test_numerics.py covers Inductor on every schedule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_compile import MixedPrecisionPolicy
from fsdp_compile.examples.launch import run_ranks

from .test_numerics import check
from .workers import Case, train_case, train_cases

BF16, F32 = torch.bfloat16, torch.float32
FX = {"inductor": False}

MIXED = {
    "bf16-params-fp32-reduce": (MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32), None, {}),
    "bf16-reduce-fp32-output": (MixedPrecisionPolicy(param_dtype=BF16),
                                MixedPrecisionPolicy(param_dtype=BF16, output_dtype=F32), FX),
}

CASES: dict[str, Case] = {
    "reshard_after_forward_false": Case(steps=4, shard_kw={"reshard_after_forward": False}, backend_kw=FX),
    # three microbatches a step, the first two without sync, and the same with sync every time
    "no_sync": Case(steps=3, microbatches=3, no_sync=True, count_collectives=True, backend_kw=FX),
    "synced": Case(steps=3, microbatches=3, count_collectives=True, backend_kw=FX),
    "activation_checkpointing": Case(model="llama-ac", steps=4, backend_kw=FX),
    "graph_breaks": Case(model="llama-break", steps=4, backend_kw=FX),
    **{f"mixed-{name}": Case(steps=4, shard_kw={"mp_policy": block}, root_kw=None if root is None else {"mp_policy": root},
                             backend_kw=kw)
       for name, (block, root, kw) in MIXED.items()},
}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict[str, Any]]]:
    """Every case of ``CASES`` at 2 ranks, by name: each rank's result."""
    per_rank = run_ranks(train_cases, 2, list(CASES.values()), timeout=1200)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(CASES)}


def test_reshard_after_forward_false(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["reshard_after_forward_false"], steps=4)


def test_no_sync_accumulation_reduces_once_per_unit(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    """Three microbatches a step, the first two without sync: no reduce-scatter runs for them, and
    the last backward reduces everything once: one bucketed reduce-scatter per unit (3 units)."""
    results, synced = two_ranks["no_sync"], two_ranks["synced"]
    check(results, steps=3)
    # (step 0 also counts the ops traced at compile time; later steps are the run time counts)
    assert results[0]["reduce_scatters"][1:] == [3, 3]
    # 3 microbatches x (2 blocks + the root's three stretches: the head, the final norm (its gradient
    # needs the head's gathered weight) and the embedding: NOTE [gradients in stretches])
    assert synced[0]["reduce_scatters"][1:] == [15, 15]


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precision(two_ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    """The reference reads every param in bf16 and casts at the same unit boundaries; what differs is
    only where bf16 rounding happens (per-rank gradients reduced vs one global gradient): tolerance
    2e-3 relative on losses and 3e-2 on the first step's grads (norm of the difference over the norm).
    ``bf16-params-fp32-reduce`` runs through Inductor, the other as FX graphs."""
    for r in two_ranks[f"mixed-{name}"]:
        assert len(r["losses"]) == 4
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=2e-3, atol=0)
        for param, grad in r["grads0"].items():
            assert grad.dtype == F32, param  # shard grads come back in the shard's dtype
            ref = r["ref_grads0"][param]
            assert (grad - ref).norm() <= 3e-2 * ref.norm() + 1e-8, param


def test_activation_checkpointing(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["activation_checkpointing"], steps=4)


def test_graph_breaks_between_units(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    check(two_ranks["graph_breaks"], steps=4)


@pytest.mark.slow
def test_hsdp_2x2() -> None:
    """4 ranks as (replicate 2, shard 2): all-gathers and reduce-scatters over the shard dimension,
    gradients all-reduced across replicas. Groups on each rank: WORLD, the mesh's replicate and shard
    groups, and one dedicated reduce-scatter communicator for this rank's shard group: four."""
    case = Case(mesh=(2, 2), steps=3, backend_kw=FX)
    results = run_ranks(train_case, 4, case)
    check(results, steps=case.steps)
    assert all(r["groups"] == 4 and r["shard_world"] == 2 for r in results)
