"""Every private torch API the passes use (``fsdp_compile/_compat.py`` holds the rest's)."""

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
    """Mark a placeholder added to a Dynamo graph as having no user-code source (read by AOTAutograd)."""
    placeholder._dynamo_source = None  # type: ignore[attr-defined]


def copy_dynamo_graph(gm: Any) -> Any:
    """A copy of Dynamo's ``gm`` with its own graph (Dynamo reads its placeholders after the backend returns),
    keeping what AOTAutograd reads: ``meta``, ``_param_name_to_source``, each placeholder's ``_dynamo_source``."""
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
    """``tensor`` as a static-shaped fake tensor of the compile in progress (for an input added to Dynamo's graph)."""
    mode = detect_fake_mode()
    return tensor if mode is None else mode.from_tensor(tensor, static_shapes=True)
