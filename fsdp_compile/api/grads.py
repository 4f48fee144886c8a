"""Gradients of sharded parameters, whose norms are global.

NOTE [global norms]: a sharded parameter's ``.grad`` holds this rank's rows of the full gradient. A norm
over those rows alone differs per rank: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` would
clip each rank's rows by a different factor, silently. So after every backward the gradient of a
sharded parameter is handed out as a :class:`ShardGrad`: the same tensor (this rank's rows), whose
*norms* are computed over every rank's rows with one all-reduce over the shard group. Everything else
runs on it as on a plain tensor and returns plain tensors. ``ShardGrad`` is registered for foreach as
torch registers ``DTensor`` (when the first one is made, not at import: torch's list of foreach types is
process-wide), so ``clip_grad_norm_`` and ``get_total_norm`` keep their foreach path: one
``_foreach_norm`` and one all-reduce per (group, device) for the whole model, and then a norm of the
per-parameter global norms, which is the global norm.

Norms that combine across ranks: ``torch.linalg.vector_norm`` and ``torch._foreach_norm`` (any ``ord``),
``Tensor.norm`` / ``torch.norm`` (numbers and ``"fro"``), ``torch.linalg.norm`` and ``torch.linalg.matrix_norm`` (vector norms
and the Frobenius norm) when the reduction covers dim 0, the sharded dim; a reduction over other dims alone is
per row, and stays this rank's rows. Matrix norms that need whole columns (``"nuc"``, spectral, 1, inf
of a matrix) raise, with the fix. Padding rows (NOTE [padding]) never count. Every rank must compute a
norm together, like any collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdp_compile._compat import DisableTorchFunctionSubclass, register_foreach_type, resolve_group

__all__ = ["ShardGrad", "as_shard_grad"]


class ShardGrad(Tensor):
    """This rank's rows of a sharded parameter's gradient; its norms are over every rank's rows.

    ``_fsdp_group``: name of the process group the rows are spread over; ``_fsdp_rows``: how many of
    this rank's rows are real (the rest are padding).
    """

    _fsdp_group: str
    _fsdp_rows: int

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        handler = _HANDLERS.get(func)
        kwargs = kwargs or {}
        if handler is not None:
            return handler(*args, **kwargs)
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_registered = False  # ShardGrad in torch's foreach types (NOTE [global norms]), from the first one made


def as_shard_grad(grad: Tensor, group_name: str, rows: int) -> ShardGrad:
    """``grad`` (this rank's rows) as a :class:`ShardGrad` sharing its storage."""
    global _registered
    if type(grad) is ShardGrad:
        return grad  # type: ignore[return-value]
    if not _registered:
        register_foreach_type(ShardGrad)
        _registered = True
    out = grad.as_subclass(ShardGrad)
    out._fsdp_group = group_name
    out._fsdp_rows = rows
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# The arithmetic: a p-norm over all ranks from per-rank pieces.
# ---------------------------------------------------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    """The real rows of a shard (a view, or ``t`` itself when nothing is padding)."""
    if isinstance(t, ShardGrad) and t.dim() > 0 and t._fsdp_rows < t.shape[0]:
        with DisableTorchFunctionSubclass():
            return t[: t._fsdp_rows]
    return t


def _to_piece(norm: Tensor, ord: float) -> tuple[Tensor, dist.ReduceOp]:
    """A local norm as the quantity that adds (or max/mins) across ranks."""
    if ord == math.inf:
        return norm, dist.ReduceOp.MAX
    if ord == -math.inf:
        return norm, dist.ReduceOp.MIN
    if ord == 0:
        return norm, dist.ReduceOp.SUM
    return norm.pow(ord), dist.ReduceOp.SUM


def _from_piece(total: Tensor, ord: float) -> Tensor:
    if ord in (math.inf, -math.inf, 0):
        return total
    return total.pow(1.0 / ord)


def _local_norm(rows: Tensor, ord: float, dim: Any, keepdim: bool, dtype: torch.dtype) -> Tensor:
    """``vector_norm`` of this rank's real rows, in ``dtype``; where this rank has no real row, the
    identity of the combination (0 for sums and max, +inf for min)."""
    if rows.numel() == 0 and ord in (math.inf, -math.inf):
        one_row = rows.new_zeros((1, *rows.shape[1:]), dtype=dtype)
        shape = torch.linalg.vector_norm(one_row, 2, dim=dim, keepdim=keepdim).shape
        return torch.full(shape, math.inf if ord == -math.inf else 0.0, dtype=dtype, device=rows.device)
    return torch.linalg.vector_norm(rows, ord, dim=dim, keepdim=keepdim, dtype=dtype)


def _work_dtype(t: Tensor) -> torch.dtype:
    real = t.real.dtype if t.is_complex() else t.dtype
    return torch.promote_types(real, torch.float32)


def _combine(pieces: Tensor, ord: float, group_name: str) -> Tensor:
    group = resolve_group(group_name)
    piece, op = _to_piece(pieces, ord)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(piece, op=op, group=group)
    return _from_piece(piece, ord)


def _covers_dim0(dim: Any, ndim: int) -> bool:
    if dim is None:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    return any(d % max(ndim, 1) == 0 for d in dims) or len(dims) == 0


def _global_vector_norm(x: Tensor, ord: float | str = 2, dim: Any = None, keepdim: bool = False, *,
                        dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    if out is not None:
        raise TypeError("fsdp_compile: a norm of a sharded gradient cannot write to out=; assign the result instead.")
    ord = 2.0 if ord == "fro" else float(ord)
    with DisableTorchFunctionSubclass():
        result_dtype = dtype or (x.real.dtype if x.is_complex() else x.dtype)
        if not _covers_dim0(dim, x.dim()):  # per row: this rank's rows are the answer
            return torch.linalg.vector_norm(x, ord, dim=dim, keepdim=keepdim, dtype=dtype)
        local = _local_norm(_rows(x), ord, dim, keepdim, _work_dtype(x))
        return _combine(local, ord, x._fsdp_group).to(result_dtype)  # type: ignore[attr-defined]


def _refuse(kind: str) -> Tensor:
    raise ValueError(
        f"fsdp_compile: the {kind} of a sharded gradient needs whole columns, which this rank does not hold. "
        "Use a vector norm (torch.linalg.vector_norm, or ord='fro'), or gather the gradient first with "
        "torch.distributed.all_gather_into_tensor over its group."
    )


def _global_norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, out: Tensor | None = None,
                 dtype: torch.dtype | None = None) -> Tensor:
    """``torch.norm`` / ``Tensor.norm``."""
    if p == "nuc":
        return _refuse("nuclear norm")
    return _global_vector_norm(x, p, dim, keepdim, dtype=dtype, out=out)


def _global_linalg_norm(x: Tensor, ord: Any = None, dim: Any = None, keepdim: bool = False, *,
                        out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``torch.linalg.norm``: a vector norm, or the Frobenius norm; other matrix norms refuse."""
    matrix = (dim is None and ord is not None and x.dim() == 2) or (dim is not None and not isinstance(dim, int)
                                                                   and len(dim) == 2)
    if ord is None or (matrix and ord == "fro"):
        return _global_vector_norm(x, 2, dim, keepdim, dtype=dtype, out=out)
    if matrix:
        return _refuse(f"matrix norm ord={ord!r}")
    return _global_vector_norm(x, ord, dim, keepdim, dtype=dtype, out=out)


def _global_matrix_norm(x: Tensor, ord: Any = "fro", dim: Any = (-2, -1), keepdim: bool = False, *,
                        out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``torch.linalg.matrix_norm``: the Frobenius norm combines across ranks; the others refuse."""
    if ord != "fro":
        return _refuse(f"matrix norm ord={ord!r}")
    return _global_vector_norm(x, 2, dim, keepdim, dtype=dtype, out=out)


def _global_foreach_norm(tensors: Sequence[Tensor], ord: float | str = 2, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """``torch._foreach_norm``: local norms in one foreach call, then one all-reduce per (group, device,
    dtype); the per-tensor results are views of that all-reduce's output (no launch per tensor)."""
    ord = 2.0 if ord == "fro" else float(ord)
    out: list[Tensor | None] = [None] * len(tensors)
    with DisableTorchFunctionSubclass():
        plain = [i for i, t in enumerate(tensors) if not isinstance(t, ShardGrad)]
        if plain:
            for i, norm in zip(plain, torch._foreach_norm([tensors[i] for i in plain], ord, dtype=dtype)):
                out[i] = norm
        batches: dict[tuple[str, torch.device, torch.dtype, torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            if isinstance(t, ShardGrad):
                result = dtype or (t.real.dtype if t.is_complex() else t.dtype)
                batches.setdefault((t._fsdp_group, t.device, result, _work_dtype(t)), []).append(i)
        for (group, _device, result, work), idx in batches.items():
            rows = [_rows(tensors[i]) for i in idx]
            if ord >= 0 and ord != math.inf:  # foreach has no identity for empty rows under inf / -inf
                local = torch.stack(list(torch._foreach_norm(rows, ord, dtype=work)))
            else:
                local = torch.stack([_local_norm(r, ord, None, False, work) for r in rows])
            for i, norm in zip(idx, _combine(local, ord, group).to(result).unbind()):
                out[i] = norm
    return tuple(out)  # type: ignore[arg-type]


_HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.linalg.vector_norm: _global_vector_norm,
    torch.norm: _global_norm,
    Tensor.norm: _global_norm,
    torch.linalg.norm: _global_linalg_norm,
    torch.linalg.matrix_norm: _global_matrix_norm,
    torch._foreach_norm: _global_foreach_norm,
}
