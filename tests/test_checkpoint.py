"""DCP checkpoints of sharded models (fsdp_compile/api/checkpoint.py): resharding, padding, full export, errors.

Multi-process cases run on gloo through fsdp_compile.examples.launch.run_ranks (rank functions in
tests/checkpoint_workers.py), training uncompiled for speed; the layout and error checks run in this
process under a fake process group.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_compile import FsdpGroups, fully_shard
from fsdp_compile.api.checkpoint import (
    get_full_model_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from fsdp_compile.examples.launch import run_ranks
from .checkpoint_workers import AFTER, BEFORE, at_four_ranks, load_odd, reference, resume, save_and_continue
from .graph_utils import fake_process_group
from .workers import ref_slice

RTOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Save at 2 ranks, resume at 4 (flat and HSDP) and at 1
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A checkpoint after BEFORE AdamW steps at 2 ranks, and that run continued for AFTER steps."""
    path = tmp_path_factory.mktemp("llama") / "ckpt"
    return path, run_ranks(save_and_continue, 2, str(path), BEFORE, AFTER, timeout=300)


def _check_resumed(r: dict[str, Any], uninterrupted: list[float], what: str) -> None:
    assert r["lr"] == pytest.approx(1e-2), f"{what}: param_groups (lr) not restored"
    assert r["padding_zero"], f"{what}: padded rows of shards or optimizer state are not zero after loading"
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(uninterrupted[BEFORE:]), rtol=RTOL, atol=0,
        msg=lambda m: f"{what}: losses after resuming differ from the uninterrupted run\n{m}",
    )


