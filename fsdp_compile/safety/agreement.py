"""Cross-rank agreement: refuse to run a graph whose collectives differ between ranks.

NOTE [agreement]: ranks that issue their collectives in different orders deadlock on concurrent
communicators (NOTE [why two communicators]), and a rank-dependent branch in the model does just that. So
each rank posts each compiled graph's collective sequence (kind, group role, dtype, shape, in launch order,
waits included) to the store under a key made from it, and waits until every peer has compiled a graph
with the same sequence, now or earlier: a rank that recompiles for a new activation shape finds the
sequence its peers already posted and goes on at once. The wait is :func:`peers.wait_for`
(NOTE [peers]): ranks that compiled different graphs both raise, naming the first differing collective.
``make_backend(check_agreement=False)`` switches it off.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch.distributed as dist
from torch import fx

from fsdp_compile.passes.predicates import fsdp_meta, is_collective, is_wait, waited_collective

from fsdp_compile.safety import peers as _peers_mod
from fsdp_compile._compat import group_timeout_s, resolve_group

__all__ = ["GraphIdentity", "check_agreement", "fingerprint", "identify"]


def _op(launch: fx.Node) -> str:
    return launch.target.__name__.split(".")[0]  # type: ignore[union-attr]


def fingerprint(gm: fx.GraphModule) -> list[str]:
    """The graph's collectives in order, one line each, groups named by order of first use (``g0``, ...):
    with HSDP, peers use different replicate groups in the same role."""
    out: list[str] = []
    roles: dict[str, str] = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            val = n.args[0].meta.get("val")  # type: ignore[union-attr]
            shape = "x".join(map(str, val.shape)) if val is not None else "?"
            dtype = str(val.dtype).removeprefix("torch.") if val is not None else "?"
            unit = fsdp_meta(n).get("unit")
            role = roles.setdefault(str(n.args[-1]), f"g{len(roles)}")
            out.append(f"{_op(n)}(unit {unit}, group {role}, {dtype}[{shape}])")
        elif is_wait(n):
            launch = waited_collective(n)
            out.append(f"wait({_op(launch)}, unit {fsdp_meta(launch).get('unit')})")
    return out


@dataclass(frozen=True)
class GraphIdentity:
    """What identifies a compiled graph across ranks: its kind and collective sequence, and its peers."""

    kind: str  # "forward", "backward" or "inference"
    collectives: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]  # the ranks of each group the graph's collectives use
    timeout_s: float  # how long to wait for peers
    timeout_set: bool = False  # timeout_s is agreement_timeout_s, not the groups' timeout

    @property
    def timeout_name(self) -> str:
        return "agreement_timeout_s" if self.timeout_set else "the process group's timeout"

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for r in g}))

    @property
    def key(self) -> str:
        """Equal on every rank that compiles a graph of this kind with these collectives."""
        text = json.dumps([self.kind, self.collectives])
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The identity as text, inside the compiled graph (NOTE [lockstep])."""
        return json.dumps({"kind": self.kind, "collectives": list(self.collectives),
                           "groups": [list(g) for g in self.groups], "timeout_s": self.timeout_s,
                           "timeout_set": self.timeout_set})

    @classmethod
    def from_json(cls, text: str) -> GraphIdentity:
        d = json.loads(text)
        return cls(kind=d["kind"], collectives=tuple(d["collectives"]), groups=tuple(tuple(g) for g in d["groups"]),
                   timeout_s=float(d["timeout_s"]), timeout_set=bool(d.get("timeout_set", False)))

    def describe(self) -> str:
        launches = sum(1 for c in self.collectives if not c.startswith("wait("))
        article = "an" if self.kind[0] in "aeiou" else "a"
        return f"{article} {self.kind} graph with {launches} collectives"


def identify(gm: fx.GraphModule, kind: str, timeout_s: float | None = None) -> GraphIdentity | None:
    """The graph's identity, or ``None`` when it needs no peer (no collectives, one rank, no real group)."""
    if not _peers_mod.has_peers():
        return None
    groups: set[tuple[int, ...]] = set()
    timeouts = []
    for n in gm.graph.nodes:
        if is_collective(n):
            group = resolve_group(str(n.args[-1]))
            groups.add(tuple(dist.get_process_group_ranks(group)))
            timeouts.append(group_timeout_s(group))
    if all(len(g) <= 1 for g in groups):
        return None
    return GraphIdentity(kind=kind, collectives=tuple(fingerprint(gm)), groups=tuple(sorted(groups)),
                         timeout_s=timeout_s if timeout_s is not None else max(timeouts),
                         timeout_set=timeout_s is not None)


# Keys every peer has posted (a recompile with the same collectives must not post twice: peers count posts).
_agreed: _peers_mod.PerProcessGroup[set[str]] = _peers_mod.PerProcessGroup(set)


def check_agreement(graph: GraphIdentity) -> None:
    """Wait until every peer compiled a graph with ``graph``'s collectives; raise ``RuntimeError`` if they
    compile different ones, or a peer fails, is gone or never comes (NOTE [agreement])."""
    what = f"compile {graph.describe()} (the same sequence as this rank's)"
    value = json.dumps({"kind": graph.kind, "collectives": list(graph.collectives)})
    me = dist.get_rank()

    def diverged(rank: int, theirs: _peers_mod.Waiting, their_value: str | None) -> str:
        other = json.loads(their_value) if their_value and theirs.key.startswith("agreement/") else None
        if other is None:
            return (f"fsdp_compile: rank {me} compiled {graph.describe()} that rank {rank} never compiled, and "
                    f"rank {rank} waits for its peers to {theirs.what}: the ranks run different code. Make "
                    "the model's control flow identical on every rank.")
        return _difference(me, graph.kind, list(graph.collectives), rank, other["kind"], other["collectives"])

    key = f"agreement/{graph.key}"
    agreed = _agreed.get()
    if key in agreed:
        return
    waiting = _peers_mod.Waiting(key=key, what=what, groups=graph.groups)
    _peers_mod.wait_for(waiting, value, timeout_s=graph.timeout_s, diverged=diverged, timeout_name=graph.timeout_name)
    agreed.add(key)


def _difference(me: int, kind: str, mine: list[str], rank: int, their_kind: str, theirs: list[str]) -> str:
    (a, a_kind, a_seq), (b, b_kind, b_seq) = sorted([(me, kind, mine), (rank, their_kind, theirs)])
    i = next((i for i, (x, y) in enumerate(zip(a_seq, b_seq)) if x != y), min(len(a_seq), len(b_seq)))
    a_at = a_seq[i] if i < len(a_seq) else "(no more collectives)"
    b_at = b_seq[i] if i < len(b_seq) else "(no more collectives)"
    return (f"fsdp_compile: a compiled graph differs across ranks, so its collectives would deadlock. First "
            f"difference at collective #{i}: rank {a} ({a_kind} graph) issues {a_at}; rank {b} ({b_kind} graph) "
            f"issues {b_at}. (Seen on rank {me}.) Make the model's control flow and parameters identical on "
            "every rank.")
