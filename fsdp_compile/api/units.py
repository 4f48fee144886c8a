"""Units and their sharded parameters: what ``fully_shard`` records, kept outside the user's modules.

A registry keyed weakly by module (units) and by tensor identity (params) holds everything, so a
dropped model frees its entries and no setting is stored as an attribute of a user's module.
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
    """Dtypes for one unit. ``None`` keeps the parameter's own dtype.

    ``param_dtype``: what params are cast to *before* the all-gather (so bf16 halves its bytes).
    ``reduce_dtype``: what gradients are reduce-scattered in (default: ``param_dtype``).
    ``output_dtype``: what the unit's floating-point outputs are cast to.
    ``cast_forward_inputs``: cast the unit's floating-point inputs to ``param_dtype``.
    Shards, their gradients and the optimizer always stay in the param's own dtype.
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
    outlined: bool = False  # an outline candidate: may share a body with identical blocks (NOTE [outlined units])
    stacked: bool = False  # a block of a BlockStack, traced once with the stack's other blocks (NOTE [stacked blocks])
    flats: list[Tensor] = field(default_factory=list)  # one per dtype: its shards, views of it (NOTE [flat shards])
    requires_grad_sync: bool = True  # see NOTE [no-sync] in accumulate.py; set through set_sync
    pending: bool = False  # accumulated full gradients not yet reduced; set through set_sync
    flush_queued: bool = False
    built_sums: Tensor | None = None  # its params' checksums at fully_shard, until compared (NOTE [ranks built alike])

    @property
    def accumulating(self) -> bool:
        """Whether its reads pass accumulators: it does not sync, or holds gradients not reduced yet (NOTE
        [no-sync] in ``accumulate.py``)."""
        return not self.requires_grad_sync or self.pending

    def set_sync(self, *, requires_grad_sync: bool | None = None, pending: bool | None = None) -> None:
        """Set what :attr:`accumulating` reads and hand it to each param's ``read_plan``, where compiled reads
        check it (NOTE [one guard per read] in ``reads.py``)."""
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
    shard_index: int = 0  # this rank's place in the shard group: it holds rows [index * rows, ...)
    real_rows: int = 0  # rows of ``shard`` that are the param's (the rest are padding, NOTE [padding])
    accumulator: Tensor | None = None  # the leaf that collects full grads without sync (accumulate.py)
    marker_values: dict[str, object] = field(default_factory=dict)  # fsdp::unshard's constant arguments by name,
    # set whenever units are (re)numbered
    traced_args: tuple = ()  # what compiled code passes instead: no unit or name (NOTE [anonymous reads])
    # NOTE [flat shards] in flat_shard.py: the unit's flat tensor that ``shard`` is a view of, from element
    # ``offset`` on; compiled code reads that piece of it. ``None``: compiled code reads ``shard``.
    flat: Tensor | None = None
    offset: int = 0
    piece_shape: tuple[int, ...] = ()  # the shard's shape, as compiled code views its piece
    # Every constant a compiled read takes, in one tuple that Dynamo guards as one value (NOTE [one
    # guard per read] in reads.py): (the flat's key, offset, elements, piece_shape, traced_args, accumulating).
    read_plan: tuple = ()
    # (module, name) of every module that reads it as ``module.<name>`` (NOTE [converted parameters] in
    # materialize.py), weakly: the registry must not keep a dropped model alive.
    owners: list[tuple[weakref.ref[nn.Module], str]] = field(default_factory=list)

    def replan(self) -> None:
        """Recompute :attr:`read_plan` from the fields it copies (after any of them changes), and hand it to
        every owner that reads it on the lean read (NOTE [tag-safe reads] in ``reads.py``: constants only,
        lists as tuples)."""
        key = self.flat._fsdp_layout.key if self.flat is not None else ""  # (in FLATS; "": no flat)
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
"""Every unit's flat shards by key (``read_plan[0]`` of their members), where compiled reads find them: one place
for all the members of a flat, so that Dynamo reaches each flat by one path (NOTE [one guard per read]).
``flat_shard.key_flats`` enters a unit's flats; those replaced, renamed or of a dropped module leave."""

# Module -> unit and shard -> param, keyed weakly so that dropping a model frees everything.
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

