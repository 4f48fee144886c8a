"""``fully_shard``: each call makes one *unit* of the module's parameters that no earlier call took.

Each stays the same ``nn.Parameter``, now holding this rank's padded dim-0 shard (NOTE [padding] in
``markers.py``) as ``<module>.parametrizations.<name>.original``; ``module.<name>`` calls ``fsdp::unshard``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize

from fsdp_compile._compat import tree_map_only
from fsdp_compile.api.flat_shard import flatten_unit, key_flats
from fsdp_compile.api.gathered import gathered
from fsdp_compile.api.groups import FsdpGroups
from fsdp_compile.api.materialize import check_built_alike, hand_out_global_grads, local_sums, register_grad_hook
from fsdp_compile.api.module import FsdpModule, forward_of, mix_in
from fsdp_compile.api.markers import ANONYMOUS_UNIT, read_outside_forward, shard_rows
from fsdp_compile.api.reads import (accumulator, eager_args, forward_depth_hooks, in_eager_forward,
                                    install_read, read_args, traced_unshard)
from fsdp_compile.api.stack import BlockStack, add_sharded_block, check_stacks_sharded, stack_of
from fsdp_compile.api.state_layout import row_range
from fsdp_compile.api.units import MixedPrecisionPolicy, ShardedParam, Unit, _params, _units, unit_of, units_under
from fsdp_compile.passes.graph_ops import flatten_shapes

__all__ = ["MixedPrecisionPolicy", "Unit", "fully_shard", "local_shard", "unit_of"]


class Unshard(nn.Module):
    """The parametrization: ``module.<name>`` reads ``fsdp::unshard(shard, ...)``."""

    def __init__(self, param: ShardedParam) -> None:
        super().__init__()
        self.param = param

    def forward(self, shard: Tensor) -> Tensor:
        p = self.param
        if torch.compiler.is_compiling():  # (a stack's block reads the shard its body hands in)
            return traced_unshard(p.read_plan, lambda: shard, lambda: p, flat=not p.unit.stacked)
        with contextlib.nullcontext() if in_eager_forward() else read_outside_forward():  # NOTE [the slow-path warning]
            (full,) = torch.ops.fsdp.unshard(shard, *eager_args(p), accumulator(p))
        return gathered(full, p)  # NOTE [reading a sharded parameter]

    def right_inverse(self, tensor: Tensor) -> Tensor:
        # Called at registration with the full param; a shared param's second registration hands in the shard.
        if self.param.sharded:
            assert tensor is self.param.shard
            return tensor
        self.param.sharded = True
        return _local_shard(tensor.detach(), self.param)


class _Chain(parametrize.ParametrizationList):
    """A sharded parameter's parametrization list: a parametrization added to it (``weight_norm`` after
    ``fully_shard``, say) takes the parameter off the lean traced read (NOTE [traced reads])."""

    def _fsdp_leave_lean_read(self) -> None:
        # The owner's own dict, shared (a deepcopy or pickle of the model keeps the two together)
        self.__dict__["_fsdp_reads"][self.__dict__["_fsdp_name"]] = None

    def append(self, module: nn.Module) -> _Chain:
        self._fsdp_leave_lean_read()
        super().append(module)
        return self

    def extend(self, modules: Any) -> _Chain:
        self._fsdp_leave_lean_read()
        super().extend(modules)
        return self

    def insert(self, index: int, module: nn.Module) -> None:
        self._fsdp_leave_lean_read()
        super().insert(index, module)

    def __setitem__(self, idx: Any, module: Any) -> None:
        self._fsdp_leave_lean_read()
        super().__setitem__(idx, module)

    def __delitem__(self, idx: Any) -> None:
        self._fsdp_leave_lean_read()
        super().__delitem__(idx)


def _lean_read(owner: nn.Module, name: str, sp: ShardedParam | None) -> None:
    """Put ``owner.<name>`` on the lean traced read (NOTE [traced reads]); ``sp=None``: parametrize's path."""
    install_read(type(owner), name)  # parametrize's class for this module alone
    chain = owner._modules["parametrizations"]._modules[name]  # type: ignore[index]
    if type(chain) is parametrize.ParametrizationList:
        chain.__class__ = _Chain
    reads = owner.__dict__.setdefault("_fsdp_reads", {})
    chain.__dict__["_fsdp_reads"], chain.__dict__["_fsdp_name"] = reads, name
    reads[name] = sp.read_plan if len(chain._modules) == 1 and sp is not None else None  # kept by replan


def _local_shard(full: Tensor, sp: ShardedParam) -> Tensor:
    start, stop = row_range(sp)
    flat = full.reshape(1) if full.dim() == 0 else full
    shard = flat.new_zeros(shard_rows(flat.shape[0], sp.unit.groups.shard_size), *flat.shape[1:])
    shard[: stop - start].copy_(flat[start:stop])
    sp.real_rows = stop - start
    return shard


