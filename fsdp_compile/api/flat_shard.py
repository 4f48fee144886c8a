"""A flat shard per unit and dtype: the unit's shards are views of one tensor, which compiled code reads.

NOTE [flat shards]: compile time per block grows with what Dynamo, AOTAutograd and Inductor are handed
per block, and a Llama block's nine shards would be nine graph inputs (each a fake tensor, a guard, a
placeholder in both graphs), nine gradients, and the views that pack them into the all-gather and
unpack the reduce-scatter. So ``fully_shard`` lays a unit's shards out as one 1-D tensor per rank, in
the unit's order, the ``flat``; each ``nn.Parameter`` stays the leaf the optimizer updates and the
user reads, its storage now a view of the flat. Compiled code reads parameter ``i`` as the piece
``flat.narrow(0, offset_i, n_i).view(shape_i)`` (``reads.traced_unshard``), so Dynamo takes one input
per unit and dtype; the backend gathers the flat in one copy and hands the reduce-scatter's output on as
the flat's gradient (``passes/capture/group_markers.py``).

NOTE [gradients through the parameters]: a compiled graph is not called with the flat itself. In its
place it gets the flat as the output of an autograd function of the flat's parameters
(:class:`_OfParams`: the flat's storage, no copy), whose backward cuts the flat's gradient into each
parameter's piece (a view). So autograd, not a hook of ours, accumulates each piece into the
parameter's ``.grad`` and runs the parameter's own hooks; a parameter frozen now gets none, and so does
one the graph never reads (its ``.grad`` stays ``None`` as eagerly, where a zero gradient would be
applied by an optimizer with weight decay or momentum); and
``torch.autograd.grad(loss, params)`` or ``backward(inputs=params)`` finds the parameters in the graph.
The flat's own ``.grad`` stays ``None``. Where a unit's collectives are elided (one rank), compiled code
takes the parameters themselves instead (NOTE [elided flats] in ``passes/capture/flat_inputs.py``).

What keeps the two in step: the optimizer and ``load_state_dict`` write parameters in place, which
writes the flat. ``module.to(...)``, ``.half()``, ``to_empty`` (``nn.Module._apply``) replace each
parameter's data: the unit's module lays the flat out again afterwards (``FsdpModule._apply``). Any other
replacement of a parameter's data (``p.data = t``) is found before the next compiled step runs
(:func:`flat_inputs`): data of the same shape, dtype and device is copied into the flat and the
parameter made its view again; anything else raises, naming the fix.

A unit is laid out flat when it is no stacked block (``stack.py`` reads shards its own way): one flat per
dtype, device and ``requires_grad`` of its parameters (fp32 norms beside bf16 matrices make two flats,
and two collectives each way, as per-parameter buckets of one dtype would; a parameter alone in its kind
is a flat of its own). Parameters frozen when ``fully_shard`` runs (the base weights beside trainable
adapters) get a flat that requires no gradient: gathered in one copy, never reduced (beside the unit's
trained flat: two all-gathers where one bucket of its shards would be one).
One of them unfrozen later is read from its own shard (the trace guards its ``requires_grad``, so the
graph is compiled again), which gives it its gradient. A unit that holds others (the root: embedding,
final norm, output head) reads its parameters around theirs, so their gradients exist at the two ends of
backward: each of its parameters is a flat of its own, so that each stretch is reduce-scattered as soon as
it exists (NOTE [gradients in stretches] in ``passes/lower/markers.py``), where one flat gradient would
hold the output head's bucket until the embedding's gradient. Its reads are then flat reads as every
block's are: one kind of graph input, and modules Dynamo's guards may skip (NOTE [tag-safe reads] in
``reads.py``). A parameter frozen later is still read from the flat (its gradient
computed and reduced, and dropped: freeze before ``fully_shard`` to save that work).
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
    """What a call of compiled code needs of a flat, kept on the flat (``flat._fsdp_layout``): its key in
    ``FLATS``, its members' parameters in offset order, where each one's data must start (a parameter
    whose data was replaced starts elsewhere), and each one's (offset, elements, shape)."""

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


def _eligible(unit: Unit) -> bool:
    """Whether ``unit`` may be laid out flat: no stacked block, no meta tensor."""
    return not unit.stacked and all(sp.shard.device.type != "meta" for sp in unit.params)


def flatten_unit(unit: Unit) -> None:
    """(NOTE [flat shards]) Lay ``unit``'s shards out as one flat tensor per dtype, device and
    ``requires_grad`` (when it is eligible), each parameter's data a view of its flat."""
    for flat in unit.flats:
        _forget(flat)
    for sp in unit.params:
        sp.flat, sp.offset = None, 0
        sp.replan()
    unit.flats = []
    if not _eligible(unit):
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
        flat.requires_grad_(trained)  # (what the trace sees: NOTE [gradients through the parameters])
        flat._fsdp_layout = _Layout("", tuple(sp.shard for sp in members),
                                    tuple(sp.shard.data_ptr() for sp in members),
                                    tuple((sp.offset, sp.shard.numel(), sp.piece_shape) for sp in members))
        unit.flats.append(flat)
        _flats[flat] = unit
        weakref.finalize(unit.module, _forget, weakref.ref(flat))  # (weakly: a flat laid out again is freed)
    key_flats(unit)


