"""A failure on rank 0 alone reaches every rank as the same clear error, and none hangs when the caller
catches it: ``load_pretrained`` of a broken directory, ``save_pretrained`` where rank 0 cannot write,
and a broadcast load given entries on a rank other than 0 (2 gloo ranks, one spawn, a tiny Llama)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp_compile import FsdpGroups, set_model_state_dict
from fsdp_compile.examples.launch import run_ranks

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fsdp_compile.api.hf")

from .test_hf_checkpoint import config, sharded_on_meta  # noqa: E402


def _attempt(name: str, fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {"case": name, "error": type(e).__name__, "message": str(e), "s": time.monotonic() - start}
    return {"case": name, "error": None, "message": "", "s": time.monotonic() - start}


def every_case(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    """Each case in turn on one model, its error caught; then a good load, which must still work."""
    warnings.simplefilter("ignore")
    groups = FsdpGroups.create()
    model = sharded_on_meta(groups)
    r = Path(root)
    extra = {"model.norm.weight": torch.ones(32)} if rank == 1 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    out = [_attempt(case, lambda case=case: hf.load_pretrained(model, r / case))
           for case in ("tokenizer-only", "missing-shard", "truncated-shard", "escaping-index")]
    out.append(_attempt("unwritable", lambda: hf.save_pretrained(model, r / "a-file" / "out")))
    out.append(_attempt("entries-on-rank-1", lambda: set_model_state_dict(model, extra, options=options)))
    out.append(_attempt("good", lambda: hf.load_pretrained(model, r / "good")))
    groups.destroy()
    return out


def _directories(root: Path) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(root / "good")
    (root / "tokenizer-only").mkdir()
    (root / "tokenizer-only" / "tokenizer_config.json").write_text("{}")
    weights = root / "good" / "model.safetensors"
    names = list(json.loads(weights.read_bytes()[8:8 + int.from_bytes(weights.read_bytes()[:8], "little")]))
    names = [n for n in names if n != "__metadata__"]
    for case, shard in (("missing-shard", "model-00001-of-00001.safetensors"), ("escaping-index", "../good/model.safetensors")):
        (root / case).mkdir()
        (root / case / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    (root / "truncated-shard").mkdir()
    data = weights.read_bytes()
    (root / "truncated-shard" / "model.safetensors").write_bytes(data[: len(data) // 2])
    (root / "a-file").write_text("not a directory")


def test_a_failure_on_rank_zero_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    _directories(tmp_path)
    results = run_ranks(every_case, 2, str(tmp_path), timeout=300, pg_timeout_s=120)
    by_case = {c["case"]: (c, results[1][i]) for i, c in enumerate(results[0])}
    expected = {"tokenizer-only": ("FileNotFoundError", "holds neither model.safetensors"),
                "missing-shard": ("FileNotFoundError", "model-00001-of-00001.safetensors"),
                "truncated-shard": ("RuntimeError", "rank 0 failed"),
                "escaping-index": ("ValueError", "lies outside"),
                "unwritable": ("NotADirectoryError", "save_pretrained"),
                "entries-on-rank-1": ("ValueError", "rank(s) [1] were given [1] entries")}
    for case, (error, words) in expected.items():
        zero, one = by_case[case]
        assert zero["error"] == one["error"] == error, (zero, one)
        assert zero["message"] == one["message"] and words in zero["message"], (zero, one)
        assert max(zero["s"], one["s"]) < 30, (zero, one)
    assert by_case["good"][0]["error"] is None and by_case["good"][1]["error"] is None, by_case["good"]
