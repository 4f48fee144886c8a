"""Liveness: what a peer's heartbeat says (alive, inside which graph call) and the failures heard
(for ``peers.py``, NOTE [peers])."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["NS", "STALE_S", "STUCK_S", "Liveness", "entering", "hear", "heard", "inside_now", "inside_of", "leaving"]

NS = "fsdp_compile/"
STALE_S = 10.0  # a heartbeat this old means the rank is gone
STUCK_S = 20.0  # a peer inside one graph call this long, while this rank waits in a check, is blocked
_inside: dict | None = None  # the graph call this process is inside (what the heartbeat tells)

# NOTE [heard failures]: a rank blocked in a graph call learns of a peer's failure only when the peer's
# process exits, and if that peer hosted the store, the store is gone by then. So while this process sits
# in one graph call, its heartbeat keeps ``failed/any`` (the last failure announced) here, for
# ``peers.describe`` once the store is gone; a rank that raises because a peer is blocked waits up to
# ``LINGER_S`` for ``heard/<peer>``.
heard: dict[int, str] = {}


def inside_now() -> dict | None:
    """The graph call this process is inside (:func:`entering`), or ``None``."""
    return _inside


def entering(call: int, what: str, peers: Sequence[int]) -> None:
    """This process starts graph call ``call`` whose collectives need ``peers`` (until :func:`leaving`)."""
    global _inside
    _inside = {"call": call, "what": what, "peers": list(peers)}


def leaving() -> None:
    """This process is inside no compiled graph call any more."""
    global _inside
    _inside = None


def hear(conn: dist.Store, me: int) -> None:
    """Keep the failure a peer announced (``failed/any``: NOTE [heard failures]), and say so."""
    rank, _, text = conn.get(f"{NS}failed/any").decode().partition("|")
    if int(rank) != me and int(rank) not in heard:
        heard[int(rank)] = text
        conn.set(f"{NS}heard/{me}", rank)


class Liveness:
    """Watches peers' heartbeats while one wait lasts."""

    def __init__(self, store: dist.Store, start: float) -> None:
        self.store = store
        self.start = start
        self.seen: dict[int, tuple[bytes, float]] = {}
        self.inside: dict[int, tuple[int, float]] = {}  # rank -> (graph call it is inside, seen since)

    def why_gone(self, rank: int) -> str | None:
        s = self.store
        if s.check([f"{NS}failed/{rank}"]):
            return f"failed ({s.get(f'{NS}failed/{rank}').decode()})"
        if s.check([f"{NS}exited/{rank}"]):
            return "exited"
        now = time.monotonic()
        if not s.check([f"{NS}alive/{rank}"]):
            if now - self.start > STALE_S:
                return (f"showed no sign of life for {now - self.start:.0f} s (no heartbeat: it failed or "
                        "exited before FsdpGroups.create(), or runs other code)")
            return None
        value = s.get(f"{NS}alive/{rank}")
        inside = inside_of(value)
        if inside is None:
            self.inside.pop(rank, None)
        elif rank not in self.inside or self.inside[rank][0] != inside["call"]:
            self.inside[rank] = (inside["call"], now)
        last = self.seen.get(rank)
        if last is None or last[0] != value:
            self.seen[rank] = (value, now)
            return None
        if now - last[1] > STALE_S:
            return f"stopped: no heartbeat for {now - last[1]:.0f} s (it raised, exited or was killed)"
        return None

    def stuck(self, rank: int, me: int) -> str | None:
        """The graph call ``rank`` has been inside for ``STUCK_S`` or more, if it needs ``me`` (as
        :meth:`why_gone` last read it)."""
        if rank not in self.inside or time.monotonic() - self.inside[rank][1] < STUCK_S:
            return None
        inside = inside_of(self.seen[rank][0]) if rank in self.seen else None
        if inside is None or inside["call"] != self.inside[rank][0] or me not in inside["peers"]:
            return None
        return f"graph call #{inside['call']}, {inside['what']}, for {time.monotonic() - self.inside[rank][1]:.0f} s"


def inside_of(value: bytes) -> dict | None:
    try:
        return json.loads(value).get("inside")
    except (ValueError, AttributeError):
        return None
