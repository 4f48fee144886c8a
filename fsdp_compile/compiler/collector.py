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
    """NOTE [no full collections]: a compile makes many objects that live until it ends, so Python's
    collector promotes them and often runs full collections, each walking every object the process
    holds. While our backend compiles, only the young generations are collected; the old one waits for
    the first full collection after it. Nested compiles, a collector switched off and a user's own
    oldest-generation threshold are left as they are; other backends' compiles are never touched.
    Dynamo builds guards after the backend returns, so the backend also defers full collections to the
    end of the frame compile (:func:`defer_full_collections_while_compiling`)."""
    threshold = gc.get_threshold()
    if not gc.isenabled() or threshold[2] >= _NEVER:
        yield
        return
    gc.set_threshold(threshold[0], threshold[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


_deferred: list[contextlib.ExitStack] = []


def _undefer(_args: object = None) -> None:
    while _deferred:
        _deferred.pop().close()


def _nothing(_args: object = None) -> None:
    """Dynamo's compile callbacks come in pairs; ours acts only at the end (:func:`_undefer`)."""


def defer_full_collections_while_compiling() -> None:
    """No full collection from now to the end of the Dynamo compile running now; nothing outside one,
    as nothing would end the deferral."""
    on_each_compile(_nothing, _undefer)  # again after a torch.compiler.reset() forgot it
    if in_frame_compile() and not _deferred:
        stack = contextlib.ExitStack()
        stack.enter_context(no_full_collections())
        _deferred.append(stack)
