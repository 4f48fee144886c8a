"""Stream assignment: annotate on every node the stream its work runs on.

NOTE [streams]: a functional collective runs on its process group's own stream (for NCCL, each
communicator's internal CUDA stream) and ``wait_tensor`` makes the compute stream wait for it, so a
launch's stream follows from its group and the groups its marker named:

    all_gather      a launch on the all-gather communicator
    reduce_scatter  a launch on the dedicated reduce-scatter communicator
    comm            a launch on the one communicator both share (``dedicated="none"``): serialised
    replicate       an all-reduce across replicas (HSDP)
    compute         everything else: compute, pack/unpack copies, and waits (``meta["fsdp"]["waits_on"]``
                    names the stream a wait joins)

Tables, traces and the cost model read these annotations; ``check_streams`` verifies each launch's.
"""

from __future__ import annotations

from torch import fx

from ..predicates import fsdp_meta, is_collective, is_wait, waited_collective

__all__ = ["streams_pass", "stream_of_launch", "check_streams"]


def stream_of_launch(node: fx.Node) -> str:
    """The stream a collective launch runs on (NOTE [streams])."""
    meta = fsdp_meta(node)
    group = node.args[-1]
    ag, rs, rep = meta.get("ag_group"), meta.get("rs_group"), meta.get("replicate_group")
    if rep and group == rep and group not in (ag, rs):
        return "replicate"
    if ag is not None and ag == rs and group == ag:
        return "comm"
    if group == ag:
        return "all_gather"
    if group == rs:
        return "reduce_scatter"
    raise ValueError(f"streams: {node.name} runs on group {group!r}, which its marker did not name")


def streams_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate ``meta["fsdp"]["stream"]`` on every call node."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        meta = fsdp_meta(node)
        if is_collective(node):
            meta["stream"] = stream_of_launch(node)
        else:
            meta["stream"] = "compute"
            if is_wait(node):
                meta["waits_on"] = stream_of_launch(waited_collective(node))
    return gm


def check_streams(gm: fx.GraphModule) -> None:
    """Raise if a launch's stream annotation does not match the group it runs on."""
    for node in gm.graph.nodes:
        if is_collective(node):
            expected = stream_of_launch(node)
            got = fsdp_meta(node).get("stream")
            if got != expected:
                raise AssertionError(f"{node.name}: annotated stream {got!r}, but its group runs on {expected!r}")
