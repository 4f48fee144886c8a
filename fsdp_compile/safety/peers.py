"""Peers: a wait on other ranks that tells a failed rank from a slow one and from a diverged one.

NOTE [peers]: the cross-rank checks (``agreement.py``, ``lockstep.py``) wait for other ranks through the
default process group's store, and must tell a slow peer from a dead or a diverged one:

- From ``FsdpGroups.create()`` on, each rank's heartbeat thread bumps ``alive/<rank>`` every second on a
  store connection of its own; a heartbeat still for ``STALE_S`` means the peer is gone. A rank that fails
  or exits says so (``failed/<rank>``, ``exited/<rank>``).
- A waiting rank publishes what it waits for (``waiting/<rank>``): two ranks each waiting for a key the
  other never posts have diverged.
- The heartbeat tells which graph call the rank is inside (:func:`entering`): a peer inside one whose
  collectives need this rank, for ``STUCK_S`` while this rank waits in a check, is blocked in a collective
  this rank will not join.
- A failing store call means the store's host is gone.

The heartbeat thread, our ``sys.excepthook`` and our ``atexit`` function live from the first
``FsdpGroups.create()`` to the last ``destroy()`` on a process group with peers.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch.distributed as dist

from fsdp_compile._compat import default_store, store_connection
from fsdp_compile.safety.liveness import NS as _NS
from fsdp_compile.safety.liveness import (
    STALE_S, STUCK_S, Liveness, entering, hear, heard, inside_now, inside_of, leaving,
)

__all__ = [
    "COLLECTIVE_FAILED", "DIVERGED_ADVICE", "HEARTBEAT_S", "STALE_S", "STUCK_S", "PerProcessGroup", "PeerError",
    "Waiting", "describe", "describe_all", "entering", "group_id", "leaving", "note_failure", "release", "start",
    "wait_for",
]

HEARTBEAT_S = 1.0
QUIET_S = 1.0  # waiting this long, look at each missing peer (then every LOOK_S)
LOOK_S = 1.0
LINGER_S = 10.0
T = TypeVar("T")
COLLECTIVE_FAILED = "a collective failed in"
DIVERGED_ADVICE = (
    "The ranks run different sequences of compiled graphs: a forward or an evaluation on some ranks only "
    "(e.g. `if rank == 0: model(x)`), or a rank-dependent graph break? Every rank must call the model the "
    "same number of times, in the same order: evaluate on every rank and all-reduce the metric."
)


class PerProcessGroup(Generic[T]):
    """State that lives as long as the default process group: :meth:`get` starts afresh from ``factory``
    after a new ``init_process_group``."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._world: weakref.ref | None = None
        self._value: T | None = None

    def get(self) -> T:
        world = dist.group.WORLD
        if self._world is None or self._world() is not world:
            self._world, self._value = weakref.ref(world), self._factory()
        return self._value  # type: ignore[return-value]


class PeerError(RuntimeError):
    """A peer rank failed, is gone, diverged or did not come in time (the message says which)."""


@dataclass
class _Heartbeat:
    world: weakref.ref
    rank: int
    stop: threading.Event = field(default_factory=threading.Event)
    lost: str | None = None  # why the heartbeat could not write to the store any more


_heartbeat: _Heartbeat | None = None
_users = 0  # FsdpGroups alive in this process
_hooks_on = False  # our sys.excepthook reports and our atexit function is registered
_chained = False  # ours is in the chain of sys.excepthook
_previous_hook: Callable[..., object] = sys.__excepthook__  # the sys.excepthook ours replaced


# Backends on which this process is the only real rank (a fake group, the emulated world).
SOLO_BACKENDS = ("fake", "emulated")


def has_peers() -> bool:
    """Whether other processes share this default process group (and so its store)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() not in SOLO_BACKENDS


def start() -> None:
    """Start this rank's heartbeat (once per default process group, each call matched by a :func:`release`)."""
    global _heartbeat, _users
    if not has_peers():
        return
    _users += 1
    world = dist.group.WORLD
    if _heartbeat is not None and _heartbeat.world() is world and not _heartbeat.stop.is_set():
        return
    if _heartbeat is not None:
        _heartbeat.stop.set()
    beat = _Heartbeat(world=weakref.ref(world), rank=dist.get_rank())
    conn = store_connection(default_store())
    threading.Thread(target=_beat, args=(beat, conn), name="fsdp_compile-heartbeat", daemon=True).start()
    _heartbeat = beat
    _install_hooks()


def release() -> None:
    """Undo one :func:`start`; the heartbeat stops with the last."""
    global _users
    _users = max(0, _users - 1)
    if _users == 0:
        if _heartbeat is not None:
            _heartbeat.stop.set()
        _remove_hooks()


