"""Hugging Face in and out (fsdp_compile/api/hf.py) with a tiny Llama whose head is tied to its embedding: a
``save_pretrained`` directory loaded into a model built on the meta device and sharded at 2 gloo ranks
(rank 0 reads), two compiled steps, then written back and read by ``from_pretrained`` in one process."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp_compile import FsdpGroups, fully_shard, get_model_state_dict, make_backend
from fsdp_compile.examples.launch import run_ranks

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fsdp_compile.api.hf")


def config() -> Any:
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="sdpa",
    )


def sharded_on_meta(groups: FsdpGroups) -> Any:
    """A Hugging Face Llama of :func:`config` built on the meta device, its layers then its root sharded,
    ``to_empty`` on the CPU: what ``load_pretrained`` fills."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config())
    for layer in model.model.layers:
        fully_shard(layer, groups=groups)
    fully_shard(model, groups=groups)
    return model.to_empty(device="cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def _two_steps(run: Any, params: Any) -> list[float]:
    """Two AdamW steps of ``run`` (a causal LM) on the fixed batch; the losses."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    x, y = _batch()
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(run(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def round_trip(rank: int, world: int, src: str, dst: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # the one-time "gathered eagerly" warning
    groups = FsdpGroups.create()
    model = sharded_on_meta(groups)
    keys = hf.load_pretrained(model, src)
    loaded = {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    compiled = torch.compile(model, backend=make_backend(inductor=False))
    losses = _two_steps(compiled, model.parameters())
    trained = {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
    hf.save_pretrained(model, dst)
    groups.destroy()
    return {"keys": (list(keys.missing_keys), list(keys.unexpected_keys)), "loaded": loaded, "trained": trained,
            "inv_freq": inv_freq, "losses": losses}


def test_hugging_face_llama_in_and_out_at_two_ranks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config())
    source.save_pretrained(tmp_path / "src")
    results = run_ranks(round_trip, 2, str(tmp_path / "src"), str(tmp_path / "dst"), timeout=600)
    want = {k: v.clone() for k, v in source.state_dict().items()}
    # The reference: the same two steps on the unsharded model.
    ref_losses = _two_steps(source, source.parameters())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    assert back.lm_head.weight is back.model.embed_tokens.weight, "the tie survives the round trip"
    for rank, r in enumerate(results):
        assert r["keys"] == ([], []), f"rank {rank}: missing/unexpected keys {r['keys']}"
        for name, value in r["loaded"].items():
            assert torch.equal(value, want[name] if name in want else want["model.embed_tokens.weight"]), name
        torch.testing.assert_close(r["inv_freq"], source.model.rotary_emb.inv_freq)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for name, value in back.state_dict().items():
            assert torch.equal(value, r["trained"][name]), f"from_pretrained read {name} not as trained (rank {rank})"
    assert not torch.equal(back.model.embed_tokens.weight, want["model.embed_tokens.weight"]), "the steps trained it"
