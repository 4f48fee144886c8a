"""Pure graph passes: ``GraphModule -> GraphModule``, one idea per file, no process groups."""

from __future__ import annotations

from .runner import GraphPass, NamedPass, run_passes

__all__ = ["GraphPass", "NamedPass", "run_passes"]
