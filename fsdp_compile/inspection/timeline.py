"""Simulate a scheduled graph on a ``Hardware`` model: when each node runs, on which stream.

Following NOTE [streams], one compute stream runs compute, copies and waits in graph order; each launch
is issued when the compute stream reaches it and runs on its stream, a serial queue; collectives on
different streams share the links (NOTE [collective time]); a wait blocks the compute stream until its
collective ends::

    tl = simulate(graphs["backward"], load_hardware("h200"))
    print(table(gm, tl, labels))    # the schedule listing with estimated start/end times
    json.dump(chrome_trace({"backward": tl}), f)    # open in Perfetto / chrome://tracing
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx

from fsdp_compile.passes.predicates import collective_kind, is_collective, is_wait, op_name, waited_collective

from fsdp_compile.inspection.cost import collective_bytes, graph_world, launch_seconds
from fsdp_compile.inspection.fusion import graph_seconds
from fsdp_compile.inspection.hardware import Hardware
from fsdp_compile.inspection.schedule import Row, graph_group_labels, in_flight_peaks, rows
from fsdp_compile.inspection.topology import Links, Topology

__all__ = ["Span", "Timeline", "simulate", "table", "chrome_trace", "write_png"]

_STREAMS = ("compute", "all_gather", "reduce_scatter", "comm", "replicate")
_DEFAULT_STREAM = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "replicate"}


@dataclass(frozen=True)
class Span:
    """One node's estimated interval, in seconds from the start of its graph."""

    name: str  # the node's name
    op: str  # collective kind, "wait", or the op name ("mm", "view"...)
    stream: str
    unit: object
    group: str
    bytes: int
    start: float
    end: float

    @property
    def kind(self) -> str:
        """A collective kind, ``wait``, ``copy`` (pack/unpack) or ``compute``."""
        if self.stream != "compute" or self.op == "wait":
            return self.op
        return "copy" if self.unit is not None else "compute"


@dataclass(frozen=True)
class Timeline:
    """The simulated schedule of one graph."""

    spans: tuple[Span, ...]
    step_seconds: float  # when the last work on any stream ends
    compute_seconds: float  # busy time of compute nodes (pack/unpack included, waits not)
    exposed_comm_seconds: float  # time the compute stream is blocked in waits
    comm_seconds: Mapping[str, float] = field(default_factory=dict)  # busy time per collective stream
    in_flight: Mapping[str, int] = field(default_factory=dict)  # peak bytes in flight per kind

    def summary(self) -> dict[str, object]:
        """Estimated step time, exposed communication (seconds and % of step), peak bytes in flight."""
        pct = 100.0 * self.exposed_comm_seconds / self.step_seconds if self.step_seconds else 0.0
        return {"step_seconds": self.step_seconds, "compute_seconds": self.compute_seconds,
                "exposed_comm_seconds": self.exposed_comm_seconds, "exposed_comm_pct": pct,
                "comm_seconds": dict(self.comm_seconds), "peak_bytes_in_flight": dict(self.in_flight)}

    def streams(self) -> list[str]:
        """Streams with work, compute first, then in NOTE [streams] order."""
        used = {s.stream for s in self.spans}
        return [s for s in _STREAMS if s in used] + sorted(used - set(_STREAMS))


def _fsdp(node: fx.Node) -> Mapping[str, object]:
    return node.meta.get("fsdp") or {}


def _beside_collectives(now: float, work: float, in_flight: list[tuple[float, float]], slowdown: float) -> float:
    """How long ``work`` seconds of compute from ``now`` take, ``1 + slowdown`` times slower while any
    collective of ``in_flight`` runs."""
    if not slowdown or not work or not in_flight:
        return work
    t, left = now, work
    for start, end in sorted(in_flight):
        if end <= t:
            continue
        if start > t:  # compute alone until the next collective starts
            if t + left <= start:
                return t + left - now
            left -= start - t
            t = start
        span = (end - t) / (1 + slowdown)  # work done beside this collective (and any it overlaps)
        if left <= span:
            return t + left * (1 + slowdown) - now
        left -= span
        t = end
    return t + left - now


