"""Warm start: what makes AOTAutograd's cache serve graphs compiled by this backend.

NOTE [warm start]: with Inductor's caches on, a later process start skips AOTAutograd's tracing, the
partition and Inductor: AOTAutograd's cache maps the Dynamo graph to the compiled graphs. It serves a
backend only when its compilers are *serializable*, and keys entries on the Dynamo graph, its inputs
and torch's configuration, nothing of ours. Our compiled graphs also depend on the backend's options
and cost model, each group's size, this rank and the group's timeout, and fsdp-compile's own source and
version, so :func:`cache_key` digests those and the backend sets it on the Dynamo graph as an attribute,
which AOTAutograd's key covers. A loaded graph runs none of our compile-time steps, so the lockstep and
agreement checks live inside the compiled graph (NOTE [lockstep]). The cache is bypassed where a user
asks to see each compile (dumps, pass diffs, ``observe_graphs``, the schedule log, ``TORCH_TRACE``) and
under ``inductor=False``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist
from torch import fx

from fsdp_compile import passes as _passes
from fsdp_compile.passes.predicates import marker_args, is_reduce_grad, is_unshard
from fsdp_compile._compat import group_timeout_s, resolve_group

__all__ = ["ATTRIBUTE", "cache_key", "digest_sources", "installed_roots", "installed_version", "source_digest"]

ATTRIBUTE = "fsdp_compile_cache_key"


def installed_roots() -> tuple[Path, ...]:
    """The folders of fsdp-compile's source as imported: ``fsdp_compile``, and ``fsdp_compile.passes``
    where it lies outside it."""
    package = Path(__file__).resolve().parents[1]
    passes = Path(_passes.__file__).resolve().parent
    return (package,) if passes.is_relative_to(package) else (package, passes)


def installed_version() -> str:
    """fsdp-compile's version as installed, or ``"not installed"``."""
    try:
        return importlib.metadata.version("fsdp-compile")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def digest_sources(roots: Iterable[Path], version: str) -> str:
    """A digest of ``version`` and of every ``*.py`` file under ``roots``, each by its path relative to
    its root's parent and its bytes."""
    h = hashlib.sha256(version.encode() + b"\0")
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            data = path.read_bytes()
            h.update(f"{path.relative_to(root.parent).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """:func:`digest_sources` of the installed packages, computed once."""
    return digest_sources(installed_roots(), installed_version())


def _groups(gm: fx.GraphModule) -> dict[str, tuple[int, int, float]]:
    """``name -> (rank, size, timeout)`` of every group the graph's markers name."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        if is_unshard(node) or is_reduce_grad(node):
            args = marker_args(node)
            names.update(n for n in (args.ag_group, args.rs_group, args.replicate_group) if n)
    out = {}
    for name in sorted(names):
        group = resolve_group(name)
        out[name] = (group.rank(), group.size(), group_timeout_s(group))
    return out


def cache_key(gm: fx.GraphModule, settings: str) -> str:
    """What, beside the Dynamo graph, decides the graphs our backend compiles from ``gm``: ``settings``
    (the options and cost model, as text), the ranks and groups, our source."""
    world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    text = json.dumps({"settings": settings, "world": world, "groups": _groups(gm), "source": source_digest()})
    return hashlib.sha256(text.encode()).hexdigest()
