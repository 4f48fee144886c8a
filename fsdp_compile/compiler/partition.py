"""The resharding partition: which gathered values backward may keep, and which it must gather again.

``partition`` (AOTAutograd's ``partition_fn`` in ``backend.py``) runs Inductor's joint-graph passes,
marks each unshard of a resharding unit must-recompute, then min-cut partitions: forward saves the
*shard* and backward gathers again (NOTE [reshard by recompute]). Outlined bodies (NOTE [outlined
units] in ``module.py``) are partitioned on their own first, and keep their inputs rather than views of
them (NOTE [reshard through outlined bodies]). A backward's fills that only scatters read are made
cheap to reload (NOTE [fills on reload]).
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

# Casts and copies read as views do: a copy of a gathered param is as large as the param.
_COPY_OPS = {
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten._unsafe_view.default,  # (a view in all but its schema)
}


@functools.cache
def _reads_as_view(target: Any) -> bool:
    """Whether a node calling ``target`` reads its input as a view (or a cast, or a copy): an op whose schema
    returns an alias of an input and writes none (``view``, ``t``, ``permute``, ``slice``, ``select``,
    ``split``, ``unbind``, ``narrow``, ``squeeze``, ``unflatten``, ``as_strided``, ...), or one of
    :data:`_COPY_OPS`. Read from the schema, so every view op counts, not only those a list names."""
    if target in _COPY_OPS:
        return True
    if not isinstance(target, OpOverload):
        return False
    schema = target._schema
    if not schema.returns or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


# Activation-checkpoint regions are numbered from 0 up; the partitioner turns a must-recompute node
# into must-save when a user belongs to a *later* region. Our tags carry a number above every region,
# so an unshard read inside a checkpointed block is still recomputed, never saved.
_AC_GRAPH_ID = 1 << 30


def _tag_reshard(joint: fx.GraphModule) -> None:
    """NOTE [reshard by recompute]: mark unshards of resharding units (and the view/cast chains that
    only read them) must-recompute, so the partitioner cannot save a gathered param for backward and
    instead re-runs the unshard there; units with ``reshard_after_forward=False`` are must-save."""
    for node in joint.graph.nodes:
        if not is_unshard(node):
            continue
        reshard = bool(marker_args(node).reshard)  # (its getitems are read as views are)
        policy = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = _AC_GRAPH_ID
        if not reshard:
            continue
        frontier = list(node.users)
        while frontier:
            user = frontier.pop()
            if (user.op == "call_function" and (_reads_as_view(user.target) or user.target is operator.getitem)
                    and user.meta.get("ac_graph_id") != _AC_GRAPH_ID):
                user.meta["recompute"] = policy
                user.meta["ac_graph_id"] = _AC_GRAPH_ID
                frontier.extend(user.users)


def _read_passed_through_inputs(joint: fx.GraphModule) -> None:
    """NOTE [reshard through outlined bodies]: AOTAutograd splits each ``invoke_subgraph`` call (see
    NOTE [outlined units] in module.py) into a forward call that also returns what its backward
    saves, and a backward call that reads those. A saved value that is just one of the forward call's
    inputs, such as a gathered parameter, would then reach backward through the forward call's output,
    where the must-recompute tag on its unshard cannot see it: the full parameter would be kept from
    forward to backward. Reading such values from the input itself lets the partitioner recompute the
    unshard in backward, as it does for inline units. Views of them that the body would save, such as
    a transposed weight, are recomputed in its backward instead: :func:`_tag_input_views`."""
    for node in joint.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        body = getattr(joint, str(node.args[0].target))  # type: ignore[union-attr]
        placeholders = {p: i for i, p in enumerate(body.graph.find_nodes(op="placeholder"))}
        (results,) = body.graph.find_nodes(op="output")[0].args
        for user in list(node.users):
            if user.target is operator.getitem and results[user.args[1]] in placeholders:
                user.replace_all_uses_with(node.args[2 + placeholders[results[user.args[1]]]])


def _tag_input_views(joint: fx.GraphModule) -> None:
    """NOTE [reshard through outlined bodies], the body's side: in an outlined body's joint graph, views
    (and casts) of the body's inputs are must-recompute, so that its forward saves the input itself
    (which the outer graph then reads from the call's operand) instead of a view of it, such as the
    transposed weight of a linear layer, which would keep the gathered parameter alive to backward."""
    for primal in joint.graph.find_nodes(op="placeholder"):
        if not primal.name.startswith("primals"):
            continue
        frontier = list(primal.users)
        while frontier:
            user = frontier.pop()
            if (user.op == "call_function" and (_reads_as_view(user.target) or user.target is operator.getitem)
                    and "recompute" not in user.meta):
                user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                user.meta["ac_graph_id"] = _AC_GRAPH_ID
                frontier.extend(user.users)


# Ops that read a full tensor of constant value only as the base they write a piece of gradient into.
_SCATTERS = {
    torch.ops.aten.slice_scatter.default,
    torch.ops.aten.select_scatter.default,
    torch.ops.aten.diagonal_scatter.default,
    torch.ops.aten.as_strided_scatter.default,
}


def _fill_by_broadcast(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [fills on reload]: AOTAutograd's cache saves a backward graph (to compile it later) by pickling
    its ``GraphModule``, and loading re-traces the graph's code, which *runs* every call whose arguments
    are all constants and keeps the result as a constant tensor of the module (``torch.fx``'s pickling,
    torch 2.11 and 2.13). A view's backward writes its gradient into ``full(shape, 0)``, such as RoPE's
    strided slices of q and k in each outlined block's backward body, so a warm start kept fills of an
    activation's size in the device's memory for the whole run, read by no kernel. In an
    outlined body's backward such a fill becomes a one-element fill expanded to its shape, whose call
    reads a node and so is never run on reload; only where every user is a scatter (the view's backward)
    that reads it as its base: the same values and, for Inductor, the same fused kernel. The whole-model
    backward is left as it is: the lowering passes read its fills (the flat gradient's pieces), and its
    loaded graph is not re-traced that way (none is held after a warm start of inline blocks)."""
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
    """Inductor's joint-graph passes (as ``torch.compile`` runs them), :func:`_tag_reshard`, then the
    min-cut partition. AOTAutograd partitions each outlined body's joint graph first, with no inputs
    (``run_joint_graph_passes_on_hops``): those get :func:`_tag_input_views` instead."""
    with timed("fsdp.partition"):
        joint = inductor_joint_graph_passes(joint, joint_inputs)
        if len(joint_inputs) == 0:  # an outlined body
            _tag_input_views(joint)
        else:
            _read_passed_through_inputs(joint)
            _tag_reshard(joint)
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        return forward, _fill_by_broadcast(backward) if len(joint_inputs) == 0 else backward
