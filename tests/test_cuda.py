"""On a GPU (skipped without one): the whole pipeline on NCCL at world size 1 matches the CPU numerics,
and the README's GPU code runs as written (read from README.md, as tests/test_readme.py does).

Run on the H200 machine with ``python -m pytest tests/test_cuda.py``. At world size 1 the collectives
are elided by default; ``elide_single_rank=False`` keeps them, so NCCL all-gathers and reduce-scatters
on two communicators really run, scheduled, through Inductor's CUDA code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_compile.examples.launch import run_ranks

from .test_numerics import check
from .misuse_workers import clip_training
from .test_readme import CUDA_SCRIPTS, LOAD_SNIPPET, blocks, launch, torchrun
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


@pytest.mark.parametrize("script", CUDA_SCRIPTS)
def test_readme_gpu_script(script: str, tmp_path: Path) -> None:
    """The README's training script under its torchrun command, on this machine's GPUs (at most the
    README's count), in a scratch directory; run twice: the second run resumes from the checkpoint the
    first saved. As written it trains 1000 steps of 8 blocks of D=4096 and saves checkpoints of about
    23 GB (fp32 shards and AdamW's state): minutes on one H200, and the disk for them."""
    for run in ("first", "resumed"):
        done = launch(script, tmp_path, nproc=min(8, torch.cuda.device_count()), timeout=3000)
        assert done.returncode == 0, f"{run} run:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"


# The README's rank-0 loading snippet needs a model sharded on the meta device and moved with to_empty,
# and ``path`` (a full state dict saved by torch.save): a small model here, on 1 or 2 GPUs.
_LOAD_BEFORE = """
import os, torch, torch.distributed as dist
from fsdp_compile import FsdpGroups, fully_shard, get_model_state_dict, set_model_state_dict
from fsdp_compile.examples.models import ModelConfig, Transformer
cuda = os.environ.get("README_DEVICE", "cuda") == "cuda"
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
groups = FsdpGroups.create()
path = "sd.pt"
with torch.device("meta"):
    model = Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64))
for block in model.layers:
    fully_shard(block, groups=groups)
fully_shard(model, groups=groups)
model.to_empty(device=device)
"""
_LOAD_AFTER = """
expected = torch.load(path) if dist.get_rank() == 0 else {}
assert sorted(full) == sorted(expected), (sorted(full), sorted(expected))
for name, value in expected.items():
    assert torch.equal(full[name], value), name
print(f"rank {dist.get_rank()}: {len(full)} tensors exported, all equal to the file's")
dist.destroy_process_group()
"""


def test_readme_rank0_loading(tmp_path: Path) -> None:
    """Rank 0 reads a full state dict, every rank keeps its rows; the full export gives rank 0 the same
    tensors back (and the other ranks nothing: ``cpu_offload``)."""
    from fsdp_compile.examples.models import ModelConfig, Transformer

    (snippet,) = [b for b in blocks("python") if LOAD_SNIPPET in b]
    torch.manual_seed(0)
    torch.save(Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)).state_dict(),
               tmp_path / "sd.pt")
    (tmp_path / "load.py").write_text(_LOAD_BEFORE + snippet + _LOAD_AFTER)
    nproc = min(2, torch.cuda.device_count())
    done = torchrun(["--standalone", f"--nproc-per-node={nproc}", "load.py"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("all equal to the file's") == nproc, done.stdout
