"""Per-node seconds for a whole graph, with the memory-bound ops grouped as Inductor fuses them.

A fused op joins the group of each fused input (and of views of them); a view joins its input's group.
A group costs (bytes read from outside + bytes of members used outside) / achievable bandwidth, plus
``kernel_latency`` per member used outside; its seconds are spread over its members in proportion to
what each moves alone. Matmuls, attention and the bucket copies keep ``cost.node_seconds``. Not counted:
a tensor Inductor must write out between two fused ops because a matmul runs between them.
"""

from __future__ import annotations

from torch import fx

from fsdp_compile.passes.predicates import is_collective, is_wait, op_name, tensor_bytes

from fsdp_compile.inspection.cost import (
    ATTENTION_OPS, MATMUL_OPS, ZERO_COST_OPS, node_bytes, node_flops, node_seconds, read_bytes,
)
from fsdp_compile.inspection.hardware import Hardware

__all__ = ["graph_seconds", "fusion_groups"]


def _kind(node: fx.Node) -> str:
    """``none`` (no compute), ``view``, ``extern`` (a kernel of its own) or ``fused``."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return "none"
    name = op_name(node)
    if name in ZERO_COST_OPS:
        return "view"
    if name in MATMUL_OPS or name in ATTENTION_OPS or not hasattr(node.target, "overloadpacket"):
        return "extern"
    # fsdp ops (a bucket's copies) are one kernel each, opaque to Inductor
    return "extern" if getattr(node.target, "namespace", None) == "fsdp" or node_flops(node) else "fused"


def fusion_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The fused groups of ``gm``, members in graph order (views included), groups by first member."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in gm.graph.nodes:
        kind = _kind(node)
        if kind == "view":
            if node.all_input_nodes and node.all_input_nodes[0] in parent:
                parent[node] = find(node.all_input_nodes[0])
        elif kind == "fused":
            parent[node] = node
            for inp in node.all_input_nodes:
                if inp in parent:
                    root = find(inp)
                    if root is not node:
                        parent[root] = node
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in parent:
            groups.setdefault(find(node), []).append(node)
    return list(groups.values())


def _group_seconds(members: list[fx.Node], hw: Hardware) -> tuple[float, list[fx.Node]]:
    inside = set(members)
    views = {n for n in members if _kind(n) == "view"}

    def escapes(n: fx.Node) -> bool:
        return not n.users or any(u not in inside or (u in views and escapes(u)) for u in n.users)

    reads: dict[fx.Node, int] = {}
    written = kernels = 0
    for n in members:
        if n in views:
            continue
        for inp in n.all_input_nodes:
            if inp not in inside:
                reads[inp] = max(reads.get(inp, 0), read_bytes(n, inp))
        if escapes(n):
            written += tensor_bytes(n)
            kernels += 1
    work = [n for n in members if n not in views]
    if not work:
        return 0.0, []
    moved = sum(reads.values()) + written
    return moved / (hw.memory_bandwidth * hw.memory_fraction) + max(kernels, 1) * hw.kernel_latency, work


def graph_seconds(gm: fx.GraphModule, hw: Hardware) -> dict[fx.Node, float]:
    """Estimated seconds of every call node of ``gm`` on ``hw``, memory-bound ops fused."""
    seconds: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if _kind(node) == "extern":
            seconds[node] = node_seconds(node, hw)
    for members in fusion_groups(gm):
        total, work = _group_seconds(members, hw)
        weights = [max(node_bytes(n), 1) for n in work]
        for n, w in zip(work, weights):
            seconds[n] = total * w / sum(weights)
    return seconds
