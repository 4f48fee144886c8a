"""Hugging Face ``transformers`` decoders, unchanged, train with ``fsdp_backend`` (small configs, no
downloads): Llama, GPT-2 whose output head is tied to its input embedding, and Mistral. Both run in one spawn,
their scheduled graphs without Inductor: what is checked is that Dynamo, the sharding and the passes
take these models as they are (tests/test_numerics.py covers Inductor)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_compile import FsdpGroups, fully_shard
from fsdp_compile.examples.launch import run_ranks

from .test_numerics import check
from .workers import TINY, Case, HuggingFace, train_cases

pytest.importorskip("transformers")

MODELS = ["hf-llama", "hf-gpt2", "hf-mistral"]  # Mistral: a sliding window shorter than the sequence


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict[str, Any]]]:
    cases = [Case(model=m, steps=3, backend_kw={"inductor": False}) for m in MODELS]
    per_rank = run_ranks(train_cases, 2, cases, timeout=900)
    return {m: [rank[i] for rank in per_rank] for i, m in enumerate(MODELS)}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_hf_model_trains_like_the_reference(trained: dict[str, list[dict[str, Any]]], model: str) -> None:
    """Blocks first, then the root: GPT-2's tied wte/lm_head both land in the root unit."""
    check(trained[model], steps=3)


def test_tied_embedding_split_across_units_is_refused(groups: FsdpGroups) -> None:
    torch.manual_seed(0)
    model = HuggingFace("gpt2", TINY)
    fully_shard(model.hf.transformer.wte, groups=groups)  # the tie's other user, lm_head, is outside
    with pytest.raises(ValueError, match=r"'hf.lm_head.weight' .* shared with unit .*closest module that contains"):
        fully_shard(model, groups=groups)