@pytest.fixture(scope="module")
def four_ranks(saved: tuple[Path, list], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One 4-rank run (start-up is the slow part): the llama checkpoint resumed flat and as HSDP, and
    the OddModel checkpoint saved (returned with its path)."""
    tmp = tmp_path_factory.mktemp("four")
    out = run_ranks(at_four_ranks, 4, str(saved[0]), str(tmp / "hsdp"), str(tmp / "odd"), timeout=300)
    return tmp / "odd", out


def test_resume_at_four_ranks_flat_and_hsdp(saved: tuple[Path, list], four_ranks: tuple[Path, list]) -> None:
    _, results = saved
    for rank, r in enumerate(four_ranks[1]):
        _check_resumed(r["flat"], results[0]["losses"], f"4 ranks, rank {rank}")
        _check_resumed(r["hsdp"], results[0]["losses"], f"HSDP 2x2, rank {rank}")
        assert r["hsdp"]["mesh_ndim"] == 2, "HSDP state dicts live on a 2-D (replicate, shard) mesh"
        assert r["hsdp"]["roundtrip_model"] and r["hsdp"]["roundtrip_optim"], "HSDP save + load is not exact"


def test_resume_at_one_rank(saved: tuple[Path, list]) -> None:
    path, results = saved
    (r,) = run_ranks(resume, 1, str(path), BEFORE, AFTER, timeout=300)
    _check_resumed(r, results[0]["losses"], "1 rank")


def test_full_state_dict_at_two_ranks_matches_single_process(saved: tuple[Path, list]) -> None:
    _, results = saved
    ref_losses, ref_sd = reference(BEFORE + AFTER)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    full = results[0]["full"]
    assert results[1]["full"] == {}, "rank0_only: other ranks get an empty dict"
    assert list(full) == list(ref_sd), "same keys, same order as the unsharded model's state_dict()"
    for name, value in ref_sd.items():
        assert full[name].shape == value.shape and full[name].dtype == value.dtype and full[name].device.type == "cpu"
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=1e-6, msg=lambda m, n=name: f"{n}\n{m}")


# ---------------------------------------------------------------------------------------------
# Uneven shapes saved at 4 ranks, loaded at 3: padding never shows
# ---------------------------------------------------------------------------------------------


def test_uneven_shapes_padding_never_appears(four_ranks: tuple[Path, list]) -> None:
    """OddModel (UnevenModel's vocabulary 1001 and width 10, a 0-d param, 1 and 5 rows) saved at 4 ranks."""
    path, results = four_ranks
    r0 = results[0]["odd"]
    unsharded = r0["unsharded"]
    # The full state dict is exactly the unsharded copy's state_dict(): names (aliases included), shapes, values.
    assert list(r0["full_at_init"]) == list(unsharded)
    for name, value in unsharded.items():
        assert torch.equal(r0["full_at_init"][name], value), name
    # get_model_state_dict: user names, full shapes; sharded params are DTensors, the rest plain.
    assert not any("parametrizations" in k for k in r0["shapes"])
    assert any("parametrizations" in k for k in r0["model_keys"]), "the raw state_dict() is what we translate"
    assert {k: shape for k, (_, shape) in r0["shapes"].items()} == {k: tuple(v.shape) for k, v in unsharded.items()}
    kinds = {k: kind for k, (kind, _) in r0["shapes"].items()}
    assert kinds["body.head.weight"] == kinds["odd.temperature"] == kinds["body.layers.0.again.weight"] == "DTensor"
    assert kinds["free.weight"] == kinds["shift"] == kinds["body.layers.1.scale"] == "Tensor"
    # What DCP wrote: global shapes, never padded ones.
    written = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, value in unsharded.items():
        assert tuple(written[f"model.{name}"].size) == tuple(value.shape), name
    for key, value in r0["optim"].items():
        assert tuple(written[f"optim.state.{key}"].size) == tuple(value.shape), key
    assert not any(k.startswith("optim.state.body.emb.weight") for k in written), "frozen: no optimizer state"

    loaded = run_ranks(load_odd, 3, str(path), timeout=300)
    for rank, r in enumerate(loaded):
        assert r["padding_zero"] and r["padding_zero_after_step"], f"rank {rank}: padding not zero"
        assert r["loaded_shapes"] == {k: tuple(v.shape) for k, v in unsharded.items()}
    l0 = loaded[0]
    assert list(l0["full"]) == list(r0["full"])
    for name, value in r0["full"].items():
        assert torch.equal(l0["full"][name], value), f"model {name} changed through save at 4 / load at 3"
    assert sorted(l0["optim"]) == sorted(r0["optim"]) and any(k.endswith("exp_avg_sq") for k in r0["optim"])
    for key, value in r0["optim"].items():
        assert torch.equal(l0["optim"][key], value), f"optimizer state {key} changed through save at 4 / load at 3"


# ---------------------------------------------------------------------------------------------
# In-process checks under a fake process group (no communication)
# ---------------------------------------------------------------------------------------------




class Shapes(nn.Module):
    """Params with dim 0 of 10, 5, 1 and 1001 rows, a 0-d param, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ten = nn.Parameter(torch.randn(10, 3))
        self.five = nn.Parameter(torch.randn(5))
        self.one = nn.Parameter(torch.randn(1, 4))
        self.big = nn.Parameter(torch.randn(1001, 2))
        self.scalar = nn.Parameter(torch.tensor(3.0))
        self.register_buffer("buf", torch.arange(4.0))


# DTensor's Shard(0) chunk sizes (torch.chunk: ceil(n / world) rows each, the last ones short or empty).
EXPECTED_ROWS = {("ten", 4): [3, 3, 3, 1], ("five", 4): [2, 2, 1, 0], ("ten", 3): [4, 4, 2], ("one", 2): [1, 0]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_row_split_is_dtensor_shard0_chunking(world: int) -> None:
    rows_seen: dict[str, list[int]] = {}
    for rank in range(world):
        with fake_process_group(world, rank):
            groups = FsdpGroups.create(dedicated="none")
            model = Shapes()
            full = copy.deepcopy(model).state_dict()
            fully_shard(model, groups=groups)
            sd = get_model_state_dict(model)
            assert list(sd) == list(full)
            assert isinstance(sd["buf"], torch.Tensor) and not isinstance(sd["buf"], DTensor)
            for name in ("ten", "five", "one", "big"):
                d = sd[name]
                assert isinstance(d, DTensor) and d.shape == full[name].shape and d.stride() == full[name].stride()
                shape, offset = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
                local = d.to_local()
                assert tuple(local.shape) == tuple(shape), (name, rank, world)
                assert torch.equal(local, full[name][offset[0]:offset[0] + shape[0]]), (name, rank, world)
                rows_seen.setdefault(name, []).append(shape[0])
            assert sd["scalar"].shape == () and all(isinstance(p, Replicate) for p in sd["scalar"].placements)
            if rank == 0:
                assert sd["scalar"].to_local().item() == 3.0
            if world == 1:  # no communication needed: the full state dict is checked in-process
                exported = get_full_model_state_dict(model)
                assert list(exported) == list(full) and all(torch.equal(exported[k], v) for k, v in full.items())
    for (name, w), rows in EXPECTED_ROWS.items():
        if w == world:
            assert rows_seen[name] == rows, name


def test_plain_full_tensors_load_into_padded_shards(fake_world: int, groups: FsdpGroups) -> None:
    source = Shapes()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    model = fully_shard(Shapes(), groups=groups)
    set_model_state_dict(torch.compile(model), source.state_dict())  # torch.compile's wrapper is looked through
    for name, p in model.named_parameters():
        short = name.split(".")[1]
        assert torch.equal(p.detach(), ref_slice(source.state_dict()[short], 0, fake_world)), name
    partial = {"ten": source.ten.detach(), "extra": torch.ones(1)}
    missing, unexpected = set_model_state_dict(model, partial, strict=False)
    assert "five" in missing and unexpected == ["extra"]


def test_error_messages_name_the_fix(fake_world: int, groups: FsdpGroups) -> None:
    with pytest.raises(ValueError, match=r"no fully_shard units.*call fully_shard"):
        get_model_state_dict(nn.Linear(2, 2))
    model = fully_shard(Shapes(), groups=groups)
    sd = get_model_state_dict(model)
    with pytest.raises(TypeError, match="mapping of names to tensors"):
        set_model_state_dict(model, [1, 2])  # type: ignore[arg-type]
    partial = {k: v for k, v in sd.items() if k != "five"}
    with pytest.raises(ValueError, match=r"missing keys \['five'\].*strict=False"):
        set_model_state_dict(model, partial)
    with pytest.raises(ValueError, match=r"unexpected keys \['bogus'\]"):
        set_model_state_dict(model, {**sd, "bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'ten'.*shape \(11, 3\).*\(10, 3\).*different model"):
        set_model_state_dict(model, {**sd, "ten": torch.zeros(11, 3)})
    replicated = DTensor.from_local(torch.zeros(10, 3), sd["ten"].device_mesh, [Replicate()], run_check=False)
    with pytest.raises(ValueError, match=r"'ten'.*local part.*get_model_state_dict"):
        set_model_state_dict(model, {**sd, "ten": replicated})
    with pytest.raises(TypeError, match=r"'buf' is a DTensor.*plain tensor"):
        set_model_state_dict(model, {**sd, "buf": DTensor.from_local(torch.zeros(4), sd["ten"].device_mesh,
                                                                     [Replicate()], run_check=False)})
    foreign = torch.optim.AdamW([nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match=r"not one of the model's.*model.parameters\(\) after fully_shard"):
        get_optimizer_state_dict(model, foreign)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="'state' and 'param_groups'"):
        set_optimizer_state_dict(model, opt, {"state": {}})
    osd = get_optimizer_state_dict(model, opt)
    with pytest.raises(ValueError, match=r"1 param groups hold .*the saved 2 hold.*same params and groups"):
        set_optimizer_state_dict(model, opt, {**osd, "param_groups": osd["param_groups"] * 2})
    with pytest.raises(ValueError, match=r"state for params the optimizer lacks: \['nope'\]"):
        set_optimizer_state_dict(model, opt, {**osd, "state": {**osd["state"], "nope": {}}})


def test_state_dict_options_follow_torch() -> None:
    """torch's StateDictOptions and signatures (one rank: the full dict and the broadcast need no peers;
    tests/test_meta_init.py runs them at 2 and 3)."""
    with fake_process_group(1, 0):
        groups = FsdpGroups.create(dedicated="none")
        model = nn.Sequential(Shapes(), nn.Linear(2, 2))
        model[1].weight.requires_grad_(False)
        full = copy.deepcopy(model).state_dict()
        fully_shard(model, groups=groups)
        exported = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        assert list(exported) == list(full) and all(torch.equal(exported[k], v) for k, v in full.items())
        frozen_out = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        assert "1.weight" not in frozen_out and "1.bias" in frozen_out
        inner = get_model_state_dict(model, submodules={model[0]}, options=StateDictOptions(keep_submodule_prefixes=False))
        assert list(inner) == ["ten", "five", "one", "big", "scalar", "buf"]
        source = {k: v + 1 for k, v in full.items()}
        keys = set_model_state_dict(model, source, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        assert keys == ([], [])
        back = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        assert all(torch.equal(back[k], v) for k, v in source.items())
        with pytest.raises(ValueError, match="missing keys.*strict=False"):
            set_model_state_dict(model, {"0.ten": full["0.ten"]},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        with pytest.raises(ValueError, match="broadcast_from_rank0=True needs full_state_dict=True"):
            set_model_state_dict(model, source, options=StateDictOptions(broadcast_from_rank0=True))
        with pytest.raises(NotImplementedError, match="cpu_offload=True is supported with full_state_dict=True only"):
            get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
        with pytest.raises(NotImplementedError, match="optimizer state.*dcp.save"):
            get_optimizer_state_dict(model, torch.optim.SGD(model.parameters()),
                                     options=StateDictOptions(full_state_dict=True))
        groups.destroy()


def test_fresh_optimizer_state_is_created_without_moving_params(fake_world: int, groups: FsdpGroups) -> None:
    model = fully_shard(Shapes(), groups=groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.3, weight_decay=0.1)
    osd = get_optimizer_state_dict(model, opt)
    assert set(osd["state"]) == {"ten", "five", "one", "big", "scalar"}
    assert osd["param_groups"][0]["lr"] == 0.3 and osd["param_groups"][0]["params"] == list(osd["state"])
    assert isinstance(osd["state"]["ten"]["exp_avg"], DTensor) and osd["state"]["ten"]["exp_avg"].shape == (10, 3)
    assert not isinstance(osd["state"]["ten"]["step"], DTensor)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) and p.grad is None, n
