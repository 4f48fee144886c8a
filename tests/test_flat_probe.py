"""The flat-shard probe (benchmarks/flat_probe.py) computes what the model it replaces computes."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.flat_probe import FlatBlock, flatten_blocks
from fsdp_compile.models import ModelConfig, Transformer


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_flattened_blocks_give_the_model_s_logits_and_input_gradient(kv_heads: int | None) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=kv_heads,
                                    max_seq_len=16))
    flat = flatten_blocks(copy.deepcopy(model))
    assert all(isinstance(b, FlatBlock) and [n for n, _ in b.named_parameters()] == ["flat"] for b in flat.layers)
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(flat(tokens), model(tokens))
    x = torch.randn(2, 8, 32, requires_grad=True)
    cos, sin = model.rope_cos, model.rope_sin
    grad_ref, = torch.autograd.grad(model.layers[0](x, cos, sin).square().sum(), x)
    grad, = torch.autograd.grad(flat.layers[0](x, cos, sin).square().sum(), x)
    torch.testing.assert_close(grad, grad_ref)


def test_flatten_blocks_refuses_another_model() -> None:
    with pytest.raises(ValueError, match="llama model"):
        flatten_blocks(torch.nn.Linear(2, 2))