def _check_params(unit_name: str, new: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    devices = {p.device for _, _, p in new}
    if len(devices) > 1:
        raise ValueError(f"fully_shard({unit_name}): its parameters live on several devices "
                         f"{sorted(map(str, devices))}; move the module to one device first (module.to(device)) "
                         "and call fully_shard again.")
    for owner, name, p in new:
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"fully_shard({unit_name}): parameter {name!r} of {type(owner).__name__} has dtype "
                            f"{p.dtype}; only floating-point parameters can be sharded. Register it as a buffer "
                            "(module.register_buffer) instead of an nn.Parameter.")


def fully_shard(module: nn.Module, *, groups: FsdpGroups, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None, outline: bool | None = None) -> nn.Module:
    """Shard ``module``'s parameters that no earlier ``fully_shard`` call took, as one unit; returns ``module``.

    Call it on each block first, then on the root, with ``groups`` from ``FsdpGroups.create()``.
    ``reshard_after_forward=False`` keeps the gathered params from forward to backward. ``outline``: compile
    this unit's forward once for every unit with the same forward (NOTE [outlined units] in ``module.py``);
    ``None`` (default) decides, ``False`` suits a block Dynamo cannot trace whole. A
    :class:`~fsdp_compile.api.stack.BlockStack` has each block sharded as a unit of its own. Buffers stay
    replicated; frozen parameters are gathered, never reduced. Each call checks that every rank built the
    unit's parameters alike (NOTE [ranks built alike] in ``materialize.py``; only sizes on the meta device:
    then ``to_empty`` and run the init, NOTE [initialising sharded parameters]).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("fully_shard: no default process group is initialised; call "
                         "torch.distributed.init_process_group(...) and then groups = FsdpGroups.create() first.")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: expected an nn.Module, got {type(module).__name__}.")
    if not isinstance(groups, FsdpGroups):
        raise TypeError(f"fully_shard: groups must be an FsdpGroups (FsdpGroups.create()), got "
                        f"{type(groups).__name__}.")
    unit_name = class_name(module)
    if module in _units:
        raise ValueError(f"fully_shard({unit_name}): this module is already a unit; call fully_shard once per "
                         "module (blocks first, then the root).")
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}.")
    if outline is not None and not isinstance(outline, bool):
        raise TypeError(f"fully_shard: outline must be True, False or None (decide), got {outline!r}.")

    if isinstance(module, BlockStack):
        for block in module:
            if block not in _units:
                fully_shard(block, groups=groups, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                            outline=outline)
        check_built_alike(module, unit_name, units_under(module), groups)  # NOTE [ranks built alike]
        return module
    _check_order(module, unit_name)
    stack = stack_of(module)
    if stack is not None and outline:
        raise ValueError(f"fully_shard({unit_name}): outline=True, but this block belongs to a BlockStack, whose blocks "
                         "are compiled as one body already (NOTE [stacked blocks]); leave outline=None.")
    check_stacks_sharded(module, unit_name)
    # The (owner, name, param) this unit takes: everything not managed yet (an earlier unit's params
    # appear here only behind its parametrization).
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
                raise ValueError(f"fully_shard: parameter {fqn!r} of {unit_name} is shared with unit "
                                 f"{other.fqn or type(other.module).__name__!r} ({_params[p].fqn}); a parameter must "
                                 "belong to one unit: call fully_shard on the closest module that contains all its "
                                 "users instead, or untie the parameter.")
            new.append((owner, fqn, p))
    _check_params(unit_name, new)

    unit = Unit(index=0, module_ref=weakref.ref(module), groups=groups, reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy, outline=False if stack is not None else outline, stacked=stack is not None)
    unit.built_sums = local_sums(list({id(p): p for _, _, p in new}.values()))  # NOTE [ranks built alike]
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
        _lean_read(owner, pname, sp if stack is None else None)  # a stack's body reads through parametrize
        sp.owners.append((weakref.ref(owner), pname))  # NOTE [converted parameters]
        if _params.get(p) is None:
            register_grad_hook(p, hand_out_global_grads(sp))
        _params[p] = sp
    if stack is not None:
        add_sharded_block(stack, module, unit)
    flatten_unit(unit)
    _units[module] = unit
    _renumber_subunits(module, unit)
    forward_depth_hooks(module)  # eager reads inside a forward: cast (mixed precision), and warned of
    _cast_hooks(module, mp_policy)
    check_built_alike(module, unit_name, units_under(module), groups)  # NOTE [ranks built alike]
    return module


def class_name(module: nn.Module) -> str:
    """The user's class name of ``module``, not parametrize's or ``FsdpModule``'s around it."""
    for cls in type(module).__mro__:
        if not issubclass(cls, FsdpModule) and cls.__module__ != parametrize.__name__:
            return cls.__name__
    return type(module).__name__


def _check_order(module: nn.Module, unit_name: str) -> None:
    """Refuse a module whose parameters an enclosing module's unit already took (root sharded first)."""
    inside = {id(m) for m in module.modules()}
    for mod_name, owner in module.named_modules():
        if not parametrize.is_parametrized(owner):
            continue
        for pname, chain in owner.parametrizations.items():  # type: ignore[union-attr]
            other = next((p.param.unit for p in chain if isinstance(p, Unshard)), None)
            if other is not None and id(other.module) not in inside:
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                raise ValueError(f"fully_shard({unit_name}): its parameter {fqn!r} already belongs to the unit of "
                                 f"the enclosing {class_name(other.module)}, so fully_shard was called on the outer "
                                 "module first. Call fully_shard on the blocks first, then on the root (as with "
                                 "FSDP2): `for block in model.layers: fully_shard(block, groups=groups)`, then "
                                 "`fully_shard(model, groups=groups)`.")


