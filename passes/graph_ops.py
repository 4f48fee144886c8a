"""The ``fsdp::`` ops: the markers' schemas (NOTE [one marker spec]) and the bucket copies the passes insert
(NOTE [bucket copies]). Schemas take no nested int lists or string lists: shapes travel flattened
(:func:`flatten_shapes`), names joined by ``NAMES_SEP``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NAMES_SEP", "PIECE_ARGS", "REDUCE_GRAD_ARGS", "UNSHARD_ARGS", "arg_names", "by_name", "copy_out_rows",
           "flatten_shapes", "in_order", "numel", "pack_rows", "pack_shards", "unflatten_shapes"]

NAMES_SEP = "\n"  # between the names of a marker's pieces


def flatten_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Shapes as (their ranks, their sizes one after another)."""
    return [len(s) for s in shapes], [int(d) for s in shapes for d in s]


def unflatten_shapes(ranks: Sequence[int], dims: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for r in ranks:
        out.append(list(dims[start:start + r]))
        start += r
    return out


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


Spec = tuple[tuple[str, str], ...]  # (name, schema type) of each argument, in order

# NOTE [one marker spec]: the markers' arguments, written once; the schemas of ``fsdp::unshard`` and
# ``fsdp::reduce_grad`` (kernels in ``fsdp_compile/api/markers.py``) are built from them, and everything
# reads arguments by these names (``by_name``, ``in_order``, ``predicates.marker_args``). A marker reads
# *pieces* of ``shard``, one after another: piece ``i`` has shape ``unflatten_shapes(shard_ranks,
# shard_dims)[i]`` and is the shard of parameter ``names.split(NAMES_SEP)[i]``, of full shape
# ``unflatten_shapes(ranks, dims)[i]``. A traced read is one piece; a flat marker is every piece of a
# flat shard (NOTE [flat markers] in ``capture/group_markers.py``).
UNSHARD_ARGS: Spec = (
    ("shard", "Tensor"), ("shard_ranks", "SymInt[]"), ("shard_dims", "SymInt[]"), ("ranks", "SymInt[]"),
    ("dims", "SymInt[]"), ("names", "str"), ("world_size", "SymInt"), ("unit", "SymInt"), ("ag_group", "str"),
    ("rs_group", "str"), ("replicate_group", "str"), ("replicate_size", "SymInt"), ("reshard", "bool"),
    ("param_dtype", "ScalarType?"), ("reduce_dtype", "ScalarType?"),
    ("accumulate", "Tensor[]?"),  # gradient accumulation without communication (default None)
)
REDUCE_GRAD_ARGS: Spec = (
    ("grads", "Tensor[]"), ("shard_ranks", "SymInt[]"), ("shard_dims", "SymInt[]"), ("names", "str"),
    ("world_size", "SymInt"), ("unit", "SymInt"), ("ag_group", "str"), ("rs_group", "str"), ("replicate_group", "str"),
    ("replicate_size", "SymInt"), ("reduce_dtype", "ScalarType?"), ("out_dtype", "ScalarType"),
)
# The arguments that describe a marker's pieces; the rest are its unit's.
PIECE_ARGS = frozenset({"shard", "shard_ranks", "shard_dims", "ranks", "dims", "names", "accumulate"})


def arg_names(spec: Spec) -> tuple[str, ...]:
    return tuple(name for name, _ in spec)


def by_name(spec: Spec, args: Sequence[object]) -> dict[str, object]:
    """An op's positional arguments by their names in ``spec``."""
    return dict(zip(arg_names(spec), args))


def in_order(spec: Spec, **values: object) -> tuple[object, ...]:
    """An op's positional arguments in ``spec``'s order, from ``values`` by name (others ignored)."""
    return tuple(values[name] for name in arg_names(spec))


def _schema(spec: Spec) -> str:
    """``spec`` as a schema's arguments; a last optional argument defaults to ``None``."""
    args = [f"{type_} {name}" for name, type_ in spec]
    return ", ".join(args[:-1] + [args[-1] + ("=None" if spec[-1][1].endswith("?") else "")])


def _define(qualname: str, args: str, returns: str) -> None:
    torch.library.define(qualname, f"({args}) -> {returns}", tags=(torch.Tag.pt2_compliant_tag,))


_define("fsdp::unshard", _schema(UNSHARD_ARGS), "Tensor[]")
_define("fsdp::reduce_grad", _schema(REDUCE_GRAD_ARGS), "Tensor")


# NOTE [bucket copies]: at world size W a gathered bucket is (W, N) rank-major, so every member is copied
# out before use and every gradient copied in, interleaved, before the reduce-scatter. As aten ops (per
# member a flatten, cast, pad, split, reshapes) Inductor compiles nodes per parameter; as one custom op
# per copy (``cat(out=)``, ``split_with_sizes_copy``, ``_chunk_cat``: one kernel each, as in FSDP2), each
# copy is one node and one launch. Inductor has nothing to fuse there: producers and consumers are matmuls.
#
# NOTE [copies take any layout]: the pack of shards and the copy out of a gathered bucket read their inputs
# through ``reshape``, so ``flexible_layout`` spares Inductor pinning each input to its traced strides.
# The gradients' pack keeps the default (``_chunk_cat`` gets the traced layouts).
_ANY_LAYOUT = (torch.Tag.flexible_layout,)


@torch.library.custom_op("fsdp::pack_shards", mutates_args=(), tags=_ANY_LAYOUT)
def pack_shards(shards: list[Tensor], world: int, rank: int, dtype: torch.dtype) -> Tensor:
    """A new ``world * N`` buffer in ``dtype`` whose slice ``rank`` holds the shards (``N`` elements), flat and
    concatenated: an all-gather's output with this rank's part in place (NOTE [in-place all-gather] in
    ``lower/bucket.py``)."""
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
    """``gathered`` as (``world``, sum(sizes)): member ``i`` is columns ``[off_i, off_i + sizes[i])`` of every
    row, returned contiguous in its shape from ``ranks``/``dims`` (the padding left off, NOTE [padding])."""
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
    """The reduce-scatter input, flat in ``dtype``: chunk ``r`` (of ``world`` chunks of rows, zero-padded:
    NOTE [padding]) of every gradient in turn, for each rank ``r``."""
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
