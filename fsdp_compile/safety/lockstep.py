"""Lockstep: notice, while compiled graphs run, that ranks run different sequences of them.

NOTE [lockstep]: the agreement check (NOTE [agreement]) compares graphs when they are compiled. Once
every rank has compiled the same graphs, a rank can still *run* a different sequence of them: an
evaluation on rank 0 only (``if rank == 0: model(x)``) runs the inference graph there while rank 1 runs
the training forward, and their collectives pair up wrongly: a hang, a gloo abort or, where the sizes
happen to match, the wrong parameters exchanged. Checking every call would cost a store round trip
per graph; instead a rank *checks in* with its peers (``peers.wait_for``) only when its sequence does
something new:

- a transition between two graphs (previous graph -> this graph) that it has not run before: the first
  steps of training, the first evaluation, a new graph break;
- entering an inference graph from a non-inference one: every evaluation phase (not every batch).

Ranks in lockstep reach these calls together, so their check-ins pair up and they go on; a rank whose
sequence departs waits alone and raises, naming what its peers run instead, before any collective of
the departing graph is issued. In steady training no check-in happens: a dictionary lookup per call.

The check-in is the first node of the compiled graph itself (``fsdp::check_in``, holding the graph's
identity as text: :func:`insert_check_in`), not a wrapper around it, so that a graph loaded from
Inductor's caches on a warm start (NOTE [warm start] in ``cache.py``) checks in exactly as a freshly
compiled one does. Its first call also runs the agreement check (NOTE [agreement]), which a loaded
graph skipped when it was not compiled; on a cold start that check already ran and is not repeated.

And when a collective inside a compiled graph fails (gloo's timeout, a closed connection), the error
gets a note saying what every peer is doing (``peers.describe``), e.g. "rank 0: waiting for its peers
to run an inference graph", so the message names the mistake and not only its symptom
(:func:`note_failures`).
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
    peers.entering(call, graph.describe(), graph.peers)  # until the outermost wrapper returns: _noting
    transition = (prev.key if prev is not None else None, graph.key)
    entering_eval = graph.kind == "inference" and (prev is None or prev.kind != "inference")
    if transition in seq.seen and not entering_eval:
        return
    seq.seen.add(transition)
    _check_in(seq, graph, prev, call)


def _check_in(seq: _Sequence, graph: GraphIdentity, prev: GraphIdentity | None, call: int) -> None:
    seq.check_ins += 1
    after = f"after {prev.describe()}" if prev is not None else "as its first graph"
    what = f"run {graph.describe()} as graph call #{call}, {after}"
    # Ranks in lockstep make the same check-in: its key holds what they run, so a rank that runs
    # something else posts under another key, and the two see each other waiting (peers.wait_for).
    step = hashlib.sha1(json.dumps([call, graph.key, prev.key if prev else None]).encode()).hexdigest()[:12]
    me = dist.get_rank()

    def diverged(rank: int, theirs: peers.Waiting, _their_value: str | None) -> str:
        return (f"fsdp_compile: rank {me} is about to {what}, but rank {rank} waits for its peers to "
                f"{theirs.what}. {_ADVICE}")

    key = f"lockstep/{seq.check_ins}/{step}"
    peers.wait_for(peers.Waiting(key=key, what=what, groups=graph.groups), what, timeout_s=graph.timeout_s,
                   diverged=diverged, timeout_name=graph.timeout_name)


_ADVICE = peers.DIVERGED_ADVICE


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
    cause = (f"A peer waits for a graph this rank did not run. {_ADVICE}" if "waiting for its peers" in doing
             else "A peer found that the ranks diverged (its words above)." if _ADVICE in doing
             else "A peer that failed or is gone is the cause: look at its output.")
    return f"fsdp_compile: a collective of {graph.describe()} failed on rank {me}. Its peers: {doing.rstrip('.')}. {cause}"


_COMMUNICATION_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "pair closure", "socket",
                        "closed by peer", "broken pipe")


def _is_communication_error(error: BaseException) -> bool:
    """A collective failed: a c10d error, or a runtime error whose text says so (gloo raises plain
    RuntimeErrors). Out-of-memory errors are not."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, torch.OutOfMemoryError):
        return False
    text = str(error).lower()
    return any(w in text for w in _COMMUNICATION_WORDS)


def _noted(e: Exception, graph: GraphIdentity | None) -> Exception | None:
    """``e`` with a note naming what every peer does, or a ``RuntimeError`` to raise from it (Python
    3.10); ``None`` when it needs none: not a collective's failure, or noted already."""
    if graph is None or not _is_communication_error(e) or isinstance(e, peers.PeerError):
        return None
    if getattr(e, "_fsdp_compile_noted", False):
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
    """``compiled`` noting a failed collective with what every peer does, naming the graph this process
    last checked in with (the failing one: ``fsdp::check_in`` is its first node).

    Applied to each compiled graph with peers (``boxed``: it takes its inputs as one list), keeping
    what AOTAutograd's cache reads off it (its key in Inductor's graph cache) so that it is still
    saved for a warm start; and to what AOTAutograd returns for a Dynamo graph, since the graphs loaded
    from the caches on a warm start carry no wrapper of their own (NOTE [warm start] in ``cache.py``).
    That wrapper covers their forward, and on its first call their backward too (:func:`_note_backward`)."""
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
    """Make the backward of the autograd function that produced ``outputs`` note a failed collective as
    the forward does. A graph loaded from AOTAutograd's cache runs its backward straight from autograd,
    past every wrapper of ours; autograd looks its ``backward`` up on the function's class at each call,
    so wrapping it there covers every later backward of that graph. Once per class; outputs that come
    from no such function (no grad, inference) leave nothing to do."""
    for t in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        fn = getattr(t, "grad_fn", None)
        cls = getattr(fn, "_forward_cls", None)
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            if not getattr(cls, "_fsdp_compile_notes", False):
                cls.backward = staticmethod(_noting(cls.backward))  # type: ignore[method-assign]
                cls._fsdp_compile_notes = True  # type: ignore[attr-defined]
            return


def _noting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` adding to a failed collective's error what every peer does (:func:`_noted`)."""

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
