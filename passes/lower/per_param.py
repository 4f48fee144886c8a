"""Lower the two markers to functional collectives, one collective per parameter.

Before::

    shard -> fsdp::unshard -> full param            grad -> fsdp::reduce_grad -> shard grad

After (each wait right after its launch: the later passes bucket, move and pin them)::

    shard -> [cast] -> all_gather_into_tensor(ag_group) -> wait_tensor -> [narrow] -> view
    grad -> [cast] -> [pad] -> reduce_scatter_tensor(sum, rs_group) -> wait_tensor
         -> [all_reduce(sum, replicate_group) -> wait_tensor] -> div(dp ranks) -> [cast] -> view

See NOTE [padding] in ``fsdp_compile/api/markers.py``. A world size of one needs no collective: by default the
all-gather and reduce-scatter are left out and only the casts (and views) remain.
"""

from __future__ import annotations

import torch
from torch import Tensor, fx

from ..predicates import ReduceGradArgs, UnshardArgs, is_reduce_grad, is_unshard
from ..splice import splice

__all__ = ["lower_unshard_pass", "lower_reduce_grad_pass", "gather_flat", "scatter_flat"]

c10d = torch.ops._c10d_functional


def cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``x`` in ``dtype`` as the prim Inductor lowers (``Tensor.to`` would trace to ``_to_copy``)."""
    if dtype is None or x.dtype == dtype:
        return x
    return torch.ops.prims.convert_element_type.default(x, dtype)


def gather_flat(flat: Tensor, world_size: int, group: str, *, elide: bool = True) -> Tensor:
    """All-gather a 1-D tensor: ``world_size * len(flat)`` elements, rank-major."""
    if world_size == 1 and elide:
        return flat
    return c10d.wait_tensor(c10d.all_gather_into_tensor(flat, world_size, group))


def scatter_flat(flat: Tensor, world_size: int, group: str, *, elide: bool = True) -> Tensor:
    """Sum-reduce-scatter a 1-D tensor: this rank's ``len(flat) / world_size`` elements."""
    if world_size == 1 and elide:
        return flat
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", world_size, group))


def lower_unshard_pass(gm: fx.GraphModule, *, elide_single_rank: bool = True) -> fx.GraphModule:
    """Replace each ``fsdp::unshard`` with its own all-gather on the all-gather group.

    With ``elide_single_rank`` a group of one rank gets no collective (its all-gather is the identity);
    ``False`` keeps it, to measure what the collective path costs.
    """
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        a = UnshardArgs.of(node)
        dim0 = a.full_shape[0] if a.full_shape else 1

        def gather(shard: Tensor, a: UnshardArgs = a, dim0: int = dim0) -> Tensor:
            x = cast(shard, a.param_dtype)
            full = gather_flat(x.reshape(-1), a.world_size, a.ag_group, elide=elide_single_rank)
            rows = full.view(-1, *x.shape[1:])
            if rows.shape[0] != dim0:  # padding (see NOTE [padding])
                rows = rows[:dim0]
            return rows.reshape(a.full_shape)

        key = ("gather", a.full_shape, a.world_size, a.ag_group, a.param_dtype, elide_single_rank)
        (out,) = splice(gm.graph, gather, [a.shard], before=node, cache_key=key,
                        meta={"unit": a.unit, "param": a.name, "kind": "all_gather",
                              "ag_group": a.ag_group, "rs_group": a.rs_group})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return gm


def lower_reduce_grad_pass(gm: fx.GraphModule, *, elide_single_rank: bool = True) -> fx.GraphModule:
    """Replace each ``fsdp::reduce_grad`` with its own reduce-scatter on the reduce-scatter group and,
    for HSDP, an all-reduce across replicas on the replicate group (tagged ``all_reduce``: its own
    region, bucketed and scheduled by itself).

    ``elide_single_rank`` as in :func:`lower_unshard_pass`.
    """
    for node in list(gm.graph.nodes):
        if not is_reduce_grad(node):
            continue
        a = ReduceGradArgs.of(node)
        grad_dtype = a.grad.meta["val"].dtype if isinstance(a.grad, fx.Node) and "val" in a.grad.meta else None
        meta = {"unit": a.unit, "param": a.name, "ag_group": a.ag_group, "rs_group": a.rs_group,
                "replicate_group": a.replicate_group,
                "casts": a.reduce_dtype is not None and a.reduce_dtype != grad_dtype}  # NOTE [large params alone]

        def scatter(grad: Tensor, a: ReduceGradArgs = a) -> Tensor:
            if elide_single_rank and a.world_size == 1 and tuple(grad.shape) == a.shard_shape:
                # Nothing to pack: flattening would copy a strided gradient (a transposed matmul
                # result) only to view it back; it goes to the shard's grad as it is.
                return cast(grad, a.reduce_dtype) if a.replicate_group else finish(grad, a)
            g = scatter_shard(grad.reshape(-1), a, elide=elide_single_rank)
            return g if a.replicate_group else finish(g, a)

        key = ("scatter", a.shard_shape, a.world_size, a.rs_group, a.replicate_group, a.replicate_size,
               a.reduce_dtype, a.out_dtype, elide_single_rank)
        (out,) = splice(gm.graph, scatter, [a.grad], before=node, meta={**meta, "kind": "reduce_scatter"},
                        cache_key=key)
        if a.replicate_group:

            def replicate(g: Tensor, a: ReduceGradArgs = a) -> Tensor:
                return finish(c10d.wait_tensor(c10d.all_reduce(g, "sum", a.replicate_group)), a)

            (out,) = splice(gm.graph, replicate, [out], before=node, meta={**meta, "kind": "all_reduce"},
                            cache_key=("replicate",) + key)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return gm


def scatter_shard(flat: Tensor, a: ReduceGradArgs, *, elide: bool = True) -> Tensor:
    """Cast, pad (NOTE [padding]) and sum-reduce-scatter one full flat gradient: this rank's rows."""
    g = cast(flat, a.reduce_dtype)
    shard_numel = 1
    for s in a.shard_shape:
        shard_numel *= s
    padded = shard_numel * a.world_size
    if g.numel() < padded:
        g = torch.nn.functional.pad(g, (0, padded - g.numel()))
    return scatter_flat(g, a.world_size, a.rs_group, elide=elide)


def finish(g: Tensor, a: ReduceGradArgs) -> Tensor:
    """Average a summed shard gradient over every data-parallel rank and shape it as the shard."""
    ranks = a.world_size * max(a.replicate_size, 1)
    if ranks > 1:
        g = g / ranks
    g = cast(g, a.out_dtype)
    return g if tuple(g.shape) == a.shard_shape else g.view(a.shard_shape)
