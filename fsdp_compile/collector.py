"""Python's garbage collector while compiling: NOTE [no full collections]."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from ._compat import in_frame_compile, on_each_compile

__all__ = ["defer_full_collections_while_compiling", "hold_full_collections_in_compiles", "no_full_collections"]

_NEVER = 2**31 - 1


@contextlib.contextmanager
def no_full_collections() -> Iterator[None]:
    """NOTE [no full collections]: a compile makes a great many objects that live until it ends (graphs,
    nodes, fake tensors), so Python's collector promotes them and every few thousand allocations runs a
    full collection, each walking every object the process holds, torch's own included: at 32 blocks
    five of them took 2.0 s of a 38 s CPU compile here (0.4 s each), and on the H200's host the
    collector took 2.1 s of 19.5 s (0.6 s at 4 blocks). While our backend compiles, only the young
    generations are collected (short-lived garbage goes as usual); what the compile leaves in the old
    generation waits for the first full collection after it. Nested compiles, a collector switched off
    and a user's own setting of the oldest generation's threshold are left as they are."""
    threshold = gc.get_threshold()
    if not gc.isenabled() or threshold[2] >= _NEVER:
        yield
        return
    gc.set_threshold(threshold[0], threshold[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


# NOTE [no full collections], for whole compiles: the context above covers our backend and each
# compiler it calls, but a Dynamo frame compile also traces before the backend and builds guards after
# it, and that is where the full collections went once the backend deferred its own (at 32 blocks on the
# CPU: two, 0.23 s in the trace and 0.39 s in build_guards, of a 10.6 s compile). From the first
# ``fully_shard`` (or the first time our backend runs), every compile of the process (Dynamo's compile
# callbacks: a frame compile, a lazily compiled backward) runs as the backend does; a compile of another
# backend in the same process too, which is harmless (a full collection only waits for the compile's
# end). What the compile left in the old generation is collected once, at the first full collection
# after it, not once in the trace and once in the guards. The young generations are collected as usual.
_deferred: list[contextlib.ExitStack] = []


def _defer(_args: object = None) -> None:
    if not _deferred:
        stack = contextlib.ExitStack()
        stack.enter_context(no_full_collections())
        _deferred.append(stack)


def _undefer(_args: object = None) -> None:
    while _deferred:
        _deferred.pop().close()


def hold_full_collections_in_compiles() -> None:
    """From now on, every compile of this process runs without full collections (NOTE [no full
    collections], for whole compiles); ``fully_shard`` calls it, so that the first compile's trace is
    covered too, and the backend, in case ``torch._dynamo.reset()`` forgot it since."""
    on_each_compile(_defer, _undefer)


def defer_full_collections_while_compiling() -> None:
    """:func:`hold_full_collections_in_compiles`, and no full collection from now to the end of the
    compile running now."""
    hold_full_collections_in_compiles()
    if in_frame_compile():  # else nothing would end it: a backend called by hand
        _defer()
