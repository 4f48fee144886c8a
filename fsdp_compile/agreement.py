"""Cross-rank agreement: refuse to run a graph whose collective schedule differs between ranks.

NOTE [agreement]: concurrent communicators deadlock when ranks issue their collectives in different
orders (see NOTE [why two communicators]); a rank-dependent branch in the model makes exactly that.
So when a graph is compiled, each rank writes the sequence of its collectives (kind, group, dtype,
shape, in launch order, waits included) to the process group's key-value store, reads its peers'
(the ranks of the groups the graph uses), and compares them, before any collective of that graph
runs. A mismatch raises ``RuntimeError`` on every rank naming the first differing collective on each;
a peer that never compiles the graph (a rank-dependent graph break) raises after ``timeout_s``. The
cost is one small store write and read per compiled graph; ``make_backend(check_agreement=False)``
switches it off.
"""

from __future__ import annotations

import datetime
import itertools
import json

import torch.distributed as dist
from torch import fx

from passes.predicates import fsdp_meta, is_collective, is_wait, waited_collective

from ._compat import default_store, resolve_group

__all__ = ["fingerprint", "check_agreement"]

_sequence = itertools.count()


def fingerprint(gm: fx.GraphModule) -> list[str]:
    """The graph's collectives in order, one readable line each (what every rank must agree on).

    Groups are named by order of first use (``g0``, ``g1``, ...): with HSDP, peers use different
    replicate groups of the same role, and what must match is which role each collective uses.
    """
    out = []
    roles: dict[str, str] = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            val = n.args[0].meta.get("val")  # type: ignore[union-attr]
            shape = "x".join(map(str, val.shape)) if val is not None else "?"
            dtype = str(val.dtype).removeprefix("torch.") if val is not None else "?"
            unit = fsdp_meta(n).get("unit")
            role = roles.setdefault(str(n.args[-1]), f"g{len(roles)}")
            out.append(f"{n.target.__name__.split('.')[0]}(unit {unit}, group {role}, {dtype}[{shape}])")  # type: ignore[union-attr]
        elif is_wait(n):
            launch = waited_collective(n)
            out.append(f"wait({launch.target.__name__.split('.')[0]}, unit {fsdp_meta(launch).get('unit')})")  # type: ignore[union-attr]
    return out


def _peers(gm: fx.GraphModule) -> list[int]:
    ranks: set[int] = set()
    for n in gm.graph.nodes:
        if is_collective(n):
            group = resolve_group(str(n.args[-1]))
            ranks.update(dist.get_process_group_ranks(group))
    return sorted(ranks)


def check_agreement(gm: fx.GraphModule, kind: str, *, timeout_s: float = 300.0) -> None:
    """Compare ``gm``'s collective sequence with every peer rank's; raise ``RuntimeError`` if any differ."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return  # nobody to compare with (a fake process group stands for one rank)
    peers = _peers(gm)
    seq = next(_sequence)  # every rank compiles its graphs in the same order, or it times out below
    if len(peers) <= 1:
        return
    me = dist.get_rank()
    store = default_store()
    key = f"fsdp_compile/agreement/{seq}"
    mine = fingerprint(gm)
    store.set(f"{key}/{me}", json.dumps({"kind": kind, "collectives": mine}))
    wanted = [f"{key}/{r}" for r in peers]
    try:
        store.wait(wanted, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the store's timeout error type varies by version
        missing = [r for r in peers if not store.check([f"{key}/{r}"])]
        raise RuntimeError(
            f"fsdp_compile: rank {me} compiled its {kind} graph #{seq}, but ranks {missing} did not within "
            f"{timeout_s:.0f}s: the ranks compile different graphs (a rank-dependent graph break or "
            "branch?). Make the model's control flow identical on every rank."
        ) from e
    theirs = {r: json.loads(store.get(f"{key}/{r}")) for r in peers}
    _compare(me, seq, {r: (t["kind"], t["collectives"]) for r, t in theirs.items()})


def _compare(me: int, seq: int, graphs: dict[int, tuple[str, list[str]]]) -> None:
    reference_rank = min(graphs)
    ref_kind, ref = graphs[reference_rank]
    for rank, (kind, coll) in sorted(graphs.items()):
        if (kind, coll) == (ref_kind, ref):
            continue
        i = next((i for i, (a, b) in enumerate(zip(ref, coll)) if a != b), min(len(ref), len(coll)))
        ref_at = ref[i] if i < len(ref) else "(no more collectives)"
        got_at = coll[i] if i < len(coll) else "(no more collectives)"
        raise RuntimeError(
            f"fsdp_compile: compiled graph #{seq} differs across ranks, so its collectives would deadlock. "
            f"First difference at collective #{i}: rank {reference_rank} ({ref_kind} graph) issues {ref_at}; "
            f"rank {rank} ({kind} graph) issues {got_at}. (Seen on rank {me}.) Make the model's control "
            "flow and shapes identical on every rank."
        )
