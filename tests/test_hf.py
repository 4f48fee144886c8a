"""Hugging Face ``transformers`` decoders, unchanged, train with ``fsdp_backend`` (small configs, no
downloads): Llama, and GPT-2 whose output head is tied to its input embedding."""

from __future__ import annotations

import pytest
import torch

from fsdp_compile import FsdpGroups, fully_shard
from fsdp_compile.launch import run_ranks

from .test_numerics import check
from .workers import TINY, Case, HuggingFace, train_case

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
def test_hf_model_trains_like_the_reference(model: str) -> None:
    """Blocks first, then the root: GPT-2's tied wte/lm_head both land in the root unit."""
    check(run_ranks(train_case, 2, Case(model=model, steps=4)), steps=4)


def test_tied_embedding_split_across_units_is_refused(groups: FsdpGroups) -> None:
    torch.manual_seed(0)
    model = HuggingFace("gpt2", TINY)
    fully_shard(model.hf.transformer.wte, groups=groups)  # the tie's other user, lm_head, is outside
    with pytest.raises(ValueError, match=r"'hf.lm_head.weight' .* shared with unit .*closest module that contains"):
        fully_shard(model, groups=groups)