def simulate(gm: fx.GraphModule, hw: Hardware | Topology, groups: Mapping[str, str] | None = None) -> Timeline:
    """Time every call node of ``gm`` in graph order on ``hw``: a ``Topology``, or a ``Hardware`` taken as
    ``Topology.of`` the ranks the graph's collectives span. ``groups``: labels of process groups (default:
    ``graph_group_labels(gm)``)."""
    topology = hw if isinstance(hw, Topology) else Topology.of(graph_world(gm), hw)
    hw = topology.hardware
    labels = graph_group_labels(gm) if groups is None else dict(groups)
    costs = graph_seconds(gm, hw)
    links = Links(topology.shared)
    now = 0.0  # the compute stream's clock
    spans: list[Span | fx.Node] = []  # a launch stands in for its span until the links have timed it
    launched: set[fx.Node] = set()
    compute = exposed = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_collective(n):
            links.issue(n, _stream(n), launch_seconds(n, topology), now)
            spans.append(n)
            launched.add(n)
        elif is_wait(n):
            launch = waited_collective(n)
            start, now = now, max(now, links.interval(launch)[1] if launch in launched else now)
            exposed += now - start
            group = str(launch.args[-1])
            spans.append(Span(n.name, "wait", "compute", _fsdp(launch).get("unit"), labels.get(group, group), 0,
                              start, now))
        else:  # compute: no launch comes before it ends, so the links' plan holds throughout
            dur = _beside_collectives(now, costs.get(n, 0.0), list(links.pending().values()), hw.overlap_slowdown)
            spans.append(Span(n.name, op_name(n), "compute", _fsdp(n).get("unit"), "", 0, now, now + dur))
            now += dur
            compute += dur
    timed = [s if isinstance(s, Span) else _launch_span(s, links.interval(s), labels) for s in spans]
    busy: dict[str, float] = {}
    for s in timed:
        if s.stream != "compute":
            busy[s.stream] = busy.get(s.stream, 0.0) + s.end - s.start
    return Timeline(spans=tuple(timed), step_seconds=max([now, *(s.end for s in timed)]), compute_seconds=compute,
                    exposed_comm_seconds=exposed, comm_seconds=busy, in_flight=in_flight_peaks(gm))


def _stream(launch: fx.Node) -> str:
    """The stream a launch runs on: its annotation, else its kind's own (NOTE [streams])."""
    return str(_fsdp(launch).get("stream") or _DEFAULT_STREAM[collective_kind(launch)])


def _launch_span(n: fx.Node, interval: tuple[float, float], labels: Mapping[str, str]) -> Span:
    group = str(n.args[-1])
    return Span(n.name, collective_kind(n), _stream(n), _fsdp(n).get("unit"), labels.get(group, group),
                collective_bytes(n), *interval)


_HEADER = ("order", "node", "unit", "collective", "group", "stream", "bytes", "est. start (us)", "est. end (us)")
_RIGHT = {0, 6, 7, 8}  # right-aligned columns


def _describe(r: Row, max_len: int = 40) -> str:
    """A row's node column: a launch's or wait's node name, else what the run does and its size."""
    nodes = r.nodes
    if r.op not in ("compute", "pack", "unpack"):
        return nodes[0].name
    what = r.detail if r.op == "compute" else r.op
    if len(what) > max_len:
        what = what[: max_len - 3] + "..."
    return f"{what} ({len(nodes)} node{'s' if len(nodes) > 1 else ''})"


def _units(units: list[object]) -> str:
    """``0-3`` for consecutive integer units, else the distinct units comma-separated."""
    distinct = sorted({u for u in units if u is not None}, key=str)
    if distinct and all(isinstance(u, int) for u in distinct) and distinct == list(
            range(int(distinct[0]), int(distinct[-1]) + 1)) and len(distinct) > 2:  # type: ignore[call-overload]
        return f"{distinct[0]}-{distinct[-1]}"
    return ",".join(str(u) for u in distinct)


def _runs(all_rows: list[Row], min_run: int = 3) -> list[list[Row]]:
    """Rows in order, ``min_run`` or more consecutive ``pack`` (or ``unpack``) rows of one collective kind
    as one run; every other row alone."""
    out: list[list[Row]] = []
    for r in all_rows:
        prev = out[-1] if out else None
        if (prev and r.op in ("pack", "unpack") and prev[0].op == r.op
                and _fsdp(prev[0].nodes[0]).get("kind") == _fsdp(r.nodes[0]).get("kind")):
            prev.append(r)
        else:
            out.append([r])
    return [piece for run in out for piece in ([run] if len(run) >= min_run else [[r] for r in run])]


