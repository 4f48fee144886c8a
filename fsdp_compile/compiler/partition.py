"""The resharding partition: which gathered values backward may keep, and which it must gather again.

``partition`` (AOTAutograd's ``partition_fn``) runs Inductor's joint-graph passes, tags the graph
(NOTE [reshard by recompute], NOTE [reshard through outlined bodies]), then min-cut partitions; an
outlined body's backward gets cheap fills (NOTE [fills on reload]).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.passes.predicates import is_unshard, marker_args
from fsdp_compile._compat import OpOverload, inductor_joint_graph_passes, min_cut_rematerialization_partition, timed

__all__ = ["partition"]

# Casts, copies and ``_unsafe_view`` (a view but for its schema) read as views do: a copy of a gathered
# param is as large as the param.
_COPY_OPS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default,
             torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default}


@functools.cache
def _reads_as_view(target: Any) -> bool:
    """Whether a node calling ``target`` reads its input as a view does: one of :data:`_COPY_OPS`, or an
    op whose schema returns an alias of an input and writes none."""
    if target in _COPY_OPS:
        return True
    if not isinstance(target, OpOverload):
        return False
    schema = target._schema
    if not schema.returns or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


# Above every activation-checkpoint region: the partitioner turns a must-recompute node into must-save
# when a user belongs to a later region, so an unshard read in a checkpointed block stays recomputed.
_AC_GRAPH_ID = 1 << 30


def _tag_reshard(joint: fx.GraphModule) -> None:
    """NOTE [reshard by recompute]: unshards of resharding units (and the view/cast chains that read
    them) are must-recompute, so backward gathers again instead of keeping the gathered param; units
    with ``reshard_after_forward=False`` are must-save."""
    for node in joint.graph.nodes:
        if is_unshard(node):
            reshard = bool(marker_args(node).reshard)  # (its getitems are read as views are)
            policy = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = _AC_GRAPH_ID
            if reshard:
                _tag_readers(node, policy, keep_user_tags=False)


def _tag_readers(node: fx.Node, policy: CheckpointPolicy, *, keep_user_tags: bool) -> None:
    """Tag with ``policy`` the view, cast and getitem chains that read ``node``, skipping nodes we tagged
    already, or (``keep_user_tags``) any tagged node."""
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        tagged = "recompute" in user.meta if keep_user_tags else user.meta.get("ac_graph_id") == _AC_GRAPH_ID
        if (user.op == "call_function" and (_reads_as_view(user.target) or user.target is operator.getitem)
                and not tagged):
            user.meta["recompute"] = policy
            user.meta["ac_graph_id"] = _AC_GRAPH_ID
            frontier.extend(user.users)


def _read_passed_through_inputs(joint: fx.GraphModule) -> None:
    """NOTE [reshard through outlined bodies]: AOTAutograd splits each ``invoke_subgraph`` call into a
    forward call that also returns what its backward saves, and a backward call that reads those. A saved
    value that is one of the call's inputs, such as a gathered parameter, would reach backward through
    the call's output, hidden from its unshard's must-recompute tag. Reading such values from the input
    itself lets the partitioner recompute the unshard; views of them that the body would save are
    recomputed in its backward instead (:func:`_tag_input_views`)."""
    for node in joint.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        body = getattr(joint, str(node.args[0].target))  # type: ignore[union-attr]
        placeholders = {p: i for i, p in enumerate(body.graph.find_nodes(op="placeholder"))}
        (results,) = body.graph.find_nodes(op="output")[0].args
        for user in list(node.users):
            if user.target is operator.getitem and results[user.args[1]] in placeholders:
                user.replace_all_uses_with(node.args[2 + placeholders[results[user.args[1]]]])


def _tag_input_views(joint: fx.GraphModule) -> None:
    """In an outlined body's joint graph, views and casts of the inputs are must-recompute, so that its
    forward saves the input itself, not a view that would keep a gathered parameter alive
    (NOTE [reshard through outlined bodies])."""
    for primal in joint.graph.find_nodes(op="placeholder"):
        if primal.name.startswith("primals"):
            _tag_readers(primal, CheckpointPolicy.MUST_RECOMPUTE, keep_user_tags=True)


# Ops that read a full tensor of constant value only as the base they write a piece of gradient into.
_SCATTERS = {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
             torch.ops.aten.diagonal_scatter.default, torch.ops.aten.as_strided_scatter.default}


def _fill_by_broadcast(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [fills on reload]: AOTAutograd's cache pickles a backward ``GraphModule``, and loading
    re-traces its code, which runs every call whose arguments are all constants and keeps the result as
    a constant tensor. A view's backward writes its gradient into ``full(shape, 0)``, so a warm start
    kept activation-sized fills in memory for the whole run. In an outlined body's backward, a fill whose
    every user is a scatter reading it as its base becomes a one-element fill expanded to its shape,
    which reads a node and so never runs on reload: the same values and the same fused kernel. The
    whole-model backward is left as is: the lowering passes read its fills."""
    graph, changed = gm.graph, False
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.full.default):
        size = node.args[0]
        if (node.all_input_nodes or not isinstance(size, (list, tuple)) or len(size) == 0 or not node.users
                or any(u.target not in _SCATTERS or u.args[0] is not node or node in u.args[1:] for u in node.users)):
            continue
        with graph.inserting_before(node):
            one = graph.call_function(torch.ops.aten.full.default, ([], *node.args[1:]), dict(node.kwargs))
            whole = graph.call_function(torch.ops.aten.expand.default, (one, list(size)))
        if "val" in node.meta:
            one.meta["val"] = node.meta["val"].new_empty(())
            whole.meta["val"] = one.meta["val"].expand(list(size))
        node.replace_all_uses_with(whole)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Inductor's joint-graph passes, the tags, then the min-cut partition. An outlined body's joint
    graph comes with no inputs."""
    with timed("fsdp.partition"):
        joint = inductor_joint_graph_passes(joint, joint_inputs)
        if len(joint_inputs) == 0:  # an outlined body
            _tag_input_views(joint)
        else:
            _read_passed_through_inputs(joint)
            _tag_reshard(joint)
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        return forward, _fill_by_broadcast(backward) if len(joint_inputs) == 0 else backward