def local_shard(module: nn.Module, name: str) -> nn.Parameter:
    """This rank's shard of the sharded parameter ``module.<name>``, with no communication: the
    ``nn.Parameter`` the optimizer updates, rows ``[i * r, (i + 1) * r)`` of the full parameter's dim 0 for
    the rank at place ``i`` of the shard group (``r = ceil(dim0 / shard world)``), zero-padded (NOTE [padding]).
    """
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    chain = owner.parametrizations[leaf] if parametrize.is_parametrized(owner, leaf) else ()  # type: ignore[index]
    if not any(isinstance(p, Unshard) for p in chain):
        raise ValueError(f"local_shard: {name!r} of {type(module).__name__} is not a sharded parameter; call "
                         f"fully_shard on the module that holds it first, or read module.{name} directly.")
    return chain.original  # type: ignore[union-attr]


def _cast(tensors: object, dtype: torch.dtype) -> object:
    return tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tensors)


def _cast_hooks(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
    """Mixed precision at the unit's boundary: floating inputs to ``param_dtype``, outputs to ``output_dtype``."""
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        dtype = mp.param_dtype
        module.register_forward_pre_hook(lambda _m, args, kwargs: (_cast(args, dtype), _cast(kwargs, dtype)),
                                         with_kwargs=True)
    if mp.output_dtype is not None:
        out_dtype = mp.output_dtype
        module.register_forward_hook(lambda _m, _args, out: _cast(out, out_dtype))


def _renumber_subunits(root: nn.Module, root_unit: Unit) -> None:
    """Name units relative to the newest root and number them in forward order (stable schedules)."""
    order: list[Unit] = []
    for mod_name, mod in root.named_modules():
        sub = _units.get(mod)
        if sub is not None and sub is not root_unit:
            sub.fqn = mod_name
            order.append(sub)
    root_unit.fqn = ""
    order.append(root_unit)
    _choose_outlined(order)
    for i, unit in enumerate(order):
        unit.index = i
        key_flats(unit)  # its flats' keys name it
        for sp in unit.params:
            sp.marker_values = _marker_values(sp)
            # NOTE [anonymous reads] in markers.py
            sp.traced_args = read_args({**sp.marker_values, "unit": ANONYMOUS_UNIT, "names": ""})
            sp.replan()


def _choose_outlined(units: list[Unit]) -> None:
    """(NOTE [outlined units]) Decide which units are outline candidates, and switch their classes."""
    inside: dict[int, list[Unit]] = {id(u): [] for u in units}
    for outer in units:
        mods = {id(m) for m in outer.module.modules()}
        inside[id(outer)] = [u for u in units if u is not outer and id(u.module) in mods]
    leaves = [u for u in units if not inside[id(u)]]
    forwards = Counter(forward_of(u.module) for u in leaves)
    for unit in units:
        if unit.outline and inside[id(unit)]:
            names = ", ".join(repr(u.fqn) for u in inside[id(unit)][:3])
            raise ValueError(f"fully_shard({class_name(unit.module)}): outline=True, but it holds other units "
                             f"({names}); a unit that holds others cannot be outlined. Outline the inner units "
                             "instead (outline=True on them, or leave outline=None).")
        decided = unit.outline if unit.outline is not None else forwards.get(forward_of(unit.module), 0) >= 2
        unit.outlined = bool(decided) and not inside[id(unit)] and not unit.stacked  # NOTE [stacked blocks]
        mix_in(unit.module, outlined=unit.outlined)


def _marker_values(p: ShardedParam) -> dict[str, object]:
    """``fsdp::unshard``'s constant arguments for ``p``'s shard alone, by name (NOTE [one marker spec])."""
    unit = p.unit
    groups = unit.groups
    mp = unit.mp_policy
    full = list(p.full_shape) or [1]  # a 0-d parameter is stored as one row
    shard_ranks, shard_dims = flatten_shapes([[shard_rows(full[0], groups.shard_size), *full[1:]]])
    ranks, dims = flatten_shapes([p.full_shape])
    return {"shard_ranks": shard_ranks, "shard_dims": shard_dims, "ranks": ranks, "dims": dims, "names": p.fqn,
            "world_size": groups.shard_size, "unit": unit.index, "ag_group": groups.all_gather.group_name,
            "rs_group": groups.reduce_scatter.group_name,
            "replicate_group": groups.replicate.group_name if groups.replicate is not None else "",
            "replicate_size": groups.replicate_size, "reshard": unit.reshard_after_forward,
            "param_dtype": mp.param_dtype,
            "reduce_dtype": mp.reduce_dtype if mp.reduce_dtype is not None else mp.param_dtype}