def _beat(beat: _Heartbeat, conn: dist.Store) -> None:
    n, last_call = 0, None
    while not beat.stop.is_set():
        if beat.world() is None or not dist.is_initialized():  # the store is gone with the group
            return
        try:
            inside = inside_now()
            conn.set(f"{_NS}alive/{beat.rank}", json.dumps({"n": n, "inside": inside}))
            call = inside["call"] if inside is not None else None
            if call is not None and call == last_call and conn.check([f"{_NS}failed/any"]):
                hear(conn, beat.rank)  # NOTE [heard failures]
            last_call = call
        except RuntimeError as e:  # the store's host is gone
            beat.lost = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return
        n += 1
        if beat.stop.wait(HEARTBEAT_S):
            return


def _excepthook(kind: type[BaseException], value: BaseException, tb: object) -> None:
    """Tell the peers (while installed), then run the hook ours replaced."""
    if _hooks_on:
        note_failure(f"{kind.__name__}: {value}")
    _previous_hook(kind, value, tb)


def _exited() -> None:
    _note("exited", "exited")


def _install_hooks() -> None:
    """Say ``failed`` on an uncaught exception and ``exited`` at exit (NOTE [peers])."""
    global _hooks_on, _chained, _previous_hook
    if _hooks_on:
        return
    _hooks_on = True
    if not _chained:
        _previous_hook, sys.excepthook, _chained = sys.excepthook, _excepthook, True
    atexit.register(_exited)


def _remove_hooks() -> None:
    """Undo :func:`_install_hooks` (where another hook replaced ours since, ours only passes exceptions on)."""
    global _hooks_on, _chained
    if not _hooks_on:
        return
    _hooks_on = False
    if sys.excepthook is _excepthook:
        sys.excepthook, _chained = _previous_hook, False
    atexit.unregister(_exited)


def _note(kind: str, text: str) -> None:
    if _heartbeat is None or not has_peers():
        return
    try:
        default_store().set(f"{_NS}{kind}/{_heartbeat.rank}", text)
        if kind == "failed":
            default_store().set(f"{_NS}failed/any", f"{_heartbeat.rank}|{text}")
    except RuntimeError:
        pass  # the store is gone too: peers notice the silence


def note_failure(text: str) -> None:
    """Tell peers this rank failed (the first line of the first failure), so their waits end at once."""
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    if not _failures:  # the first failure is the cause
        _failures.append(first[:2000])
    _note("failed", _failures[0])


_failures: list[str] = []


@dataclass(frozen=True)
class Waiting:
    """What a rank waits for: a store key every member of each group posts under."""

    key: str
    what: str  # for messages: "compile a forward graph with 9 collectives"
    groups: tuple[tuple[int, ...], ...]

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for r in g}))


def group_id(ranks: tuple[int, ...]) -> str:
    """A short name for a set of ranks, equal on every member."""
    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]


def _waiting_of(store: dist.Store, rank: int) -> Waiting | None:
    key = f"{_NS}waiting/{rank}"
    raw = store.get(key).decode() if store.check([key]) else ""
    if not raw:
        return None
    d = json.loads(raw)
    return Waiting(key=d["key"], what=d["what"], groups=tuple(tuple(g) for g in d["groups"]))


def wait_for(waiting: Waiting, value: str, *, timeout_s: float, diverged: Callable[[int, Waiting, str | None], str],
             timeout_name: str = "the process group's timeout") -> None:
    """Post ``value`` under ``waiting.key``; return once every member of ``waiting.groups`` has posted too.

    Raises :class:`PeerError` when a peer or the store is gone, after ``timeout_s`` when a peer is alive but
    has not posted, after ``STUCK_S`` when a peer is blocked in a graph call that needs this rank, and when a
    peer waits for a key this rank never posted (message: ``diverged(rank, their Waiting, their value)``).
    """
    me = dist.get_rank()
    store = default_store()
    mine = [g for g in waiting.groups if me in g and len(g) > 1]
    try:
        store.set(f"{_NS}{waiting.key}/{me}", value)
        if not mine:
            return
        for g in mine:
            store.add(f"{_NS}{waiting.key}/arrived/{group_id(g)}", 1)
        store.set(f"{_NS}waiting/{me}", json.dumps({"key": waiting.key, "what": waiting.what,
                                                    "groups": [list(g) for g in waiting.groups]}))
        try:
            _wait(store, mine, me, waiting, timeout_s, diverged, timeout_name)
        finally:
            store.set(f"{_NS}waiting/{me}", "")
    except PeerError as e:
        note_failure(str(e))
        raise
    except RuntimeError as e:  # a store call failed: its host is gone
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PeerError(f"fsdp_compile: rank {me} lost the connection to the process group's store while waiting "
                        f"for its peers to {waiting.what} ({first}). The store lives on rank 0 (or in torchrun's "
                        "agent): rank 0 is most likely gone (it raised, exited or was killed); its own output says "
                        "why.") from e