def table(gm: fx.GraphModule, timeline: Timeline, groups: Mapping[str, str] | None = None) -> str:
    """The schedule of ``gm`` (``schedule.rows``) with estimated start and end times in microseconds;
    ``groups`` maps process-group names to labels (default: ``graph_group_labels(gm)``)."""
    labels = graph_group_labels(gm) if groups is None else dict(groups)
    by_name = {s.name: s for s in timeline.spans}
    lines = [_HEADER]
    for i, run in enumerate(_runs(rows(gm))):
        r = run[0]
        nodes = [n for row in run for n in row.nodes]
        spans = [by_name[n.name] for n in nodes if n.name in by_name]
        first = r.nodes[0]
        if r.op == "compute":
            kind = ""
        elif r.op == "wait":
            kind = collective_kind(waited_collective(first))
        elif r.op in ("pack", "unpack"):
            kind = str(_fsdp(first).get("kind", ""))
        else:
            kind = r.op
        if len(run) > 1:
            node, unit = f"{r.op} x{len(run)} ({len(nodes)} nodes)", _units([row.unit for row in run])
        else:
            node, unit = _describe(r), "" if r.unit is None else str(r.unit)
        lines.append((
            str(i), node, unit, kind, labels.get(r.group, r.group),
            spans[0].stream if spans else "", str(r.bytes) if r.bytes and len(run) == 1 else "",
            f"{min(s.start for s in spans) * 1e6:.3f}" if spans else "",
            f"{max(s.end for s in spans) * 1e6:.3f}" if spans else "",
        ))
    widths = [max(len(line[c]) for line in lines) for c in range(len(_HEADER))]
    out = []
    for line in lines:
        cells = [cell.rjust(w) if c in _RIGHT else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def chrome_trace(timelines: Mapping[str, Timeline]) -> dict[str, object]:
    """Chrome / Perfetto trace-event JSON: a process per graph, a thread per stream, an ``"X"`` event per
    span that takes time, in microseconds."""
    events: list[dict[str, object]] = []
    for pid, (graph, tl) in enumerate(timelines.items(), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": graph}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tids = {stream: tid for tid, stream in enumerate(tl.streams())}
        for stream, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in tl.spans:
            if s.end <= s.start:
                continue
            args: dict[str, object] = {"node": s.name}
            if s.unit is not None:
                args["unit"] = s.unit if isinstance(s.unit, (int, str)) else str(s.unit)
            if s.group:
                args["group"] = s.group
            if s.bytes:
                args["bytes"] = s.bytes
            events.append({"ph": "X", "name": s.op, "cat": s.kind, "pid": pid, "tid": tids[s.stream],
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


_COLORS = {"compute": "#4C72B0", "copy": "#8C8C8C", "wait": "#C44E52", "all_gather": "#55A868",
           "reduce_scatter": "#DD8452", "all_reduce": "#8172B3"}


def _bars(spans: list[Span]) -> list[tuple[str, float, float]]:
    """Spans of one row as (kind, start, end), adjacent compute (or copy) spans merged."""
    out: list[tuple[str, float, float]] = []
    for s in spans:
        if s.end <= s.start:
            continue
        if out and out[-1][0] == s.kind in ("compute", "copy") and s.start <= out[-1][2]:
            out[-1] = (s.kind, out[-1][1], max(out[-1][2], s.end))
        else:
            out.append((s.kind, s.start, s.end))
    return out


def write_png(timelines: Mapping[str, Timeline], path: str | Path, title: str = "") -> None:
    """Draw each graph's streams as rows of bars coloured by kind (needs matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise RuntimeError("write_png needs matplotlib: pip install matplotlib, or install this package "
                           "with pip install -e '.[plot]'") from e
    lanes = [(f"{graph}: {stream}", [s for s in tl.spans if s.stream == stream])
             for graph, tl in timelines.items() for stream in tl.streams()]
    longest = max([tl.step_seconds for tl in timelines.values()] + [1e-12])
    scale, unit = (1e6, "us") if longest < 1e-2 else (1e3, "ms")
    fig = Figure(figsize=(12, 1 + 0.45 * max(len(lanes), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, (_, spans) in enumerate(reversed(lanes)):
        for kind, start, end in _bars(spans):
            ax.broken_barh([(start * scale, (end - start) * scale)], (y - 0.4, 0.8),
                           facecolor=_COLORS.get(kind, "#937860"), edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), [name for name, _ in reversed(lanes)])
    ax.set_xlabel(f"estimated time ({unit})")
    ax.set_xlim(0, longest * scale * 1.02)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=len(_COLORS), fontsize="small", frameon=False)
    if title:
        ax.set_title(title, fontsize="small", pad=24)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100, bbox_inches="tight")
