"""``FsdpModule``: the class a ``fully_shard`` call mixes into the module's class, as FSDP2 does.

It adds methods only (``set_requires_gradient_sync``); all state lives in the unit registry
(``units.py``), none on the module.
"""

from __future__ import annotations

from torch import nn

from .accumulate import set_requires_gradient_sync

__all__ = ["FsdpModule", "mix_in"]


class FsdpModule:
    """Methods every ``fully_shard``-ed module gains."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's name for :func:`fsdp_compile.set_requires_gradient_sync` on this module."""
        assert isinstance(self, nn.Module)
        set_requires_gradient_sync(self, requires_gradient_sync, recurse=recurse)


_classes: dict[type, type] = {}


def mix_in(module: nn.Module) -> None:
    """Make ``module`` an instance of ``FsdpModule`` too (one generated class per original class)."""
    cls = type(module)
    if issubclass(cls, FsdpModule):
        return
    if cls not in _classes:
        _classes[cls] = type(f"Fsdp{cls.__name__}", (FsdpModule, cls), {})
    module.__class__ = _classes[cls]
