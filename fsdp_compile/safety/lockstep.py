"""Lockstep: notice, while compiled graphs run, that ranks run different sequences of them.

NOTE [lockstep]: ranks that compiled the same graphs (NOTE [agreement]) can still *run* different sequences
of them (``if rank == 0: model(x)`` runs the inference graph on rank 0 only), and their collectives pair up
wrongly: a hang, an abort, or the wrong parameters exchanged. Checking every call would cost a store round
trip, so a rank *checks in* with its peers (``peers.wait_for``) only when its sequence does something new:
a transition between two graphs not run before, or entering an inference graph from another kind (each
evaluation phase). Ranks in lockstep check in together and go on; a rank whose sequence departs raises
before any collective of the departing graph, naming what its peers run instead.

The check-in is the compiled graph's first node (``fsdp::check_in``, holding the graph's identity), so a
graph loaded from Inductor's caches (NOTE [warm start] in ``cache.py``) checks in as a fresh one does; its
first call also runs the agreement check, which a loaded graph skipped. And when a collective inside a
compiled graph fails, :func:`note_failures` adds to the error what every peer is doing.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from fsdp_compile.safety import peers
from fsdp_compile.safety.agreement import GraphIdentity, check_agreement

__all__ = ["insert_check_in", "note_failures"]


@dataclass
class _Sequence:
    """This process's calls of compiled graphs that have peers."""

    last: GraphIdentity | None = None
    seen: set[tuple[str | None, str]] = field(default_factory=set)
    calls: int = 0
    check_ins: int = 0


_state: peers.PerProcessGroup[_Sequence] = peers.PerProcessGroup(_Sequence)


def _before_call(graph: GraphIdentity) -> None:
    seq = _state.get()
    prev, seq.last = seq.last, graph
    seq.calls += 1
    call = seq.calls
    peers.entering(call, graph.describe(), graph.peers)  # until the outermost _noting wrapper returns
    transition = (prev.key if prev is not None else None, graph.key)
    entering_eval = graph.kind == "inference" and (prev is None or prev.kind != "inference")
    if transition in seq.seen and not entering_eval:
        return
    seq.seen.add(transition)
    seq.check_ins += 1
    after = f"after {prev.describe()}" if prev is not None else "as its first graph"
    what = f"run {graph.describe()} as graph call #{call}, {after}"
    # The key holds what the rank runs: ranks that run different things see each other wait under other keys.
    step = hashlib.sha1(json.dumps([call, graph.key, prev.key if prev else None]).encode()).hexdigest()[:12]
    me = dist.get_rank()

    def diverged(rank: int, theirs: peers.Waiting, _their_value: str | None) -> str:
        return (f"fsdp_compile: rank {me} is about to {what}, but rank {rank} waits for its peers to "
                f"{theirs.what}. {peers.DIVERGED_ADVICE}")

    key = f"lockstep/{seq.check_ins}/{step}"
    peers.wait_for(peers.Waiting(key=key, what=what, groups=graph.groups), what, timeout_s=graph.timeout_s,
                   diverged=diverged, timeout_name=graph.timeout_name)


@torch.library.custom_op("fsdp::check_in", mutates_args=())
def check_in(identity: str) -> None:
    """The first node of a compiled graph that has peers: agreement once, then the lockstep check-in."""
    graph = _identity(identity)
    check_agreement(graph)  # a no-op once agreed (at compile time on a cold start)
    _before_call(graph)


@check_in.register_fake
def _check_in_fake(identity: str) -> None:
    return None


fx.node.has_side_effect(torch.ops.fsdp.check_in.default)


@functools.lru_cache(maxsize=None)
def _identity(text: str) -> GraphIdentity:
    return GraphIdentity.from_json(text)


