"""``module.weight`` read outside compiled code: the full parameter, gathered, that acts on its shard.

NOTE [reading a sharded parameter]: outside a graph compiled by ``fsdp_backend``, reading ``module.weight``
is a blocking all-gather (every rank of the group must read it too) whose result is a temporary, so
``requires_grad_(False)`` or ``nn.init.normal_`` on it would change nothing that lasts. So it is a
:class:`GatheredParam`, which sets ``requires_grad`` on the shard itself; writes this rank's rows back into
the shard after any in-place change, also through a view (``.data``, ``w[0].fill_(0)``: each result sharing
its storage is a ``GatheredParam`` too), so initialising after sharding works (NOTE [initialising sharded
parameters] in ``materialize.py``); and says where ``.grad`` lives (``local_shard(module, name).grad``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fsdp_compile._compat import DisableTorchFunctionSubclass
from fsdp_compile.api.state_layout import row_range
from fsdp_compile.api.units import ShardedParam

__all__ = ["GatheredParam", "gathered"]

_INPLACE_DUNDERS = {
    Tensor.__setitem__, Tensor.__iadd__, Tensor.__isub__, Tensor.__imul__, Tensor.__itruediv__,
    Tensor.__ifloordiv__, Tensor.__imod__, Tensor.__ipow__, Tensor.__iand__, Tensor.__ior__, Tensor.__ixor__,
    Tensor.__ilshift__, Tensor.__irshift__,
}


class GatheredParam(Tensor):
    """A sharded parameter's full value (NOTE [reading a sharded parameter]) from ``_fsdp_param``; a view
    of one has ``_fsdp_full``, its full tensor."""

    _fsdp_param: ShardedParam
    _fsdp_full: Tensor

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        # The tensor acted on: the first argument, or the first keyword (nn.init passes tensor=...)
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
    """``out``, each plain tensor in it that shares ``source``'s storage made a ``GatheredParam`` of it."""
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
    """Copy this rank's rows of ``full``'s parameter into the shard (NOTE [padding]: the rest stay zero)."""
    sp = full._fsdp_param
    start, stop = row_range(sp)
    with torch.no_grad(), DisableTorchFunctionSubclass():
        full = _full(full)
        flat = full.reshape(1) if full.dim() == 0 else full
        sp.shard[: stop - start].copy_(flat[start:stop])


def gathered(full: Tensor, sp: ShardedParam) -> Tensor:
    """``full`` (``sp`` gathered) as a :class:`GatheredParam`, when it is a plain eager tensor."""
    if type(full) is not Tensor or torch.compiler.is_compiling():
        return full  # traced, or under a tensor subclass / functorch transform: leave it alone
    # Retyped, not aliased: an alias (as_subclass) would be a view of the marker's output, not writable.
    full.__class__ = GatheredParam
    full._fsdp_param = sp  # type: ignore[attr-defined]  (no _fsdp_full: it would be a reference cycle)
    return full
