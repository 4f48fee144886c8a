"""A flat shard per unit and dtype: the unit's shards are views of one tensor, which compiled code reads.

NOTE [flat shards]: a Llama block's nine shards would be nine graph inputs (each a fake tensor, a guard, a
placeholder), nine gradients and their packing views, and compile time grows with all of them. So
``fully_shard`` lays a unit's shards out as one 1-D tensor per dtype, device and ``requires_grad``, the
``flat``; each ``nn.Parameter`` stays the leaf the optimizer sees, its storage a view of the flat, and
compiled code reads its piece ``flat.narrow(0, offset, n).view(shape)`` (``reads.traced_unshard``). Frozen
parameters get a flat that is never reduced; one unfrozen later is read from its own shard. A unit holding
others (the root) gets a flat per parameter, so each gradient is reduce-scattered as soon as it exists
(NOTE [gradients in stretches] in ``passes/lower/markers.py``). Stacked blocks get no flat (``stack.py``).
``module.to(...)`` and ``to_empty`` lay the flat out again (``FsdpModule._apply``); another ``p.data = t`` is
found before the next compiled step (:func:`flat_inputs`), and copied into the flat where it fits.

NOTE [gradients through the parameters]: a compiled graph gets the flat as the output of an autograd
function of its parameters (:class:`_OfParams`, no copy), whose backward cuts the flat's gradient into each
parameter's piece. So autograd accumulates each parameter's ``.grad`` and runs its hooks; a parameter frozen
now or not read gets none (as eagerly); ``torch.autograd.grad(loss, params)`` finds the parameters. Where a
unit's collectives are elided (one rank), the graph takes the parameters themselves (NOTE [elided flats] in
``passes/capture/flat_inputs.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_compile.api.materialize import rebind_params
from fsdp_compile.api.units import FLATS, ShardedParam, Unit, units_under

__all__ = ["as_pieces", "elided_flats", "flat_inputs", "flat_member", "flatten_unit", "is_flat", "key_flats",
           "refresh_flat"]

_flats: WeakIdKeyDictionary = WeakIdKeyDictionary()  # flat tensor -> Unit


class _Layout(NamedTuple):
    """``flat._fsdp_layout``: its key in ``FLATS``, and its members' parameters, data pointers and pieces."""

    key: str
    params: tuple[nn.Parameter, ...]
    data_ptrs: tuple[int, ...]
    pieces: tuple[tuple[int, int, tuple[int, ...]], ...]


def is_flat(tensor: object) -> bool:
    """Whether ``tensor`` is some unit's flat shard."""
    return isinstance(tensor, Tensor) and tensor in _flats


def flat_member(flat: object, offset: int) -> ShardedParam | None:
    """The parameter whose shard starts at element ``offset`` of the flat shard ``flat``, or ``None``."""
    unit = _flats.get(flat) if isinstance(flat, Tensor) else None
    if unit is None:
        return None
    return next((sp for sp in unit.params if sp.flat is flat and sp.offset == offset), None)


