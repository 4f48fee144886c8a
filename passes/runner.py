"""Run passes (each a ``Callable[[GraphModule], GraphModule]``, settings bound with ``functools.partial``)
in order, linting after each."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import fx

__all__ = ["GraphPass", "NamedPass", "run_passes"]

log = logging.getLogger(__name__)

GraphPass = Callable[[fx.GraphModule], fx.GraphModule]


@dataclass(frozen=True)
class NamedPass:
    """A pass and the name it is logged, diffed and switched off by."""
    name: str
    fn: GraphPass


def run_passes(gm: fx.GraphModule, passes: Sequence[NamedPass], *, disabled: Iterable[str] = (),
               log_diff: bool = False, allow_unknown: bool = False, recompile: bool = True) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``, skipping those named in ``disabled``; lint after each (naming the
    pass that broke the graph) and recompile at the end (``recompile=False``: a later call does).

    ``log_diff`` logs each pass's code diff at INFO; ``allow_unknown`` accepts disabled names that this call
    does not run (a pipeline split over calls).
    """
    skip = set(disabled)
    unknown = skip - {p.name for p in passes}
    if unknown and not allow_unknown:
        raise ValueError(
            f"run_passes: disabled names {sorted(unknown)} match no pass; known passes: {[p.name for p in passes]}"
        )
    for p in passes:
        if p.name in skip:
            continue
        before = gm.code if log_diff else ""
        gm = p.fn(gm)
        try:
            gm.graph.lint()
        except Exception as e:
            raise RuntimeError(f"pass {p.name!r} left a malformed graph: {e}") from e
        if log_diff:
            gm.recompile()
            diff = difflib.unified_diff(
                before.splitlines(), gm.code.splitlines(), f"before {p.name}", f"after {p.name}", lineterm=""
            )
            log.info("%s", "\n".join(diff))
    if recompile:
        gm.recompile()
    return gm
