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

And when a collective inside a compiled graph fails (gloo's timeout, a closed connection), the error
gets a note saying what every peer is doing (``peers.describe``), e.g. "rank 0: waiting for its peers
to run an inference graph", so the message names the mistake and not only its symptom.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import peers
from .agreement import GraphIdentity

__all__ = ["guard"]


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
                   diverged=diverged)


_ADVICE = peers.DIVERGED_ADVICE


def _failure_note(error: BaseException, graph: GraphIdentity) -> str:
    me = dist.get_rank()
    first = str(error).splitlines()[0] if str(error) else ""
    peers.note_failure(f"{peers.COLLECTIVE_FAILED} {graph.describe()} ({type(error).__name__}: {first})")
    doing = peers.describe_all(graph.peers)
    cause = (f"A peer waits for a graph this rank did not run. {_ADVICE}" if "waiting for its peers" in doing
             else "A peer that failed or is gone is the cause: look at its output.")
    return f"fsdp_compile: a collective of {graph.describe()} failed on rank {me}. Its peers: {doing}. {cause}"


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


def guard(compiled: Callable[[list[Any]], Any], graph: GraphIdentity) -> Callable[[list[Any]], Any]:
    """``compiled`` (a boxed graph callable) with the lockstep check-ins and failure notes."""

    def run(args: list[Any]) -> Any:
        _before_call(graph)
        try:
            return compiled(args)
        except Exception as e:
            if not _is_communication_error(e) or isinstance(e, peers.PeerError):
                raise
            note = _failure_note(e, graph)
            if not hasattr(e, "add_note"):  # Python 3.10
                raise RuntimeError(note) from e
            e.add_note(note)  # the error keeps its type: callers may catch DistBackendError
            raise

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
