"""Read a scheduled graph: a compact listing of its collectives, waits and compute, in order.

``listing(gm, groups={"0": "ag", "1": "rs"})``: one line per launch and wait, and per run of compute::

    0  all_gather      unit 0  ag  all_gather       288 B
    1  all_gather      unit 1  ag  all_gather       288 B
    2  wait            unit 0  ag  all_gather
    3  compute         addmm relu  (9 nodes)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from fsdp_compile.passes.collective_regions import Region, regions
from fsdp_compile.passes.predicates import (
    collective_kind, fsdp_meta, is_collective, is_wait, op_name, tensor_bytes, waited_collective,
)

__all__ = ["Row", "rows", "listing", "in_flight_peaks", "group_labels", "graph_group_labels"]

# Ops that move or relabel data rather than compute: counted in a compute run, not named.
_QUIET = {
    "view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "slice", "select", "alias",
    "split_with_sizes", "split", "getitem", "clone", "cat", "constant_pad_nd", "convert_element_type",
    "_to_copy", "squeeze", "unsqueeze", "as_strided", "scalar_tensor", "detach", "copy", "full", "zeros",
    "empty", "new_zeros",
}


@dataclass(frozen=True)
class Row:
    """One line of a listing: a launch, a wait, or a run of compute nodes."""

    op: str  # collective kind ("all_gather", ...), "wait", "pack", "unpack" or "compute"
    nodes: tuple[fx.Node, ...]
    unit: object = None
    group: str = ""
    stream: str = ""
    bytes: int = 0

    @property
    def detail(self) -> str:
        if self.op != "compute":
            return ""
        names = list(dict.fromkeys(map(_label, self.nodes)))
        return " ".join([name for name in names if name not in _QUIET] or names)  # a run of views: named


def _label(node: fx.Node) -> str:
    """A node's name in a compute run: its op, or ``call <body>`` for an outlined unit's body."""
    if node.target is torch.ops.higher_order.invoke_subgraph and isinstance(node.args[0], fx.Node):
        return "call " + str(node.args[0].target).removeprefix("partitioned_")
    return op_name(node)


def _full_bytes(launch: fx.Node) -> int:
    """Bytes of the full (unsharded) buffer: an all-gather's output, a reduce-scatter's input."""
    wait = next((u for u in launch.users if is_wait(u)), None)
    inp = launch.args[0]
    assert isinstance(inp, fx.Node)
    return max(tensor_bytes(inp), tensor_bytes(wait) if wait is not None else 0)


def rows(gm: fx.GraphModule) -> list[Row]:
    """The schedule of ``gm`` as rows, in graph order; consecutive nodes of one kind merge into one row:
    ``compute``, ``pack`` (a region's prologue) or ``unpack`` (its epilogue)."""
    role: dict[fx.Node, tuple[str, Region]] = {}
    for r in regions(gm):
        role.update({n: ("pack", r) for n in r.prologue})
        role.update({n: ("unpack", r) for n in r.epilogue})
    out: list[Row] = []
    run: list[fx.Node] = []
    run_key: tuple[str, object] | None = None

    def flush() -> None:
        nonlocal run_key
        if run:
            op, region = run_key  # type: ignore[misc]
            unit, group = (None, "") if region is None else (region.unit, region.group)
            out.append(Row(op, tuple(run), unit, group, "compute"))
            run.clear()
        run_key = None

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        meta = fsdp_meta(n)
        if is_collective(n) or is_wait(n):
            flush()
            if is_collective(n):
                out.append(Row(collective_kind(n), (n,), meta.get("unit"), str(n.args[-1]),
                               str(meta.get("stream", "")), _full_bytes(n)))
            else:
                launch = waited_collective(n)
                out.append(Row("wait", (n,), fsdp_meta(launch).get("unit"), str(launch.args[-1]),
                               str(meta.get("waits_on", ""))))
            continue
        op, region = role.get(n, ("compute", None))
        if run_key is not None and (run_key[0] != op or run_key[1] is not region):
            flush()
        run_key = (op, region)
        run.append(n)
    flush()
    return out


def listing(gm: fx.GraphModule, groups: Mapping[str, str] | None = None) -> str:
    """A compact, stable text listing of ``gm``'s schedule; ``groups`` maps process-group names to labels."""
    labels = dict(groups or {})
    lines = []
    for i, r in enumerate(rows(gm)):
        group = labels.get(r.group, r.group)
        if r.op == "compute":
            lines.append(f"{i:<3}{'compute':<16}{r.detail}  ({len(r.nodes)} nodes)".rstrip())
        else:
            unit = f"unit {r.unit}" if r.unit is not None else ""
            size = f"{r.bytes} B" if r.bytes else ""
            stream = "" if r.op in ("pack", "unpack") else r.stream
            lines.append(f"{i:<3}{r.op:<16}{unit:<8}{group:<7}{stream:<16}{size}".rstrip())
    return "\n".join(lines)


def in_flight_peaks(gm: fx.GraphModule) -> dict[str, int]:
    """Peak bytes in flight along ``gm``'s order, as the byte caps count them: all-gather outputs launched
    and not used yet, reduce-scatter inputs launched and not waited yet."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    events: dict[str, list[tuple[int, int]]] = {"all_gather": [], "reduce_scatter": []}
    for r in regions(gm):
        if r.kind == "all_gather" and r.users:
            start, stop, size = index[r.launch], min(index[u] for u in r.users), r.out_bytes
        elif r.kind == "reduce_scatter":
            start, stop, size = index[r.launch], index[r.wait], r.in_bytes
        else:
            continue
        events[r.kind] += [(start, size), (stop, -size)]
    peaks = {}
    for kind, evs in events.items():
        live = peak = 0
        for _, delta in sorted(evs):  # a release before a launch at one index
            live += delta
            peak = max(peak, live)
        peaks[kind] = peak
    return peaks


def group_labels(groups: object) -> dict[str, str]:
    """Labels for an ``FsdpGroups``: ``ag`` and ``rs``, or ``ag+rs`` when they share a communicator, and
    ``rep`` for HSDP's replicate group."""
    ag = groups.all_gather.group_name  # type: ignore[attr-defined]
    rs = groups.reduce_scatter.group_name  # type: ignore[attr-defined]
    labels = {ag: "ag", rs: "rs"} if ag != rs else {ag: "ag+rs"}
    replicate = getattr(groups, "replicate", None)
    if replicate is not None:
        labels[replicate.group_name] = "rep"
    return labels


def graph_group_labels(gm: fx.GraphModule) -> dict[str, str]:
    """The labels of ``group_labels``, read from the group names ``gm``'s collectives recorded."""
    labels: dict[str, str] = {}
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        meta = fsdp_meta(n)
        ag, rs, rep = meta.get("ag_group"), meta.get("rs_group"), meta.get("replicate_group")
        if ag:
            labels[str(ag)] = "ag+rs" if ag == rs else "ag"
        if rs and rs != ag:
            labels[str(rs)] = "rs"
        if rep and rep not in (ag, rs):
            labels[str(rep)] = "rep"
    return labels
