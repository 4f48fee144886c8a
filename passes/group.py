"""One marker per call of an outlined body while AOTAutograd traces, the per-parameter markers again after.

NOTE [grouped markers]: AOTAutograd's trace costs about the same per op whatever the op does (on the
CPU here a marker's forward and backward cost what a multiply's do), and once blocks are outlined
(NOTE [outlined units] in ``fsdp_compile/module.py``) the per-parameter markers are most of what it
traces per block: nine ``fsdp::unshard`` before each call of a Llama block and nine ``fsdp::reduce_grad``
after its backward, against one call each way. So just before AOTAutograd, the markers that gather the
parameters one call reads become one ``fsdp::unshard_many`` (:func:`group_markers_pass`), whose
backward is one ``fsdp::reduce_grad_many``; in each graph AOTAutograd hands on, a grouped op that is all
of its unit becomes the unit's bucket at once (NOTE [grouped lowering] in ``lower_grouped.py``) and any
other is split back into the per-parameter markers, with the same arguments and in the same order
(:func:`expand_markers_pass`), so the passes see what they always saw::

    before:  w_a = unshard(s_a, [d, d], ..., "layers.0.wq", ...); w_b = unshard(s_b, ...); invoke_subgraph(body, x, w_a, w_b)
    grouped: ws = unshard_many([s_a, s_b], [d, d, ...], [2, ...], "layers.0.wq\\nlayers.0.wk", ...)
             invoke_subgraph(body, x, ws[0], ws[1])

The grouped ops carry the per-parameter markers' arguments: the shapes flattened (``flatten_shapes``),
the names joined by ``NAMES_SEP`` (an op's schema takes no nested int lists and no string lists), every
other argument shared. Their eager implementations call the per-parameter markers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor, fx

from .copies import flatten_shapes, unflatten_shapes
from .flat import expand_flat, flat_piece, group_flat, is_flat_reduce_grad, is_flat_unshard
from .predicates import UnshardArgs, _schema_name, is_unshard

__all__ = ["NAMES_SEP", "expand_markers_pass", "group_markers_pass", "is_grouped_reduce_grad", "is_grouped_unshard"]

NAMES_SEP = "\n"  # between the names a grouped marker carries (a name holding it is never grouped)
_SHARED = ("world_size", "unit", "ag_group", "rs_group", "replicate_group", "replicate_size", "reshard",
           "param_dtype", "reduce_dtype")


@torch.library.custom_op("fsdp::unshard_many", mutates_args=())
def unshard_many(
    shards: list[Tensor],
    ranks: list[int],
    dims: list[int],
    names: str,
    world_size: int,
    unit: int,
    ag_group: str,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reshard: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> list[Tensor]:
    """``fsdp::unshard`` of each shard: ``shards[i]`` is the parameter ``names.split(NAMES_SEP)[i]`` of
    full shape ``unflatten_shapes(ranks, dims)[i]``; the other arguments are shared."""
    return [torch.ops.fsdp.unshard(s, shape, world_size, unit, name, ag_group, rs_group, replicate_group,
                                   replicate_size, reshard, param_dtype, reduce_dtype, None)
            for s, shape, name in zip(shards, unflatten_shapes(ranks, dims), names.split(NAMES_SEP))]


@unshard_many.register_fake
def _unshard_many_fake(shards: list[Tensor], ranks: list[int], dims: list[int], *args: object) -> list[Tensor]:
    param_dtype = args[-2]
    return [s.new_empty(shape, dtype=param_dtype or s.dtype)  # type: ignore[arg-type]
            for s, shape in zip(shards, unflatten_shapes(ranks, dims))]


def _setup_context(ctx: object, inputs: tuple, output: list[Tensor]) -> None:
    (shards, ranks, dims, names, world_size, unit, ag_group, rs_group, replicate_group, replicate_size,
     _reshard, param_dtype, reduce_dtype) = inputs
    ctx.full = [(shape, param_dtype or s.dtype) for s, shape in zip(shards, unflatten_shapes(ranks, dims))]  # type: ignore[attr-defined]
    ctx.shard_shapes = flatten_shapes([s.shape for s in shards])  # type: ignore[attr-defined]
    ctx.device = shards[0].device  # type: ignore[attr-defined]
    ctx.out_dtype = shards[0].dtype  # type: ignore[attr-defined]
    ctx.args = (names, world_size, unit, ag_group, rs_group, replicate_group, replicate_size, reduce_dtype)  # type: ignore[attr-defined]


def _backward(ctx: object, grads: list[Tensor | None]) -> tuple:
    # A parameter the call never read has no gradient: zeros, which reduce to its zero gradient.
    full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device)  # type: ignore[attr-defined]
            for g, (shape, dtype) in zip(grads, ctx.full)]  # type: ignore[attr-defined]
    ranks, dims = ctx.shard_shapes  # type: ignore[attr-defined]
    out = torch.ops.fsdp.reduce_grad_many(full, ranks, dims, *ctx.args, ctx.out_dtype)  # type: ignore[attr-defined]
    return (list(out),) + (None,) * 12


unshard_many.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("fsdp::reduce_grad_many", mutates_args=())
def reduce_grad_many(
    grads: list[Tensor],
    ranks: list[int],
    dims: list[int],
    names: str,
    world_size: int,
    unit: int,
    ag_group: str,
    rs_group: str,
    replicate_group: str,
    replicate_size: int,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> list[Tensor]:
    """``fsdp::reduce_grad`` of each full gradient to a shard of shape ``unflatten_shapes(ranks, dims)[i]``."""
    return [torch.ops.fsdp.reduce_grad(g, shape, world_size, unit, name, ag_group, rs_group, replicate_group,
                                       replicate_size, reduce_dtype, out_dtype)
            for g, shape, name in zip(grads, unflatten_shapes(ranks, dims), names.split(NAMES_SEP))]


@reduce_grad_many.register_fake
def _reduce_grad_many_fake(grads: list[Tensor], ranks: list[int], dims: list[int], *args: object) -> list[Tensor]:
    out_dtype = args[-1]
    return [g.new_empty(shape, dtype=out_dtype) for g, shape in zip(grads, unflatten_shapes(ranks, dims))]  # type: ignore[arg-type]


def is_grouped_unshard(node: fx.Node) -> bool:
    """``[shards] -> fsdp::unshard_many -> getitem -> full params``"""
    return _schema_name(node) == "fsdp::unshard_many"


def is_grouped_reduce_grad(node: fx.Node) -> bool:
    return _schema_name(node) == "fsdp::reduce_grad_many"


def _groupable(marker: fx.Node, call: fx.Node) -> bool:
    """A named marker, without an accumulator, that only this call reads, of a shard that is a graph
    input with a value (defined before any marker, so the group can stand where the call's first
    marker stood), or a piece of one (NOTE [flat shards] in ``flat.py``)."""
    a = UnshardArgs.of(marker)
    return (a.accumulate is None and NAMES_SEP not in a.name
            and (a.shard.op == "placeholder" or flat_piece(a.shard) is not None)
            and isinstance(_value(a.shard), Tensor) and all(u is call for u in marker.users))


def _value(node: fx.Node) -> object:
    return node.meta.get("example_value", node.meta.get("val"))


def group_markers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [grouped markers]: the markers each ``invoke_subgraph`` call reads (of one unit, with every
    argument but the shard, the shape and the name alike) become one ``fsdp::unshard_many``."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for call in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        groups: dict[tuple, list[fx.Node]] = {}
        for arg in dict.fromkeys(a for a in call.args[2:] if isinstance(a, fx.Node)):
            if is_unshard(arg) and _groupable(arg, call):
                a = UnshardArgs.of(arg)
                key = (*(getattr(a, k) for k in _SHARED), _value(a.shard).dtype)  # type: ignore[union-attr]
                groups.setdefault(key, []).append(arg)
        for key, markers in groups.items():
            if len(markers) > 1 and group_flat(gm, markers, order, list(key[:-1])):  # NOTE [flat shards]
                changed = True
            elif len(markers) > 1 and all(UnshardArgs.of(m).shard.op == "placeholder" for m in markers):
                _group(gm, markers, order)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _group(gm: fx.GraphModule, markers: Sequence[fx.Node], order: dict[fx.Node, int]) -> None:
    args = [UnshardArgs.of(m) for m in markers]
    ranks, dims = flatten_shapes([a.full_shape for a in args])
    first = min(markers, key=lambda m: order[m])
    shared = [getattr(args[0], k) for k in _SHARED]
    with gm.graph.inserting_before(first):
        many = gm.graph.call_function(torch.ops.fsdp.unshard_many.default,
                                      ([a.shard for a in args], ranks, dims, NAMES_SEP.join(a.name for a in args),
                                       *shared))
    values = [m.meta.get("example_value") for m in markers]
    if all(v is not None for v in values):
        many.meta["example_value"] = list(values)
    many.meta["stack_trace"] = first.meta.get("stack_trace")
    for i, marker in enumerate(markers):
        with gm.graph.inserting_after(many):
            item = gm.graph.call_function(operator.getitem, (many, i))
        item.meta.update(marker.meta)
        marker.replace_all_uses_with(item)
        gm.graph.erase_node(marker)


def expand_markers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [grouped markers]: each ``fsdp::unshard_many`` and ``fsdp::reduce_grad_many`` of an
    AOTAutograd graph split back into its per-parameter ``fsdp::unshard`` / ``fsdp::reduce_grad``."""
    for node in [n for n in gm.graph.nodes if is_flat_unshard(n) or is_flat_reduce_grad(n)]:
        expand_flat(gm, node)  # NOTE [flat shards]
    grouped = [n for n in gm.graph.nodes if is_grouped_unshard(n) or is_grouped_reduce_grad(n)]
    for node in grouped:
        unshard = is_grouped_unshard(node)
        (inputs, ranks, dims, names, *rest) = node.args
        shapes = unflatten_shapes(ranks, dims)  # type: ignore[arg-type]
        target = torch.ops.fsdp.unshard.default if unshard else torch.ops.fsdp.reduce_grad.default
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        assert len(items) == len(node.users), f"{node.name}: read other than by index"
        vals = node.meta.get("val")
        for i, (x, shape, name) in enumerate(zip(inputs, shapes, str(names).split(NAMES_SEP))):  # type: ignore[arg-type]
            item = items.get(i)
            if item is None:
                continue  # nothing reads this one
            # unshard(shard, full_shape, world, unit, name, ...); reduce_grad(grad, shard_shape, world, unit, name, ...)
            world, unit, *tail = rest
            with gm.graph.inserting_before(node):
                single = gm.graph.call_function(target, (x, shape, world, unit, name, *tail))
            single.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            single.meta["val"] = item.meta["val"] if "val" in item.meta else vals[i]  # type: ignore[index]
            item.replace_all_uses_with(single)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
    return gm  # (not recompiled: the passes that follow recompile it)
