"""``fully_shard``: turn a module's parameters into dim-0 shards read through the ``unshard`` marker.

Each call makes one *unit*: the module's parameters that no earlier call took. Call it on blocks first,
then on the root, as with FSDP2. After the call, each of the unit's parameters is the same
``nn.Parameter`` object as before, now holding this rank's padded dim-0 shard (see NOTE [padding] in
``ops``), registered as ``<module>.parametrizations.<name>.original``; reading ``module.<name>`` calls
``fsdp::unshard`` on it, which Dynamo traces and the backend lowers to collectives.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .groups import FsdpGroups
from .module import mix_in
from .ops import shard_rows
from .units import MixedPrecisionPolicy, ShardedParam, Unit, _params, _units, unit_of

__all__ = ["MixedPrecisionPolicy", "Unit", "fully_shard", "unit_of"]


class Unshard(nn.Module):
    """The parametrization: ``module.<name>`` reads ``fsdp::unshard(shard, ...)``."""

    def __init__(self, param: ShardedParam) -> None:
        super().__init__()
        self.param = param

    def forward(self, shard: Tensor) -> Tensor:
        p = self.param
        unit = p.unit
        # The constant arguments are computed once (``marker_args``), not re-read per trace: Dynamo
        # traces this for every parameter read.
        accumulate = p.accumulator if (not unit.requires_grad_sync or unit.pending) else None
        return torch.ops.fsdp.unshard(shard, *p.marker_args, accumulate)

    def right_inverse(self, tensor: Tensor) -> Tensor:
        # Called once at registration with the full param; a shared param's second registration
        # hands in the shard itself.
        if self.param.sharded:
            assert tensor is self.param.shard
            return tensor
        self.param.sharded = True
        return _local_shard(tensor.detach(), self.param.unit.groups)


def _local_shard(full: Tensor, groups: FsdpGroups) -> Tensor:
    world = groups.shard_size
    rank = groups.all_gather.rank()
    flat = full.reshape(1) if full.dim() == 0 else full
    rows = shard_rows(flat.shape[0], world)
    start, stop = min(rank * rows, flat.shape[0]), min((rank + 1) * rows, flat.shape[0])
    shard = flat.new_zeros(rows, *flat.shape[1:])
    shard[: stop - start].copy_(flat[start:stop])
    return shard


def _check_params(module: nn.Module, unit_name: str, new: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    devices = {p.device for _, _, p in new}
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard({unit_name}): its parameters live on several devices {sorted(map(str, devices))}; "
            "move the module to one device first (module.to(device)) and call fully_shard again."
        )
    for owner, name, p in new:
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(
                f"fully_shard({unit_name}): parameter {name!r} of {type(owner).__name__} has dtype {p.dtype}; "
                "only floating-point parameters can be sharded. Register it as a buffer "
                "(module.register_buffer) instead of an nn.Parameter."
            )


def fully_shard(
    module: nn.Module,
    *,
    groups: FsdpGroups,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters that no earlier ``fully_shard`` call took, as one unit.

    Call it on each block first, then on the root. ``groups`` comes from ``FsdpGroups.create()``,
    made once per process. With ``reshard_after_forward`` (default) the forward keeps only shards and
    the backward gathers again; with ``False`` the gathered params are kept from forward to backward.
    Returns ``module`` (sharded in place). Buffers stay replicated; frozen parameters are gathered
    but never reduced.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fully_shard: no default process group is initialised; call "
            "torch.distributed.init_process_group(...) and then groups = FsdpGroups.create() first."
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: expected an nn.Module, got {type(module).__name__}.")
    if not isinstance(groups, FsdpGroups):
        raise TypeError(
            f"fully_shard: groups must be an FsdpGroups (FsdpGroups.create()), got {type(groups).__name__}."
        )
    unit_name = type(module).__name__
    if module in _units:
        raise ValueError(
            f"fully_shard({unit_name}): this module is already a unit; call fully_shard once per module "
            "(blocks first, then the root)."
        )
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}.")

    # Which (owner, name, param) does this unit take? Everything not managed yet; a param that an
    # earlier unit manages may only appear here behind that unit's parametrization.
    new: list[tuple[nn.Module, str, nn.Parameter]] = []
    visited: set[int] = set()  # a module reachable under two names is sharded once
    for mod_name, owner in module.named_modules(remove_duplicate=False):
        if isinstance(owner, parametrize.ParametrizationList) or id(owner) in visited:
            continue
        visited.add(id(owner))
        for pname, p in list(owner._parameters.items()):
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if p in _params:
                other = _params[p].unit
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} of {unit_name} is shared with unit "
                    f"{other.fqn or type(other.module).__name__!r} ({_params[p].fqn}); a parameter must belong "
                    "to one unit: call fully_shard on the closest module that contains all its users "
                    "instead, or untie the parameter."
                )
            new.append((owner, fqn, p))
    _check_params(module, unit_name, new)

    unit = Unit(
        index=0,  # set by _renumber_subunits below
        module_ref=weakref.ref(module),
        groups=groups,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
    )
    seen: dict[nn.Parameter, ShardedParam] = {}
    for owner, fqn, p in new:
        sp = seen.get(p)
        if sp is None:
            p.grad = None
            sp = ShardedParam(shard=p, full_shape=tuple(p.shape), local_name=fqn, unit=unit)
            seen[p] = sp
            unit.params.append(sp)
        pname = fqn.rsplit(".", 1)[-1]
        with torch.no_grad():
            parametrize.register_parametrization(owner, pname, Unshard(sp), unsafe=True)
        _params[p] = sp
    _units[module] = unit
    _renumber_subunits(module, unit)
    _cast_hooks(module, mp_policy)
    mix_in(module)
    return module


def _cast(tensors: object, dtype: torch.dtype) -> object:
    return torch.utils._pytree.tree_map_only(
        Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tensors
    )


def _cast_hooks(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
    """Mixed precision at the unit's boundary: floating inputs to ``param_dtype`` (when
    ``cast_forward_inputs``), floating outputs to ``output_dtype``."""
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        dtype = mp.param_dtype
        module.register_forward_pre_hook(lambda _m, args, kwargs: (_cast(args, dtype), _cast(kwargs, dtype)),
                                         with_kwargs=True)
    if mp.output_dtype is not None:
        out_dtype = mp.output_dtype
        module.register_forward_hook(lambda _m, _args, out: _cast(out, out_dtype))


def _renumber_subunits(root: nn.Module, root_unit: Unit) -> None:
    """Name units and params relative to the newest root and number units in forward order.

    Graph op arguments then read ``layers.0.attn.wq.weight`` and units ``0..n-1`` however many models
    this process built before, which keeps schedules (and their snapshots) stable.
    """
    order: list[Unit] = []
    for mod_name, mod in root.named_modules():
        sub = _units.get(mod)
        if sub is not None and sub is not root_unit:
            sub.fqn = mod_name
            order.append(sub)
    root_unit.fqn = ""
    order.append(root_unit)
    for i, unit in enumerate(order):
        unit.index = i
        for sp in unit.params:
            sp.marker_args = _marker_args(sp)


def _marker_args(p: ShardedParam) -> tuple:
    """The arguments of ``fsdp::unshard`` after the shard (see ``ops.unshard``), all constants."""
    unit = p.unit
    groups = unit.groups
    mp = unit.mp_policy
    return (
        list(p.full_shape),
        groups.shard_size,
        unit.index,
        p.fqn,
        groups.all_gather.group_name,
        groups.reduce_scatter.group_name,
        groups.replicate.group_name if groups.replicate is not None else "",
        groups.replicate_size,
        unit.reshard_after_forward,
        mp.param_dtype,
        mp.reduce_dtype if mp.reduce_dtype is not None else mp.param_dtype,
    )
