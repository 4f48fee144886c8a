"""Units and their sharded parameters: what ``fully_shard`` records, in a registry keyed weakly by module
and by tensor, never on the user's modules (a dropped model frees its entries).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_compile.api.groups import FsdpGroups

__all__ = ["MixedPrecisionPolicy", "ShardedParam", "Unit", "is_sharded", "sharded_param", "unit_of", "units_under"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for one unit; ``None`` keeps the parameter's own. ``param_dtype``: what params are cast to
    before the all-gather. ``reduce_dtype``: what gradients are reduced in (default: ``param_dtype``).
    ``output_dtype``: the unit's floating-point outputs. ``cast_forward_inputs``: cast floating inputs to
    ``param_dtype``. Shards, their gradients and the optimizer stay in the param's own dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(eq=False)
class Unit:
    """One ``fully_shard`` call: the module and the parameters it manages."""

    index: int
    module_ref: weakref.ref[nn.Module]
    groups: FsdpGroups
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    fqn: str = ""
    params: list[ShardedParam] = field(default_factory=list)
    outline: bool | None = None  # what fully_shard(outline=) asked for; None: decide (NOTE [outlined units])
    outlined: bool = False  # an outline candidate
    stacked: bool = False  # a block of a BlockStack (NOTE [stacked blocks])
    flats: list[Tensor] = field(default_factory=list)  # NOTE [flat shards]
    requires_grad_sync: bool = True  # NOTE [no-sync] in accumulate.py; set through set_sync
    pending: bool = False  # accumulated full gradients not yet reduced; set through set_sync
    flush_queued: bool = False
    built_sums: Tensor | None = None  # its params' checksums until compared (NOTE [ranks built alike])

    @property
    def accumulating(self) -> bool:
        """Whether its reads pass accumulators: it does not sync, or holds gradients not reduced yet."""
        return not self.requires_grad_sync or self.pending

    def set_sync(self, *, requires_grad_sync: bool | None = None, pending: bool | None = None) -> None:
        """Set what :attr:`accumulating` reads, and replan each param (NOTE [one guard per read] in ``reads.py``)."""
        if requires_grad_sync is not None:
            self.requires_grad_sync = requires_grad_sync
        if pending is not None:
            self.pending = pending
        for p in self.params:
            p.replan()

    @property
    def module(self) -> nn.Module:
        module = self.module_ref()
        assert module is not None, "a unit outlived its module"
        return module


@dataclass(eq=False)
class ShardedParam:
    """One managed parameter: its shard and the full shape it stands for."""

    shard: nn.Parameter
    full_shape: tuple[int, ...]
    local_name: str  # relative to the unit's module
    unit: Unit
    sharded: bool = False  # True once ``shard`` holds the shard rather than the full param
    real_rows: int = 0  # rows of ``shard`` that are the param's (the rest are padding)
    accumulator: Tensor | None = None  # NOTE [no-sync]
    marker_values: dict[str, object] = field(default_factory=dict)  # fsdp::unshard's constant arguments by name
    traced_args: tuple = ()  # what compiled code passes instead (NOTE [anonymous reads])
    # The flat ``shard`` views from element ``offset`` on (NOTE [flat shards]); ``None``: reads read ``shard``.
    flat: Tensor | None = None
    offset: int = 0
    piece_shape: tuple[int, ...] = ()
    # (flat's key, offset, elements, piece_shape, traced_args, accumulating): NOTE [one guard per read]
    read_plan: tuple = ()
    # (module, name) of every module reading it as ``module.<name>``, weakly (NOTE [converted parameters])
    owners: list[tuple[weakref.ref[nn.Module], str]] = field(default_factory=list)

    def replan(self) -> None:
        """Recompute :attr:`read_plan` and hand it to every owner on the lean read (NOTE [tag-safe reads])."""
        key = self.flat._fsdp_layout.key if self.flat is not None else ""
        args = tuple(tuple(a) if isinstance(a, list) else a for a in self.traced_args)
        self.read_plan = (key, self.offset, math.prod(self.piece_shape), self.piece_shape, args,
                          self.unit.accumulating)
        for ref, name in self.owners:
            owner = ref()
            reads = owner.__dict__.get("_fsdp_reads") if owner is not None else None
            if reads is not None and reads.get(name) is not None:  # None: off the lean read
                reads[name] = self.read_plan

    @property
    def fqn(self) -> str:
        """Name relative to the newest root that ``fully_shard`` was called on."""
        return f"{self.unit.fqn}.{self.local_name}" if self.unit.fqn else self.local_name


FLATS: dict[str, Tensor] = {}
"""Every unit's flat shards by key, where compiled reads find them (NOTE [one guard per read])."""

# Module -> unit and shard -> param, keyed weakly.
_units: weakref.WeakKeyDictionary[nn.Module, Unit] = weakref.WeakKeyDictionary()
_params: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Tensor -> ShardedParam, by identity


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``fully_shard(module)`` made, or ``None``."""
    return _units.get(module)


def units_under(module: nn.Module) -> list[Unit]:
    """The units of ``module`` and its submodules, in module order."""
    return [u for m in module.modules() if (u := _units.get(m)) is not None]


def sharded_param(tensor: Tensor) -> ShardedParam | None:
    """The managed parameter whose shard ``tensor`` is, or ``None``."""
    return _params.get(tensor)


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the shard of a param some ``fully_shard`` call manages."""
    return tensor in _params

