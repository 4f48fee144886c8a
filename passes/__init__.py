"""Pure graph passes: ``GraphModule -> GraphModule``, one idea per file, no process groups.

- ``capture/``: on Dynamo's graph, before AOTAutograd (outline, unroll, hoist, inline, group markers);
- ``lower/``: on each graph AOTAutograd hands on (share bodies; every marker to its bucket's
  collectives, written by ``bucket.py``);
- ``schedule/``: where collectives and copies go and which stream runs them (prefetch, reduce_scatter,
  streams, absorb);
- shared: ``runner`` (one runner), ``predicates``, ``splice``, ``order``, ``collective_regions``,
  ``subgraphs``; ``graph_ops`` (the one marker spec and the ``fsdp::`` ops the passes insert);
  ``_compat`` (the private torch APIs they use).
"""

from __future__ import annotations

from .runner import GraphPass, NamedPass, run_passes

__all__ = ["GraphPass", "NamedPass", "run_passes"]
