"""Meta-device initialisation (fsdp_compile/api/materialize.py, gathered.py), rank-0 broadcast loading
(full_state.py) and the check that ranks were built alike, against the unsharded model, on 2 and 3 gloo
ranks (uneven shards). Rank functions: tests/meta_workers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_compile.examples.launch import run_ranks

from .meta_workers import (
    INITS,
    MEMORY_NET,
    SEED,
    InitNet,
    Net,
    apply_init,
    broadcast_load,
    disagreeing,
    every_init,
    init_memory,
    meta_init,
    one_unit,
    reference,
    train_steps,
)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys differ"
    wrong = [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert not wrong, f"{what}: not exactly the unsharded values: {wrong}"


@pytest.mark.parametrize("world", [2, 3])
def test_meta_init_gives_the_unsharded_values_and_trains(world: int) -> None:
    results = run_ranks(meta_init, world, timeout=300)
    ref = reference()
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses = train_steps(ref, compiled=False)
    for rank, r in enumerate(results):
        _same(r["full"], want, f"rank {rank} of {world}")
        assert torch.equal(r["freq"], ref.freq), "the init method fills the non-persistent buffer"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        # init, export and compiled steps are not the slow path (NOTE [the slow-path warning])
        assert r["slow_path_warnings"] == [], r["slow_path_warnings"]


def test_meta_init_under_mixed_precision_writes_the_fp32_values() -> None:
    """Outside a forward, a bf16-compute model's parameters read in their own dtype: the init is exact."""
    results = run_ranks(meta_init, 2, True, timeout=300)
    want = reference().state_dict()
    for rank, r in enumerate(results):
        _same(r["full"], want, f"bf16 compute, rank {rank}")
        assert all(torch.isfinite(torch.tensor(r["losses"])))


@pytest.mark.parametrize("world", [2, 3])
def test_meta_init_then_rank0_broadcast_load(world: int, tmp_path: Path) -> None:
    torch.manual_seed(11)
    ref = Net()
    ref.init_buffers()
    torch.save(ref.state_dict(), tmp_path / "sd.pt")
    results = run_ranks(broadcast_load, world, str(tmp_path / "sd.pt"), timeout=300)
    ref_losses = train_steps(ref, compiled=False)
    for rank, r in enumerate(results):
        _same(r["full"], {k: v for k, v in torch.load(tmp_path / "sd.pt").items()}, f"rank {rank} of {world}")
        assert r["keys"] == ([], [])
        assert r["exported_keys"] == (sorted(ref.state_dict()) if rank == 0 else []), "cpu_offload: rank 0 alone"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_every_nn_init_function_at_three_ranks() -> None:
    results = run_ranks(every_init, 3, timeout=300)
    for name in INITS:
        ref = InitNet()
        torch.manual_seed(SEED)
        apply_init(ref, name)
        for rank, r in enumerate(results):
            _same(r[name], ref.state_dict(), f"nn.init.{name}, rank {rank}")


_FIXES = ("differ across ranks", "torch.manual_seed", "meta device", "broadcast_from_rank0=True")
# What each rank's error says first: where its unit sits in the model, then what differs, in words.
_SAID = {
    "seeds": ["fully_shard of module 'blocks.0' (Block): the parameter values differ across ranks (rank 0 vs rank 1: "
              "same sizes, different values)"] * 2,
    # the first three blocks agree; then rank 0 shards the root, rank 1 its fourth block
    "depth": [f"fully_shard of {where}: the parameter sizes differ across ranks (elements in this unit: 740 on rank 0, "
              "661 on rank 1)" for where in ("the model's root (Net)", "module 'blocks.3' (Block)")],
    "one unit, seeds": ["fully_shard of the model's root (Net): the parameter values differ across ranks (rank 0 vs "
                        "rank 1: same sizes, different values)"] * 2,
}


