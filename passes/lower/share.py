"""Make every ``invoke_subgraph`` call of one body read it through one attribute.

AOTAutograd installs the partitioned forward (or backward) of an outlined body once per call, each under
a name of its own, while Inductor lowers a subgraph once per *name*: without this pass it would lower
and generate code for the same block once per call again (NOTE [outlined units] in
fsdp_compile/api/module.py).
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["share_subgraphs_pass"]


def share_subgraphs_pass(gm: fx.GraphModule, *, recompile: bool = True) -> fx.GraphModule:
    """Calls with the same identifier and the same body module (or one with the same code) read the
    first one's attribute. ``recompile=False``: a later pass recompiles ``gm``."""
    first: dict[str, tuple[str, fx.GraphModule]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        attr, identifier = node.args[0], node.args[1]
        if not isinstance(attr, fx.Node) or attr.op != "get_attr":
            continue
        module = getattr(gm, str(attr.target))
        if str(identifier) not in first:
            first[str(identifier)] = (str(attr.target), module)
            continue
        name, shared = first[str(identifier)]
        if name != attr.target and (module is shared or module.code == shared.code):
            with gm.graph.inserting_before(attr):
                node.update_arg(0, gm.graph.get_attr(name))
            if not attr.users:
                gm.graph.erase_node(attr)
    gm.delete_all_unused_submodules()
    if recompile:
        gm.recompile()
    return gm
