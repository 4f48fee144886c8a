"""One runner for all passes: run each in order, lint after each, recompile once, optionally log a diff.

A pass is any ``Callable[[GraphModule], GraphModule]``; settings are bound beforehand
(``functools.partial(prefetch_pass, depth=2)``). A pass whose pattern is absent returns the graph as is.
"""

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


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[NamedPass],
    *,
    disabled: Iterable[str] = (),
    log_diff: bool = False,
    allow_unknown: bool = False,
    recompile: bool = True,
) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``, skipping those named in ``disabled``.

    After each pass the graph is linted (a broken graph fails here, naming the pass); it is recompiled
    at the end (and after each pass when logging diffs).
    With ``log_diff`` each pass's before/after code is logged at INFO on this module's logger.
    ``allow_unknown`` accepts disabled names this call does not run (a pipeline split over calls);
    ``recompile=False`` leaves the recompile to a later call of the same pipeline.
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
        except Exception as e:  # re-raised with the pass's name
            raise RuntimeError(f"pass {p.name!r} left a malformed graph: {e}") from e
        if log_diff:
            gm.recompile()
            diff = difflib.unified_diff(
                before.splitlines(), gm.code.splitlines(), f"before {p.name}", f"after {p.name}", lineterm=""
            )
            log.info("%s", "\n".join(diff))
    if recompile:
        gm.recompile()  # once, not after each pass: its Python code is what a large graph's compile waits for
    return gm
