"""On a GPU (skipped without one): the whole pipeline on NCCL at world size 1 matches the CPU numerics.

Run on the H200 machine with ``python -m pytest tests/test_cuda.py``. At world size 1 the collectives
are elided by default; ``elide_single_rank=False`` keeps them, so NCCL all-gathers and reduce-scatters
on two communicators really run, scheduled, through Inductor's CUDA code.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_compile.examples.launch import run_ranks

from .test_numerics import check
from .misuse_workers import clip_training
from .workers import Case, train_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "backend_kw, group_kw",
    [
        ({}, {}),
        ({"elide_single_rank": False}, {}),
        ({"elide_single_rank": False, "schedule": "delayed"}, {"dedicated": "none"}),
        ({"elide_single_rank": False, "prefetch": 2, "reduce_scatter_bytes": 1}, {"dedicated": "all_gather"}),
    ],
)
def test_world1_nccl_matches_cpu(backend_kw: dict, group_kw: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    case = Case(device="cuda", steps=6, backend_kw=backend_kw, group_kw=group_kw)
    check(run_ranks(train_case, 1, case, backend="nccl"), steps=case.steps, rtol=1e-4)


@pytest.mark.parametrize("backend_kw", [{}, {"elide_single_rank": False}])
def test_world1_nccl_stacked_blocks_match_cpu(backend_kw: dict) -> None:
    """One BlockStack (NOTE [stacked blocks]): traced once, unrolled into calls of one body through
    Inductor's CUDA code, the blocks' collectives on NCCL when kept."""
    torch.backends.cuda.matmul.allow_tf32 = False
    case = Case(model="llama-stacked", device="cuda", steps=6, backend_kw=backend_kw)
    check(run_ranks(train_case, 1, case, backend="nccl"), steps=case.steps, rtol=1e-4)


def test_clip_grad_norm_on_cuda() -> None:
    """ShardGrad on CUDA tensors: foreach norms, the clip, AdamW, with the collectives kept (NCCL)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    (r,) = run_ranks(clip_training, 1, 3, 0.05, "cuda", {"elide_single_rank": False}, backend="nccl")
    assert r["clipped"] == pytest.approx(r["ref_clipped"], rel=1e-4)
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4)
