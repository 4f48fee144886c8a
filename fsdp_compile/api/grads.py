"""Gradients of sharded parameters, whose norms are global.

NOTE [global norms]: a sharded parameter's ``.grad`` holds this rank's rows, and a norm over them alone
differs per rank: ``clip_grad_norm_`` would silently clip each rank by a different factor. So it is handed
out as a :class:`ShardGrad`, whose norms (``torch.linalg.vector_norm``, ``_foreach_norm``, ``torch.norm``,
``linalg.norm`` / ``matrix_norm`` as vector or Frobenius norms) cover every rank's real rows with one
all-reduce when they reduce over dim 0; matrix norms that need whole columns raise. It is registered for
foreach as torch registers ``DTensor``, so ``clip_grad_norm_`` keeps its foreach path. Every rank must
compute a norm together.
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
    ``_fsdp_group``: the group the rows are spread over; ``_fsdp_rows``: this rank's real rows."""

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


_registered = False  # ShardGrad in torch's foreach types (NOTE [global norms])


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


def _rows(t: Tensor) -> Tensor:
    if isinstance(t, ShardGrad) and t.dim() > 0 and t._fsdp_rows < t.shape[0]:
        with DisableTorchFunctionSubclass():
            return t[: t._fsdp_rows]
    return t


def _local_norm(rows: Tensor, ord: float, dim: Any, keepdim: bool, dtype: torch.dtype) -> Tensor:
    """``vector_norm`` of this rank's real rows, in ``dtype``; with none, the identity of the combination."""
    if rows.numel() == 0 and ord in (math.inf, -math.inf):
        one_row = rows.new_zeros((1, *rows.shape[1:]), dtype=dtype)
        shape = torch.linalg.vector_norm(one_row, 2, dim=dim, keepdim=keepdim).shape
        return torch.full(shape, math.inf if ord == -math.inf else 0.0, dtype=dtype, device=rows.device)
    return torch.linalg.vector_norm(rows, ord, dim=dim, keepdim=keepdim, dtype=dtype)


def _work_dtype(t: Tensor) -> torch.dtype:
    real = t.real.dtype if t.is_complex() else t.dtype
    return torch.promote_types(real, torch.float32)


def _combine(local: Tensor, ord: float, group_name: str) -> Tensor:
    """The ``ord``-norm over all ranks from each rank's local norms."""
    group = resolve_group(group_name)
    op = {math.inf: dist.ReduceOp.MAX, -math.inf: dist.ReduceOp.MIN}.get(ord, dist.ReduceOp.SUM)
    powered = ord not in (math.inf, -math.inf, 0)
    piece = local.pow(ord) if powered else local
    if dist.get_world_size(group) > 1:
        dist.all_reduce(piece, op=op, group=group)
    return piece.pow(1.0 / ord) if powered else piece


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
    raise ValueError(f"fsdp_compile: the {kind} of a sharded gradient needs whole columns, which this rank does "
                     "not hold. Use a vector norm (torch.linalg.vector_norm, or ord='fro'), or gather the gradient "
                     "first with torch.distributed.all_gather_into_tensor over its group.")


def _global_norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, out: Tensor | None = None,
                 dtype: torch.dtype | None = None) -> Tensor:
    """``torch.norm`` / ``Tensor.norm``."""
    if p == "nuc":
        return _refuse("nuclear norm")
    return _global_vector_norm(x, p, dim, keepdim, dtype=dtype, out=out)


def _global_linalg_norm(x: Tensor, ord: Any = None, dim: Any = None, keepdim: bool = False, *,
                        out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``torch.linalg.norm``: vector norms and Frobenius; other matrix norms refuse."""
    matrix = (dim is None and ord is not None and x.dim() == 2) or (dim is not None and not isinstance(dim, int)
                                                                   and len(dim) == 2)
    if ord is None or (matrix and ord == "fro"):
        return _global_vector_norm(x, 2, dim, keepdim, dtype=dtype, out=out)
    if matrix:
        return _refuse(f"matrix norm ord={ord!r}")
    return _global_vector_norm(x, ord, dim, keepdim, dtype=dtype, out=out)


def _global_matrix_norm(x: Tensor, ord: Any = "fro", dim: Any = (-2, -1), keepdim: bool = False, *,
                        out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``torch.linalg.matrix_norm``: Frobenius; the others refuse."""
    if ord != "fro":
        return _refuse(f"matrix norm ord={ord!r}")
    return _global_vector_norm(x, 2, dim, keepdim, dtype=dtype, out=out)


def _global_foreach_norm(tensors: Sequence[Tensor], ord: float | str = 2, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """``torch._foreach_norm``: local norms in one foreach call, then one all-reduce per (group, device, dtype)."""
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
