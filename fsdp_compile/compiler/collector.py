"""Python's garbage collector while our backend compiles: NOTE [no full collections]."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from fsdp_compile._compat import in_frame_compile, on_each_compile

__all__ = ["defer_full_collections_while_compiling", "no_full_collections"]

_NEVER = 2**31 - 1


@contextlib.contextmanager
def no_full_collections() -> Iterator[None]:
    """NOTE [no full collections]: a compile makes a great many objects that live until it ends (graphs,
    nodes, fake tensors), so Python's collector promotes them and every few thousand allocations runs a
    full collection, each walking every object the process holds, torch's own included: seconds of a
    deep model's compile (docs/compile-time.md). While our backend compiles, only the young generations are
    collected (short-lived garbage goes as usual); what the compile leaves in the old generation waits
    for the first full collection after it. Nested compiles, a collector switched off and a user's own
    setting of the oldest generation's threshold are left as they are. Compiles of other backends in the
    process are never touched (see :func:`defer_full_collections_while_compiling`)."""
    threshold = gc.get_threshold()
    if not gc.isenabled() or threshold[2] >= _NEVER:
        yield
        return
    gc.set_threshold(threshold[0], threshold[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


# NOTE [no full collections], to the end of our compile: the context above covers our backend and each
# compiler it calls, but a Dynamo frame compile also builds guards after the backend returns, and that
# is where a full collection goes once the backend defers its own. So the backend, when Dynamo calls it, also defers full collections
# to the end of the frame compile running now. Dynamo's compile-end callback ends the deferral; it is
# registered on the first call of our backend and does nothing in a compile our backend was not part of
# (no deferral to end). Dynamo's trace *before* our backend runs is not covered: nothing says, when a
# compile starts, which backend it is for, and holding every compile of the process for our sake would be a process-wide effect.
_deferred: list[contextlib.ExitStack] = []


def _defer() -> None:
    if not _deferred:
        stack = contextlib.ExitStack()
        stack.enter_context(no_full_collections())
        _deferred.append(stack)


def _undefer(_args: object = None) -> None:
    while _deferred:
        _deferred.pop().close()


def _nothing(_args: object = None) -> None:
    """Dynamo's compile callbacks come in pairs; ours acts only at the end."""


def defer_full_collections_while_compiling() -> None:
    """No full collection from now to the end of the Dynamo compile running now (the backend calls it
    first; NOTE [no full collections], to the end of our compile). Outside a Dynamo compile (a backend
    called by hand) it does nothing, as nothing would end the deferral."""
    on_each_compile(_nothing, _undefer)  # idempotent; again after a torch.compiler.reset() forgot it
    if in_frame_compile():
        _defer()