def insert_check_in(gm: fx.GraphModule, graph: GraphIdentity) -> fx.GraphModule:
    """``gm`` with ``fsdp::check_in(graph)`` as its first node (after the inputs), before any collective."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    where = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before(None)
    with where:
        node = gm.graph.call_function(torch.ops.fsdp.check_in.default, (graph.to_json(),))
    node.meta["val"] = None
    gm.recompile()
    return gm


def _failure_note(error: BaseException, graph: GraphIdentity) -> str:
    me = dist.get_rank()
    first = str(error).splitlines()[0] if str(error) else ""
    peers.note_failure(f"{peers.COLLECTIVE_FAILED} {graph.describe()} ({type(error).__name__}: {first})")
    doing = peers.describe_all(graph.peers)
    advice = peers.DIVERGED_ADVICE
    cause = (f"A peer waits for a graph this rank did not run. {advice}" if "waiting for its peers" in doing
             else "A peer found that the ranks diverged (its words above)." if advice in doing
             else "A peer that failed or is gone is the cause: look at its output.")
    return (f"fsdp_compile: a collective of {graph.describe()} failed on rank {me}. "
            f"Its peers: {doing.rstrip('.')}. {cause}")


_COMMUNICATION_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "pair closure", "socket",
                        "closed by peer", "broken pipe")


def _is_communication_error(error: BaseException) -> bool:
    """A c10d error, or a runtime error (not out-of-memory) whose text names communication (gloo's)."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, torch.OutOfMemoryError):
        return False
    text = str(error).lower()
    return any(w in text for w in _COMMUNICATION_WORDS)


def _noted(e: Exception, graph: GraphIdentity | None) -> Exception | None:
    """Add to ``e`` a note naming what every peer does; return a ``RuntimeError`` to raise instead on Python
    3.10, else ``None``."""
    if (graph is None or not _is_communication_error(e) or isinstance(e, peers.PeerError)
            or getattr(e, "_fsdp_compile_noted", False)):
        return None
    note = _failure_note(e, graph)
    if not hasattr(e, "add_note"):  # Python 3.10
        replacement = RuntimeError(note)
        replacement._fsdp_compile_noted = True  # type: ignore[attr-defined]
        return replacement
    e.add_note(note)  # the error keeps its type: callers may catch DistBackendError
    e._fsdp_compile_noted = True  # type: ignore[attr-defined]
    return None


def note_failures(compiled: Callable[..., Any], *, boxed: bool = False) -> Callable[..., Any]:
    """``compiled`` adding to a failed collective's error what every peer does.

    Applied to each compiled graph with peers (``boxed``: it takes its inputs as one list; the wrapper keeps
    its Inductor cache key so it is still saved), and to what AOTAutograd returns for a Dynamo graph, which
    covers graphs loaded from the caches (NOTE [warm start] in ``cache.py``): their forward, and from its
    first call their backward (:func:`_note_backward`)."""
    first = [not boxed]
    call = _noting(compiled)

    def run(*args: Any) -> Any:
        out = call(*args)
        if first[0]:
            first[0] = False
            _note_backward(out)
        return out

    if boxed:
        run._boxed_call = True  # type: ignore[attr-defined]
        for attr in ("_fx_graph_cache_key", "_fx_graph_cache_debug_lines"):
            if hasattr(compiled, attr):
                setattr(run, attr, getattr(compiled, attr))
    else:
        functools.update_wrapper(run, compiled)
    return run


def _note_backward(outputs: Any) -> None:
    """Wrap ``backward`` on the class of the autograd function that produced ``outputs`` (once per class): a
    graph loaded from AOTAutograd's cache runs its backward straight from autograd, past our wrappers."""
    for t in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        fn = getattr(t, "grad_fn", None)
        cls = getattr(fn, "_forward_cls", None)
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            if not getattr(cls, "_fsdp_compile_notes", False):
                cls.backward = staticmethod(_noting(cls.backward))  # type: ignore[method-assign]
                cls._fsdp_compile_notes = True  # type: ignore[attr-defined]
            return


def _noting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` adding to a failed collective's error what every peer does."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        _depth[0] += 1
        try:
            return fn(*args)
        except Exception as e:
            replacement = _noted(e, _state.get().last)
            if replacement is not None:
                raise replacement from e
            raise
        finally:
            _depth[0] -= 1
            if _depth[0] == 0:
                peers.leaving()

    return run


_depth = [0]  # how many of our wrappers of compiled graphs this process is inside (nested, or a backward)