@pytest.mark.parametrize("blocks", [0, 1], ids=["seeds", "depth"])
def test_ranks_built_differently_are_refused_and_the_check_is_cheap(blocks: int) -> None:
    """Different seeds, or one block more on rank 1: each fully_shard call compares its unit, and every rank
    raises at the same call (no hang)."""
    results = run_ranks(disagreeing, 2, blocks, timeout=300)
    for rank, r in enumerate(results):
        assert r["error"] is not None, "ranks that built different models were sharded without a word"
        assert r["error"].startswith(_SAID["depth" if blocks else "seeds"][rank]), r["error"]
        for fix in _FIXES:
            assert fix in r["error"]
        assert r["sums_s"] + r["collective_s"] < 0.05
    print(f"\nchecksums of the tiny model's parameters: {results[0]['sums_s'] * 1e3:.2f} ms, the all-reduce: "
          f"{results[0]['collective_s'] * 1e3:.2f} ms (gloo, 2 ranks)")


def test_a_model_sharded_as_one_unit_is_checked_too() -> None:
    """Only the root fully_shard(model), no sub-units: that call compares too; a meta-device model is
    compared by its sizes, so one block more on a rank is refused as well (not a hang)."""
    for rank, r in enumerate(run_ranks(one_unit, 2, timeout=300)):
        for case in ("seeds", "meta_depth"):
            assert r[case] is not None, f"rank {rank}, {case}: ranks that built different models were sharded"
            assert all(fix in r[case] for fix in _FIXES), (case, r[case])
        assert r["seeds"].startswith(_SAID["one unit, seeds"][rank]), r["seeds"]
        assert "the parameter sizes differ across ranks" in r["meta_depth"], r["meta_depth"]
        assert r["alike"] is None, r["alike"]


def test_memory_while_initialising_is_the_shards_plus_about_one_parameter(tmp_path: Path) -> None:
    """Peak bytes a rank allocates from to_empty to the end of its init (or of a rank-0 broadcast load):
    its shards, plus the parameter being initialised and what the init itself allocates on the unsharded
    model too, never the model (here 3x its shards). L below: the largest parameter (fc.weight, unpadded)."""
    torch.manual_seed(0)
    torch.save(Net(**MEMORY_NET).state_dict(), tmp_path / "sd.pt")
    results = run_ranks(init_memory, 3, str(tmp_path / "sd.pt"), timeout=300)
    for rank, r in enumerate(results):
        big, shards = r["largest"], r["shards"]
        slack = big // 64  # the small parameters' all-gathers and the profiler's own bytes
        # Reading the largest param to write it: the all-gather's output, which the init gets as the
        # parameter (narrowed past the padding rows, no copy: NOTE [eager gather, no copy]), plus gloo's
        # staging of the same size inside the collective (in its worker thread; NCCL writes straight
        # into the output) and a copy of this rank's shard that gloo's coalesced all-gather makes.
        read_bound = 2 * big + r["fc_shard"] + slack
        # Initialising: while the init function runs, the parameter gathered and the temporaries that
        # function allocates (torch's trunc_normal_ resamples through torch.where: about 3.25 params),
        # which the unsharded model's init allocates too (``init_own``); while gathering, the read above.
        init_bound = shards + max(big + r["init_own"], read_bound)
        # Broadcast loading: one staging buffer of the largest tensor's bytes, reused (rank 0 sends the
        # tensors it holds from where they lie), and the pickled header (names, shapes) that
        # broadcast_object_list sends first, a few KiB whose size varies by a few hundred bytes from run
        # to run. NOTE [rank-0 broadcast].
        load_bound = shards + big + 4 * slack
        print(f"\nrank {rank} of 3 (L = the largest param, {big / 1024:.0f} KiB; shards {shards / big:.2f} L): init "
              f"peak shards + {(r['init_peak'] - shards) / big:.2f} L (the init's own temporaries "
              f"{r['init_own'] / big:.2f} L); one read: peak {r['read_peak'] / big:.2f} L, {r['read_here'] / big:.2f} L "
              f"allocated outside gloo's threads; broadcast-load peak shards + {(r['load_peak'] - shards) / big:.2f} L")
        assert r["read_here"] <= big + r["fc_shard"] + slack, ("a copy of the gathered parameter", rank, r)
        assert r["read_peak"] <= read_bound, (rank, r)
        assert r["init_peak"] <= init_bound, (rank, r)
        assert r["load_peak"] <= load_bound, (rank, r)
        assert r["init_peak"] < r["model"] and r["load_peak"] < r["model"], (rank, r)
