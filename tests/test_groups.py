"""FsdpGroups makes its groups once per process, however many models use them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from fsdp_compile import FsdpGroups, fully_shard, make_backend
from fsdp_compile.examples.models import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=16, max_seq_len=8)


def _n_groups() -> int:
    return len(_world.pg_map)


@pytest.mark.parametrize("dedicated, expected", [("reduce_scatter", 2), ("all_gather", 2), ("none", 1)])
def test_group_count_does_not_grow_with_models(fake_world: int, dedicated: str, expected: int) -> None:
    groups = FsdpGroups.create(dedicated=dedicated)
    assert _n_groups() == expected  # WORLD, plus the dedicated one
    backend = make_backend(inductor=False)
    for seed in range(3):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        model = Transformer(CFG)
        for block in model.layers:
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        torch.compile(model, backend=backend)(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert _n_groups() == expected
    groups.destroy()
    assert _n_groups() == 1


def test_conventions_pick_the_dedicated_group(fake_world: int) -> None:
    rs = FsdpGroups.create(dedicated="reduce_scatter")
    assert rs.all_gather is dist.group.WORLD and rs.reduce_scatter is not dist.group.WORLD
    ag = FsdpGroups.create(dedicated="all_gather")
    assert ag.reduce_scatter is dist.group.WORLD and ag.all_gather is not dist.group.WORLD
    one = FsdpGroups.create(dedicated="none")
    assert one.all_gather is one.reduce_scatter is dist.group.WORLD
    for g in (rs, ag, one):
        g.destroy()


def test_the_heartbeat_stops_with_its_process_group() -> None:
    """A process group destroyed without FsdpGroups.destroy(): the heartbeat ends with it instead of
    writing on to a store that is gone (a FileStore whose file is deleted spun holding the GIL)."""
    import tempfile
    import threading
    import time

    from fsdp_compile.safety.peers import HEARTBEAT_S

    def beating() -> bool:
        return any(t.name == "fsdp_compile-heartbeat" and t.is_alive() for t in threading.enumerate())

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        FsdpGroups.create()
        assert beating()
        dist.destroy_process_group()
    deadline = time.monotonic() + 3 * HEARTBEAT_S + 1
    while beating() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not beating()


@pytest.mark.slow
def test_on_gloo_each_group_runs_one_collective_at_a_time() -> None:
    """(NOTE [one gloo thread per group]) Over a plain gloo group, FsdpGroups makes two new groups of one
    worker thread, with the base group's timeout; collectives in flight on both, many times over, run
    clean (on two-thread groups the same loop aborts on a corrupt heap within seconds)."""
    from fsdp_compile.examples.launch import run_ranks

    from .workers import collectives_in_flight

    for out in run_ranks(collectives_in_flight, 2, 8.0, timeout=120):
        assert out["groups"] == {"all_gather": ("gloo_serial", 1, 90.0, False),
                                 "reduce_scatter": ("gloo_serial", 1, 90.0, False)}
        assert out["rounds"] > 200 and out["last"] == [0.0, 0.0, 1.0, 1.0]
