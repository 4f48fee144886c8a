"""Pure graph passes, ``GraphModule -> GraphModule``: ``capture/`` on Dynamo's graph, ``lower/`` (markers to
collectives) on AOTAutograd's, ``schedule/`` placing collectives and streams; shared helpers beside them."""

from __future__ import annotations

from .runner import GraphPass, NamedPass, run_passes

__all__ = ["GraphPass", "NamedPass", "run_passes"]
