"""Every private torch API the passes use, in one place (the passes import nothing of ``fsdp_compile`` outside
``fsdp_compile.passes``; ``fsdp_compile/_compat.py`` holds the rest). Where these move between torch releases, the fallback belongs here.
"""

from __future__ import annotations

from typing import Any

from torch import fx
from torch._guards import detect_fake_mode
from torch._ops import OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["FakeTensor", "FakeTensorMode", "OpOverloadPacket", "detect_fake_mode", "mark_sourceless_input",
           "copy_dynamo_graph", "static_fake",
           "tree_flatten", "tree_map_only", "unset_fake_temporarily"]


def mark_sourceless_input(placeholder: object) -> None:
    """A placeholder added to a Dynamo graph stands for no user-code source: AOTAutograd reads each Dynamo
    placeholder's ``_dynamo_source`` to map its inputs back to user code (``None``: no source)."""
    placeholder._dynamo_source = None  # type: ignore[attr-defined]


def copy_dynamo_graph(gm: Any) -> Any:
    """A copy of Dynamo's graph module ``gm`` with a graph of its own (Dynamo reads its graph's
    placeholders after the backend returns: a pass that changes them works on a copy), keeping what
    AOTAutograd reads of a Dynamo graph: the module's ``meta`` and ``_param_name_to_source`` and each
    placeholder's ``_dynamo_source``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy


def static_fake(tensor: Any) -> Any:
    """``tensor`` as a fake tensor of the compile in progress, its sizes static: an input added to Dynamo's
    graph (a real tensor with no Dynamo source would get symbolic sizes from AOTAutograd)."""
    mode = detect_fake_mode()
    return tensor if mode is None else mode.from_tensor(tensor, static_shapes=True)