def key_flats(unit: Unit) -> None:
    """Enter ``unit``'s flats in ``FLATS`` (NOTE [one guard per read] in ``reads.py``) under keys made of
    the unit's name in its model (``layers.3#0``), which Dynamo's graph then names its inputs after: the same
    model built again, in another process or after the first is dropped, compiles to the same graph (so
    AOTAutograd's cache serves it: NOTE [warm start] in ``compiler/cache.py``). A key another live model
    holds gets a suffix. Run again whenever the unit's name changes (``fully_shard`` of a unit around it)."""
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
    """Take ``flat`` out of ``FLATS`` (its unit laid out again, renamed, or its module dropped)."""
    if isinstance(flat, weakref.ref):
        flat = flat()
        if flat is None:
            return
    key = flat._fsdp_layout.key
    if FLATS.get(key) is flat:
        del FLATS[key]


def refresh_flat(unit: Unit) -> None:
    """After a conversion of ``unit``'s module (``module.to(...)``, ``to_empty``): rebind parameters the conversion
    replaced (NOTE [converted parameters] in ``materialize.py``), and lay ``unit``'s flat out again from
    its parameters' data where any no longer is a view of it (NOTE [flat shards]); a unit built on the
    meta device gets its flat here."""
    rebound = rebind_params(unit)
    if rebound or not all(_aliases(sp) for sp in unit.params if sp.flat is not None):
        flatten_unit(unit)


def _aliases(sp: ShardedParam) -> bool:
    flat = sp.flat
    assert flat is not None
    p = sp.shard
    return (p.dtype == flat.dtype and p.device == flat.device
            and p.data_ptr() == flat.data_ptr() + sp.offset * flat.element_size())


class _OfParams(torch.autograd.Function):
    """(NOTE [gradients through the parameters]) ``flat`` (detached) as a function of ``params``, its
    members at ``pieces``: the backward gives each its piece of the flat's gradient."""

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
    """``flat`` as a function of its members that the graph reads (``read``: their places in offset
    order; ``None``: all)."""
    layout = flat._fsdp_layout
    if read is None:
        return _OfParams.apply(flat.detach(), layout.pieces, *layout.params)
    return _OfParams.apply(flat.detach(), [layout.pieces[i] for i in read], *(layout.params[i] for i in read))


def flat_inputs(example_inputs: Sequence[object], split: Collection[int] = (),
                read: Collection[tuple[int, str]] | None = None) -> Callable[[Sequence[Any]], list[Any]] | None:
    """For a compiled graph reading the flat shards among ``example_inputs``: what to call it with, made
    from each call's arguments; ``None`` when it reads none. Each parameter's data is checked to be still
    its view of the flat (NOTE [flat shards]); the flats at ``split`` become their parameters (NOTE [elided
    flats]), and every other flat that requires grad, the flat as a function of those of its parameters
    that the graph reads (``read``: each one's unit and name; all when ``None``; NOTE [gradients through
    the parameters])."""
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
    """The places, in offset order, of ``flat``'s members that ``read`` names; ``None`` where it names all."""
    places = tuple(k for k, sp in enumerate(_members(flat)) if read is None or (sp.unit.index, sp.fqn) in read)
    return None if len(places) == len(flat._fsdp_layout.params) else places


def _heal(sp: ShardedParam) -> None:
    """A parameter whose data was replaced: copied back into its piece of the flat, or an error."""
    flat, p = sp.flat, sp.shard
    assert flat is not None
    if p.dtype != flat.dtype or p.device != flat.device or tuple(p.shape) != sp.piece_shape:
        raise ValueError(
            f"fully_shard: parameter {sp.fqn!r} now holds {p.dtype} data of shape {tuple(p.shape)} on {p.device}, but "
            f"its unit's flat shard is {flat.dtype} on {flat.device} (its data was replaced after fully_shard, not "
            "converted with "
            "module.to(...)). Convert the model with model.to(...) / model.half(), which lays the shards out "
            "again, or before fully_shard; update parameters in place (p.copy_(t), not p.data = t)."
        )
    with torch.no_grad():
        piece = flat.detach().narrow(0, sp.offset, p.numel())
        piece.copy_(p.detach().reshape(-1))
        p.data = piece.view(p.shape)


def elided_flats(example_inputs: Sequence[object]) -> dict[int, list[ShardedParam]]:
    """(NOTE [elided flats] in ``passes/capture/flat_inputs.py``) The example inputs that are flat shards
    of units whose every group has one rank, by index: each with its members in offset order. A flat with
    a member frozen now stays whole: its graph would give that member no gradient, and unfreezing it
    changes nothing Dynamo guards (the flat), so the graph would not be compiled again."""
    out: dict[int, list[ShardedParam]] = {}
    for i, t in enumerate(example_inputs):
        unit = _flats.get(t) if isinstance(t, Tensor) else None
        if unit is not None and unit.groups.shard_size == 1 and unit.groups.replicate_size == 1:
            members = _members(t)
            if all(sp.shard.requires_grad for sp in members):
                out[i] = members
    return out


def _members(flat: Tensor) -> list[ShardedParam]:
    """The parameters viewing ``flat``, in offset order (``flatten_unit`` lays them out in ``unit.params``'
    order). Run before every call of a graph whose flats were split: no sort, no copy of the layout."""
    return [sp for sp in _flats[flat].params if sp.flat is flat]


def as_pieces(args: Sequence[Any], split: Collection[int], wrap: Callable[[Tensor], Any] | None = None) -> list[Any]:
    """``args`` with each flat shard at an index in ``split`` replaced by its members' parameters (each
    passed through ``wrap``), in offset order: the inputs of a graph whose flats were split (NOTE [elided
    flats])."""
    out: list[Any] = []
    for i, a in enumerate(args):
        if i in split:
            params = a._fsdp_layout.params
            out.extend(params if wrap is None else map(wrap, params))
        else:
            out.append(a)
    return out