def flatten_unit(unit: Unit) -> None:
    """(NOTE [flat shards]) Lay ``unit``'s shards out as flats, each parameter's data a view of its flat."""
    for flat in unit.flats:
        _forget(flat)
    for sp in unit.params:
        sp.flat, sp.offset = None, 0
        sp.replan()
    unit.flats = []
    if unit.stacked or any(sp.shard.device.type == "meta" for sp in unit.params):
        return
    alone = any(u is not unit for u in units_under(unit.module))  # a flat per parameter
    kinds: dict[tuple[object, ...], list[ShardedParam]] = {}
    for k, sp in enumerate(unit.params):
        kinds.setdefault((sp.shard.dtype, sp.shard.device, sp.shard.requires_grad, k if alone else None), []).append(sp)
    for (dtype, device, trained, _), members in kinds.items():
        flat = torch.empty(sum(sp.shard.numel() for sp in members), dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for sp in members:
                n = sp.shard.numel()
                piece = flat.narrow(0, offset, n)
                piece.copy_(sp.shard.detach().reshape(-1))
                sp.shard.data = piece.view(sp.shard.shape)
                sp.flat, sp.offset, sp.piece_shape = flat, offset, tuple(sp.shard.shape)
                offset += n
        flat.requires_grad_(trained)  # what the trace sees (NOTE [gradients through the parameters])
        flat._fsdp_layout = _Layout("", tuple(sp.shard for sp in members),
                                    tuple(sp.shard.data_ptr() for sp in members),
                                    tuple((sp.offset, sp.shard.numel(), sp.piece_shape) for sp in members))
        unit.flats.append(flat)
        _flats[flat] = unit
        weakref.finalize(unit.module, _forget, weakref.ref(flat))
    key_flats(unit)


def key_flats(unit: Unit) -> None:
    """Enter ``unit``'s flats in ``FLATS`` under keys of the unit's name (``layers.3#0``), which graph inputs
    are named after, so a model built again compiles alike (NOTE [warm start] in ``compiler/cache.py``)."""
    for k, flat in enumerate(unit.flats):
        _forget(flat)
        key, n = f"{unit.fqn}#{k}", 0
        while key in FLATS:
            n += 1
            key = f"{unit.fqn}#{k}~{n}"
        FLATS[key] = flat
        flat._fsdp_layout = flat._fsdp_layout._replace(key=key)
        for sp in unit.params:
            if sp.flat is flat:
                sp.replan()


def _forget(flat: Tensor | weakref.ref[Tensor]) -> None:
    if isinstance(flat, weakref.ref):
        flat = flat()
        if flat is None:
            return
    key = flat._fsdp_layout.key
    if FLATS.get(key) is flat:
        del FLATS[key]


def refresh_flat(unit: Unit) -> None:
    """After ``module.to`` / ``to_empty``: rebind replaced parameters, and lay the flat out again if needed."""
    rebound = rebind_params(unit)
    if rebound or not all(_aliases(sp) for sp in unit.params if sp.flat is not None):
        flatten_unit(unit)


def _aliases(sp: ShardedParam) -> bool:
    flat, p = sp.flat, sp.shard
    assert flat is not None
    return (p.dtype == flat.dtype and p.device == flat.device
            and p.data_ptr() == flat.data_ptr() + sp.offset * flat.element_size())


class _OfParams(torch.autograd.Function):
    """(NOTE [gradients through the parameters]) ``flat`` as a function of its members ``params``."""

    @staticmethod
    def forward(ctx: Any, flat: Tensor, pieces: list[tuple[int, int, tuple[int, ...]]], *params: Tensor) -> Tensor:
        ctx.pieces = pieces
        return flat

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        needed = ctx.needs_input_grad[2:]
        return (None, None, *(grad.narrow(0, offset, n).view(shape) if need else None
                              for (offset, n, shape), need in zip(ctx.pieces, needed)))


def _of_params(flat: Tensor, read: tuple[int, ...] | None) -> Tensor:
    """``flat`` as a function of the members the graph reads (``read``: their places; ``None``: all)."""
    layout = flat._fsdp_layout
    if read is None:
        return _OfParams.apply(flat.detach(), layout.pieces, *layout.params)
    return _OfParams.apply(flat.detach(), [layout.pieces[i] for i in read], *(layout.params[i] for i in read))


def flat_inputs(example_inputs: Sequence[object], split: Collection[int] = (),
                read: Collection[tuple[int, str]] | None = None) -> Callable[[Sequence[Any]], list[Any]] | None:
    """What makes a compiled graph's arguments from each call's, where ``example_inputs`` hold flats (else
    ``None``): the flats at ``split`` become their parameters, the others a function of the parameters in
    ``read`` (``None``: all), after checking each parameter still views its flat."""
    flats = [i for i, t in enumerate(example_inputs) if is_flat(t)]
    if not flats:
        return None
    through = {i: _read_places(example_inputs[i], read) for i in flats if i not in split}  # type: ignore[arg-type]

    def prepare(args: Sequence[Any]) -> list[Any]:
        for i in flats:
            layout = args[i]._fsdp_layout
            if tuple(map(Tensor.data_ptr, layout.params)) != layout.data_ptrs:
                for sp in _members(args[i]):
                    if not _aliases(sp):
                        _heal(sp)
        out = list(args)
        if torch.is_grad_enabled():
            for i, reads in through.items():
                if out[i].requires_grad:
                    out[i] = _of_params(out[i], reads)
        return as_pieces(out, split) if split else out

    return prepare


def _read_places(flat: Tensor, read: Collection[tuple[int, str]] | None) -> tuple[int, ...] | None:
    places = tuple(k for k, sp in enumerate(_members(flat)) if read is None or (sp.unit.index, sp.fqn) in read)
    return None if len(places) == len(flat._fsdp_layout.params) else places


def _heal(sp: ShardedParam) -> None:
    flat, p = sp.flat, sp.shard
    assert flat is not None
    if p.dtype != flat.dtype or p.device != flat.device or tuple(p.shape) != sp.piece_shape:
        raise ValueError(f"fully_shard: parameter {sp.fqn!r} now holds {p.dtype} data of shape {tuple(p.shape)} on "
                         f"{p.device}, but its unit's flat shard is {flat.dtype} on {flat.device} (its data was "
                         "replaced after fully_shard, not converted with module.to(...)). Convert the model with "
                         "model.to(...) / model.half(), which lays the shards out again, or before fully_shard; "
                         "update parameters in place (p.copy_(t), not p.data = t).")
    with torch.no_grad():
        piece = flat.detach().narrow(0, sp.offset, p.numel())
        piece.copy_(p.detach().reshape(-1))
        p.data = piece.view(p.shape)


def elided_flats(example_inputs: Sequence[object]) -> dict[int, list[ShardedParam]]:
    """(NOTE [elided flats]) By index, the flats among ``example_inputs`` of units whose groups have one rank,
    with their members; not one with a member frozen (unfreezing it would not recompile the graph)."""
    out: dict[int, list[ShardedParam]] = {}
    for i, t in enumerate(example_inputs):
        unit = _flats.get(t) if isinstance(t, Tensor) else None
        if unit is not None and unit.groups.shard_size == 1 and unit.groups.replicate_size == 1:
            members = _members(t)
            if all(sp.shard.requires_grad for sp in members):
                out[i] = members
    return out


def _members(flat: Tensor) -> list[ShardedParam]:
    return [sp for sp in _flats[flat].params if sp.flat is flat]


def as_pieces(args: Sequence[Any], split: Collection[int], wrap: Callable[[Tensor], Any] | None = None) -> list[Any]:
    """``args`` with each flat at an index in ``split`` replaced by its members' parameters (through ``wrap``)."""
    out: list[Any] = []
    for i, a in enumerate(args):
        if i in split:
            params = a._fsdp_layout.params
            out.extend(params if wrap is None else map(wrap, params))
        else:
            out.append(a)
    return out
