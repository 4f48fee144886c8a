"""Bad input gets a ValueError/TypeError that names the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_compile import FsdpGroups, fully_shard, local_shard, make_backend


def test_no_process_group() -> None:
    with pytest.raises(ValueError, match=r"no default process group.*init_process_group"):
        FsdpGroups.create()
    with pytest.raises(ValueError, match=r"no default process group.*init_process_group"):
        fully_shard(nn.Linear(2, 2), groups=None)  # type: ignore[arg-type]


def test_bad_dedicated(fake_world: int) -> None:
    with pytest.raises(ValueError, match=r"dedicated='both'.*'reduce_scatter'"):
        FsdpGroups.create(dedicated="both")


def test_groups_must_be_fsdp_groups(fake_world: int) -> None:
    with pytest.raises(TypeError, match=r"FsdpGroups.create\(\)"):
        fully_shard(nn.Linear(2, 2), groups="world")  # type: ignore[arg-type]


def test_fully_shard_twice(groups: FsdpGroups) -> None:
    m = nn.Linear(4, 4)
    fully_shard(m, groups=groups)
    with pytest.raises(ValueError, match=r"already a unit; call fully_shard once per module"):
        fully_shard(m, groups=groups)


def test_param_shared_by_two_units(groups: FsdpGroups) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    root = nn.Sequential(a, b)
    fully_shard(a, groups=groups)
    with pytest.raises(ValueError, match=r"'weight' of Linear is shared with unit.*closest module that contains"):
        fully_shard(b, groups=groups)
    # the same tie seen from the root: the root's own module b still holds unit a's param
    with pytest.raises(ValueError, match=r"'1.weight' of Sequential is shared with unit"):
        fully_shard(root, groups=groups)


def test_integer_param(groups: FsdpGroups) -> None:
    m = nn.Linear(4, 4)
    m.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    with pytest.raises(TypeError, match=r"'steps'.*torch.int64.*register_buffer"):
        fully_shard(m, groups=groups)
    m2 = nn.Module()
    m2.flag = nn.Parameter(torch.zeros(2, dtype=torch.bool), requires_grad=False)
    with pytest.raises(TypeError, match=r"torch.bool"):
        fully_shard(m2, groups=groups)


def test_params_on_two_devices(groups: FsdpGroups) -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"several devices.*module.to\(device\)"):
        fully_shard(m, groups=groups)


def test_bad_mesh_type(fake_world: int) -> None:
    with pytest.raises(TypeError, match=r"mesh must be None, a ProcessGroup or a DeviceMesh"):
        FsdpGroups.create(mesh=[0, 1])  # type: ignore[arg-type]


def test_unmanaged_trainable_param_is_refused_at_compile(groups: FsdpGroups) -> None:
    """Only a block sharded, no root call: the rest would train without gradient sync. Refused."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], groups=groups)
    compiled = torch.compile(model, backend=make_backend(inductor=False))
    with pytest.raises(Exception, match=r"not managed by any fully_shard unit.*fully_shard\(model, groups=groups\)"):
        compiled(torch.randn(2, 4))


def test_root_before_blocks_is_refused(groups: FsdpGroups) -> None:
    """The root first would take every parameter; the blocks would become empty units. Refused, with
    the order to use."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, groups=groups)
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): its parameter 'weight' already belongs to the unit "
                                         r"of the enclosing Sequential.*blocks first, then on the root"):
        fully_shard(model[0], groups=groups)


def test_local_shard(groups: FsdpGroups) -> None:
    """``local_shard`` is the parameter the optimizer sees: rank 0's first ceil(5 / 2) = 3 rows."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    fully_shard(model, groups=groups)
    shard = local_shard(model[0], "weight")
    assert shard is model[0].parametrizations.weight.original
    assert shard.shape == (3, 4) and any(p is shard for p in model.parameters())
    assert local_shard(model, "0.bias").shape == (3,)
    with pytest.raises(ValueError, match=r"'weight' of ReLU is not a sharded parameter"):
        local_shard(nn.ReLU(), "weight")


def test_bad_agreement_timeout() -> None:
    with pytest.raises(ValueError, match=r"agreement_timeout_s=0.*positive number of seconds"):
        make_backend(agreement_timeout_s=0)