def _wait(store: dist.Store, groups: list[tuple[int, ...]], me: int, waiting: Waiting, timeout_s: float,
          diverged: Callable[[int, Waiting, str | None], str], timeout_name: str) -> None:
    start = time.monotonic()
    live = Liveness(store, start)
    counters = [(f"{_NS}{waiting.key}/arrived/{group_id(g)}", len(g)) for g in groups]
    pause, next_look = 0.002, start + QUIET_S
    while True:
        if all(store.add(key, 0) >= size for key, size in counters):
            return
        if _heartbeat is not None and _heartbeat.lost is not None:
            raise RuntimeError(_heartbeat.lost)
        now = time.monotonic()
        if now >= next_look:
            _look_at_peers(store, me, waiting, live, timeout_s, diverged, timeout_name)
            next_look = now + LOOK_S
        time.sleep(pause)
        pause = min(pause * 1.5, 0.25)


def _look_at_peers(store: dist.Store, me: int, waiting: Waiting, live: Liveness, timeout_s: float,
                   diverged: Callable[[int, Waiting, str | None], str], timeout_name: str) -> None:
    """Who has not posted, and why: gone, waiting for something else (diverged), or too slow."""
    missing = [p for p in waiting.peers if p != me and not store.check([f"{_NS}{waiting.key}/{p}"])]
    for p in missing:
        gone = live.why_gone(p)
        if gone is not None:
            cause = (f"rank {p} was running other graphs than this rank. {DIVERGED_ADVICE}"
                     if COLLECTIVE_FAILED in gone else f"look at rank {p}'s own output for the cause.")
            raise PeerError(f"fsdp_compile: rank {me} waits for its peers to {waiting.what}, but rank {p} {gone}: "
                            f"{cause} This rank stops too.")
        theirs = _waiting_of(store, p)
        if theirs is not None and theirs.key != waiting.key and me in theirs.peers \
                and not store.check([f"{_NS}{theirs.key}/{me}"]):
            their_value = store.get(f"{_NS}{theirs.key}/{p}").decode() if store.check(
                [f"{_NS}{theirs.key}/{p}"]) else None
            raise PeerError(diverged(p, theirs, their_value))
        stuck = live.stuck(p, me) if theirs is None else None
        if stuck is not None:
            message = (f"fsdp_compile: rank {me} waits for its peers to {waiting.what}, but rank {p} has been inside "
                       f"{stuck}: blocked in a collective that needs this rank, which will not join it. "
                       f"{DIVERGED_ADVICE}")
            note_failure(message)
            end = time.monotonic() + LINGER_S  # until the peer heard it (NOTE [heard failures])
            while time.monotonic() < end and not store.check([f"{_NS}heard/{p}"]):
                time.sleep(0.1)
            raise PeerError(message)
    waited = time.monotonic() - live.start
    if missing and waited > timeout_s:
        doing = "; ".join(f"rank {p}: {describe(p)}" for p in missing)
        message = (f"fsdp_compile: rank {me} waited {waited:.0f} s ({timeout_name}) for ranks "
                   f"{missing} to {waiting.what}; they are alive but did not ({doing}). {DIVERGED_ADVICE}")
        note_failure(message)
        _linger(store, missing, live)
        raise PeerError(message)


def _linger(store: dist.Store, absent: list[int], live: Liveness) -> None:
    """Give the absent peers up to ``LINGER_S`` to fail and read this rank's note before it raises (and maybe
    takes the store down)."""
    end = time.monotonic() + LINGER_S
    while time.monotonic() < end and not all(live.why_gone(p) is not None for p in absent):
        time.sleep(0.1)


def describe(rank: int) -> str:
    """What ``rank`` is doing, as far as the store knows (for error messages; never raises)."""
    try:
        store = default_store()
        for kind in ("failed", "exited"):
            if store.check([f"{_NS}{kind}/{rank}"]):
                return f"{kind}: {store.get(f'{_NS}{kind}/{rank}').decode()}" if kind == "failed" else "exited"
        theirs = _waiting_of(store, rank)
        if theirs is not None:
            return f"waiting for its peers to {theirs.what}"
        inside = inside_of(store.get(f"{_NS}alive/{rank}")) if store.check([f"{_NS}alive/{rank}"]) else None
        if inside is not None:
            return f"inside graph call #{inside['call']}, {inside['what']}"
        return "running (not in an fsdp_compile check)"
    except RuntimeError as e:
        if rank in heard:
            return f"failed: {heard[rank]}"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"unknown: the store is unreachable ({first}), so rank 0 is most likely gone"


def describe_all(peers: Sequence[int]) -> str:
    """One line per peer other than this rank (see :func:`describe`)."""
    me = dist.get_rank()
    return "; ".join(f"rank {p}: {describe(p)}" for p in peers if p != me)
