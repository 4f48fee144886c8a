"""Make every ``invoke_subgraph`` call of one body read it through one attribute: AOTAutograd installs an
outlined body once per call, and Inductor would compile each name again (NOTE [outlined units] in
``fsdp_compile/api/module.py``)."""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["share_subgraphs_pass"]


def share_subgraphs_pass(gm: fx.GraphModule, *, recompile: bool = True) -> fx.GraphModule:
    """Calls with the same identifier and body (or one with the same code) read the first one's attribute."""
    first: dict[str, tuple[str, fx.GraphModule]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        attr, identifier = node.args[0], str(node.args[1])
        if not isinstance(attr, fx.Node) or attr.op != "get_attr":
            continue
        module = getattr(gm, str(attr.target))
        if identifier not in first:
            first[identifier] = (str(attr.target), module)
            continue
        name, shared = first[identifier]
        if name != attr.target and (module is shared or module.code == shared.code):
            with gm.graph.inserting_before(attr):
                node.update_arg(0, gm.graph.get_attr(name))
            if not attr.users:
                gm.graph.erase_node(attr)
    gm.delete_all_unused_submodules()
    if recompile:
        gm.recompile()
    return gm
