"""``module.weight`` read outside the compiled model: the full parameter, gathered, that still acts on
the shard it came from.

NOTE [reading a sharded parameter]: after ``fully_shard``, ``module.weight`` is computed: reading it
runs ``fsdp::unshard``, which, outside a graph compiled by ``fsdp_backend``, is a blocking all-gather
over the unit's group (every rank of it must read it too, like any collective). The result is a
temporary, so on a plain tensor ``module.weight.requires_grad_(False)`` fails ("only leaf variables")
and ``nn.init.normal_(module.weight)`` changes nothing that lasts. Outside compiled code it is
therefore handed out as a :class:`GatheredParam`, which:

- sets ``requires_grad`` (``requires_grad_()`` or ``.requires_grad =``) on the parameter itself, the
  shard, so freezing works as on an unsharded model;
- writes this rank's rows back into the shard after any in-place change (``copy_``, ``fill_``,
  ``normal_``, ``x[...] = v``, ``out=x``), also one made through a view of it (``.data``, ``detach()``,
  ``w[0].fill_(0)``, ``w.view_as(q).copy_(q)``: every result that shares its storage is handed out as a
  ``GatheredParam`` of the same full tensor), so initialising after sharding works. Every rank computes
  the same full values (the same RNG stream, as the unsharded model draws them) and keeps its rows: NOTE
  [initialising sharded parameters] in ``materialize.py``;
- says where the gradient lives when ``.grad`` is read (on the shard: ``local_shard(module, name).grad``).

Everything else runs as on a plain tensor and returns plain tensors. To read this rank's rows without
any communication use :func:`fsdp_compile.local_shard` (the parameter the optimizer sees).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fsdp_compile._compat import DisableTorchFunctionSubclass
from fsdp_compile.api.units import ShardedParam

__all__ = ["GatheredParam", "gathered"]

_INPLACE_DUNDERS = {
    Tensor.__setitem__, Tensor.__iadd__, Tensor.__isub__, Tensor.__imul__, Tensor.__itruediv__,
    Tensor.__ifloordiv__, Tensor.__imod__, Tensor.__ipow__, Tensor.__iand__, Tensor.__ior__, Tensor.__ixor__,
    Tensor.__ilshift__, Tensor.__irshift__,
}


class GatheredParam(Tensor):
    """The full value of a sharded parameter, read outside compiled code (NOTE [reading a sharded
    parameter]); ``_fsdp_param`` is the parameter it was gathered from; a view of one has ``_fsdp_full``,
    the full tensor it shares storage with."""

    _fsdp_param: ShardedParam
    _fsdp_full: Tensor

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        # The tensor acted on: the first argument, or the first keyword (nn.init passes tensor=...).
        first = args[0] if args else next(iter(kwargs.values()), None)
        self = first if isinstance(first, GatheredParam) else None
        if self is not None and func in (Tensor.requires_grad_, Tensor.requires_grad.__set__):
            flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
            self._fsdp_param.shard.requires_grad_(bool(flag))
            return self if func is Tensor.requires_grad_ else None
        if self is not None and func == Tensor.grad.__get__:
            warnings.warn(
                f"fsdp_compile: {self._fsdp_param.fqn} is gathered from shards and has no .grad; its gradient "
                f"(this rank's rows) is local_shard(module, {self._fsdp_param.local_name.rsplit('.', 1)[-1]!r}).grad",
                stacklevel=2,
            )
            return None
        with DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if self is not None:  # views (w[0], w.data, w.detach(), w.view_as(q)) write back too
                out = _keep_views(out, self)
        target = kwargs.get("out")
        written = target if isinstance(target, GatheredParam) else self if self is not None and _in_place(func) else None
        if written is not None:
            _write_back(written)
        return out


def _keep_views(out: Any, source: GatheredParam) -> Any:
    """``out``, with each plain tensor in it that shares ``source``'s storage made a ``GatheredParam`` of
    ``source``'s full tensor (run with torch functions of subclasses disabled)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_keep_views(o, source) for o in out)
    if type(out) is Tensor and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        out.__class__ = GatheredParam
        out._fsdp_param, out._fsdp_full = source._fsdp_param, _full(source)  # type: ignore[attr-defined]
    return out


def _in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return func in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _full(t: GatheredParam) -> Tensor:
    """The full tensor ``t`` is (a gathered read) or is a view of."""
    return t.__dict__.get("_fsdp_full", t)


def _write_back(full: GatheredParam) -> None:
    """Copy this rank's rows of ``full``'s whole parameter into the shard (NOTE [padding]: rows past the end stay zero)."""
    sp = full._fsdp_param
    shard = sp.shard
    rows = shard.shape[0]
    start = sp.shard_index * rows
    with torch.no_grad(), DisableTorchFunctionSubclass():
        full = _full(full)  # the whole parameter, which a view written into shares storage with
        flat = full.reshape(1) if full.dim() == 0 else full
        real = max(0, min(rows, flat.shape[0] - start))
        shard[:real].copy_(flat[start:start + real])


def gathered(full: Tensor, sp: ShardedParam) -> Tensor:
    """``full`` (``sp`` gathered) as a :class:`GatheredParam`, when it is a plain eager tensor."""
    if type(full) is not Tensor or torch.compiler.is_compiling():
        return full  # traced, or under a tensor subclass / functorch transform: leave it alone
    # The same tensor object, retyped: an alias (as_subclass) would be a view of the marker's output,
    # which autograd forbids writing into.
    full.__class__ = GatheredParam
    full._fsdp_param = sp  # type: ignore[attr-defined]  (no _fsdp_full: it would be a reference cycle)
    return full
