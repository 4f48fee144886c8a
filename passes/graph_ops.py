"""The ``fsdp::`` ops of the graphs: the markers' schemas and the ops the passes put in.

- The markers ``fsdp::unshard`` and ``fsdp::reduce_grad``: their arguments, once (NOTE [one marker spec]
  below), from which their schemas are built; their kernels are in ``fsdp_compile/api/markers.py``.
- Bucket copies: ``pack_shards``, ``copy_out_rows``, ``pack_rows`` (NOTE [bucket copies] below): one op
  per copy into or out of a unit's bucket.

An op's schema takes no nested int lists and no string lists: shapes travel flattened
(:func:`flatten_shapes`), names joined by ``NAMES_SEP``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NAMES_SEP", "PIECE_ARGS", "REDUCE_GRAD_ARGS", "UNSHARD_ARGS", "arg_names", "by_name", "copy_out_rows",
           "flatten_shapes", "in_order", "numel", "pack_rows", "pack_shards", "unflatten_shapes"]

NAMES_SEP = "\n"  # between the names a marker of several pieces carries (a name holding it never joins one)


def flatten_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Shapes as (their ranks, their sizes one after another): what an op's schema can carry."""
    return [len(s) for s in shapes], [int(d) for s in shapes for d in s]


def unflatten_shapes(ranks: Sequence[int], dims: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for r in ranks:
        out.append(list(dims[start:start + r]))
        start += r
    return out


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``."""
    out = 1
    for s in shape:
        out *= s
    return out


# ---------------------------------------------------------------------------------------------
# The markers' arguments
# ---------------------------------------------------------------------------------------------

Spec = tuple[tuple[str, str], ...]  # (name, schema type) of each argument, in order

# NOTE [one marker spec]: the markers' arguments, written once; the schemas of ``fsdp::unshard`` and
# ``fsdp::reduce_grad`` (whose kernels ``fsdp_compile/api/markers.py`` registers) are built from them.
# A marker reads *pieces*: ``shard``'s elements, one piece after another, piece ``i`` of shape
# ``unflatten_shapes(shard_ranks, shard_dims)[i]``, the shard of the parameter named
# ``names.split(NAMES_SEP)[i]``, of full shape ``unflatten_shapes(ranks, dims)[i]``. A traced read is
# one piece (its shard, in its shape); a unit's flat marker is every piece of its flat shard (NOTE [flat
# markers] in ``capture/group_markers.py``). Kernels, fakes, backwards and passes read arguments by these
# names (``by_name``, ``in_order``, ``predicates.marker_args``); ``fully_shard`` builds a read's arguments
# by name too.
UNSHARD_ARGS: Spec = (
    ("shard", "Tensor"), ("shard_ranks", "SymInt[]"), ("shard_dims", "SymInt[]"), ("ranks", "SymInt[]"),
    ("dims", "SymInt[]"), ("names", "str"), ("world_size", "SymInt"), ("unit", "SymInt"), ("ag_group", "str"),
    ("rs_group", "str"), ("replicate_group", "str"), ("replicate_size", "SymInt"), ("reshard", "bool"),
    ("param_dtype", "ScalarType?"), ("reduce_dtype", "ScalarType?"),
    ("accumulate", "Tensor[]?"),  # (default None: gradient accumulation without communication)
)
REDUCE_GRAD_ARGS: Spec = (
    ("grads", "Tensor[]"), ("shard_ranks", "SymInt[]"), ("shard_dims", "SymInt[]"), ("names", "str"),
    ("world_size", "SymInt"), ("unit", "SymInt"), ("ag_group", "str"), ("rs_group", "str"), ("replicate_group", "str"),
    ("replicate_size", "SymInt"), ("reduce_dtype", "ScalarType?"), ("out_dtype", "ScalarType"),
)
PIECE_ARGS = frozenset({"shard", "shard_ranks", "shard_dims", "ranks", "dims", "names", "accumulate"})
"""The arguments that describe a marker's pieces; the rest are its unit's, alike for all its pieces."""


def arg_names(spec: Spec) -> tuple[str, ...]:
    return tuple(name for name, _ in spec)


def by_name(spec: Spec, args: Sequence[object]) -> dict[str, object]:
    """An op's positional arguments by their names in ``spec``."""
    return dict(zip(arg_names(spec), args))


def in_order(spec: Spec, **values: object) -> tuple[object, ...]:
    """An op's positional arguments in ``spec``'s order, taken from ``values`` by name (others ignored)."""
    return tuple(values[name] for name in arg_names(spec))


def _schema(spec: Spec) -> str:
    """``spec`` as a schema's arguments; a last optional argument defaults to ``None``."""
    args = [f"{type_} {name}" for name, type_ in spec]
    return ", ".join(args[:-1] + [args[-1] + ("=None" if spec[-1][1].endswith("?") else "")])


def _define(qualname: str, args: str, returns: str) -> None:
    torch.library.define(qualname, f"({args}) -> {returns}", tags=(torch.Tag.pt2_compliant_tag,))


_define("fsdp::unshard", _schema(UNSHARD_ARGS), "Tensor[]")
_define("fsdp::reduce_grad", _schema(REDUCE_GRAD_ARGS), "Tensor")


# ---------------------------------------------------------------------------------------------
# Bucket copies
# ---------------------------------------------------------------------------------------------

# NOTE [bucket copies]: at world size W a unit's gathered bucket is (W, N) rank-major, so each member's
# rows are strided: every member is copied out before use, and every gradient is copied in, interleaved,
# before the reduce-scatter. Written with aten ops (per member a flatten, a cast, a pad, a ``split`` and
# reshapes), Inductor lowers each member's nodes and generates a copy kernel per bucket, and its compile
# time grows with the number of parameters. As one op per copy, each is a single node to compile and a
# single launch to run, whatever the bucket holds: the members go in and come out in their own shapes,
# cast and padded inside the op (torch's ``cat(out=)``, ``split_with_sizes_copy`` and ``_chunk_cat``:
# one CUDA kernel each, as FSDP2 uses them). The ops are opaque to Inductor, which has nothing to fuse
# there anyway: the members' consumers are matmuls, and their producers too.
#
# NOTE [copies take any layout]: the pack of shards and the copy out of a gathered bucket read their
# inputs through ``reshape`` (any strides will do), so Inductor need not pin the inputs to the traced
# strides: by default it checks and fixes the layout of every tensor input of a custom op when lowering
# the outer graph (nine shards per unit's pack). ``flexible_layout``
# lets it pass them as they are. (The gradients' pack keeps the default: ``_chunk_cat`` is left the
# layouts it was traced with.)
_ANY_LAYOUT = (torch.Tag.flexible_layout,)


@torch.library.custom_op("fsdp::pack_shards", mutates_args=(), tags=_ANY_LAYOUT)
def pack_shards(shards: list[Tensor], world: int, rank: int, dtype: torch.dtype) -> Tensor:
    """A new ``world * N`` buffer in ``dtype`` (``N``: the shards' elements) whose slice ``rank`` holds the
    shards, flattened and concatenated: an all-gather's output, this rank's part already in place
    (NOTE [in-place all-gather] in ``lower/bucket.py``); the rest is left for the collective to fill."""
    sizes = [s.numel() for s in shards]
    out = shards[0].new_empty(world * sum(sizes), dtype=dtype)
    mine = out.narrow(0, rank * sum(sizes), sum(sizes))
    torch.cat([s.reshape(-1) for s in shards], out=mine)
    return out


@pack_shards.register_fake
def _pack_shards_fake(shards: list[Tensor], world: int, rank: int, dtype: torch.dtype) -> Tensor:
    return shards[0].new_empty(world * sum(s.numel() for s in shards), dtype=dtype)


@torch.library.custom_op("fsdp::copy_out_rows", mutates_args=(), tags=_ANY_LAYOUT)
def copy_out_rows(gathered: Tensor, world: int, sizes: list[int], ranks: list[int], dims: list[int]) -> list[Tensor]:
    """``gathered`` viewed as (``world``, sum(sizes)): member ``i`` is columns ``[off_i, off_i + sizes[i])``
    of every row, its ``world`` pieces one after another; returned contiguous in its own shape, the
    next ``ranks[i]`` sizes of ``dims``, whose dim 0 may be shorter than the gathered rows (the padding
    left off, NOTE [padding])."""
    outs = [gathered.new_empty(world * s) for s in sizes]
    torch.split_with_sizes_copy(gathered.reshape(world, -1), sizes, dim=1,
                                out=[o.view(world, s) for o, s in zip(outs, sizes)])
    return [o.narrow(0, 0, numel(shape)).view(shape) for o, shape in zip(outs, unflatten_shapes(ranks, dims))]


@copy_out_rows.register_fake
def _copy_out_rows_fake(gathered: Tensor, world: int, sizes: list[int], ranks: list[int],
                        dims: list[int]) -> list[Tensor]:
    return [gathered.new_empty(shape) for shape in unflatten_shapes(ranks, dims)]


@torch.library.custom_op("fsdp::pack_rows", mutates_args=())
def pack_rows(grads: list[Tensor], world: int, dtype: torch.dtype) -> Tensor:
    """Each gradient split into ``world`` chunks of rows (dim 0, the last chunk zero-padded: NOTE
    [padding]), chunk ``r`` of every gradient in turn, flat in ``dtype``: the reduce-scatter input, rank
    ``r`` receiving chunk ``r`` (one ``_chunk_cat``)."""
    rows = [g.reshape(1) if g.dim() == 0 else g for g in grads]
    out = rows[0].new_empty(world, _chunk_numel(rows, world), dtype=dtype)
    torch._chunk_cat(rows, 0, world, out=out)
    return out.view(-1)


def _chunk_numel(grads: list[Tensor], world: int) -> int:
    total = 0
    for g in grads:
        per_row = g.numel() // g.shape[0] if g.shape[0] else 0
        total += -(-g.shape[0] // world) * per_row
    return total


@pack_rows.register_fake
def _pack_rows_fake(grads: list[Tensor], world: int, dtype: torch.dtype) -> Tensor:
    rows = [g.reshape(1) if g.dim() == 0 else g for g in grads]
    return rows[0].new_empty(world * _chunk_numel(rows, world), dtype=dtype)
