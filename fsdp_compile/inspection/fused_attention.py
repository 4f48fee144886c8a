"""Trace ``scaled_dot_product_attention`` as the fused kernel a GPU runs, for ``explain`` on meta tensors.

On meta (and CPU) SDPA takes its math path, materialising the (seq x seq) scores that a GPU's flash kernel
never writes. ``FusedAttention`` turns each SDPA call the flash kernel takes into
``aten._scaled_dot_product_flash_attention`` (and its backward), so ``cost.py`` costs the GPU's kernel. Calls
it does not take (a mask, fp32, head dimension over 256) keep the math path; grouped-query attention is
traced with its key and value heads repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FusedAttention"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """(q, k, v, dropout_p, is_causal, scale) when the flash kernel takes this call, else ``None``."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    if bound.get("attn_mask") is not None or q.dtype not in _FLASH_DTYPES or q.shape[-1] > 256:
        return None
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        if not bound.get("enable_gqa") or q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
            return None  # SDPA would refuse it too
        rep = q.shape[1] // k.shape[1]  # grouped-query: the kernel's FLOPs are those of repeated heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return q, k, v, float(bound.get("dropout_p", 0.0)), bool(bound.get("is_causal", False)), bound.get("scale")


class FusedAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` calls the flash-attention op where it can."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            flash = _flash_args(args, kwargs)
            if flash is not None:
                q, k, v, dropout_p, is_causal, scale = flash
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, dropout_p, is_causal, scale=scale)[0]
        return func(*args, **kwargs)
