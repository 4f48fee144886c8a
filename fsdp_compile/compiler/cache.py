"""Warm start: what makes AOTAutograd's cache serve graphs compiled by this backend.

NOTE [warm start]: with Inductor's caches on (the default), a second process start of plain
``torch.compile`` skips AOTAutograd's tracing, the partition and Inductor: AOTAutograd's cache maps the
Dynamo graph to the compiled forward and backward. It serves a backend only when that backend's
compilers are *serializable* (they return Inductor's output code, whose entry in Inductor's graph
cache the AOTAutograd entry points to), and it keys entries on the Dynamo graph, its inputs and
torch's configuration: nothing of ours. Our partition and passes turn one Dynamo graph into different
compiled graphs depending on

- the backend's options and cost model (prefetch depth, bucket caps, the schedule...),
- each group's size and this process's rank in it (the in-place all-gather writes its rank's slice),
  and its timeout (how long the check-in inside the graph waits for peers),
- fsdp-compile's own code: every source file of the package ``fsdp_compile`` (``fsdp_compile.passes``
  included) as imported, and the installed version,

so :func:`cache_key` digests those, and the backend sets it on the Dynamo graph as an attribute, which
AOTAutograd's key covers (it pickles the graph module's attributes). A loaded graph runs none of our
compile-time steps: the lockstep check-in and the agreement check therefore live inside the compiled
graph (``fsdp::check_in``, NOTE [lockstep]) so a loaded graph still does them.

The backend bypasses the cache where a user asks to see each compile: schedule dumps, pass diffs,
``observe_graphs``, the schedule log (``TORCH_LOGS=fsdp_compile``), torch's structured trace (``TORCH_TRACE``, whose
schedule artifacts tlparse shows), and ``inductor=False`` (nothing serializable).
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

# The Dynamo graph's attribute that carries :func:`cache_key` into AOTAutograd's key.
ATTRIBUTE = "fsdp_compile_cache_key"


def installed_roots() -> tuple[Path, ...]:
    """The folders of fsdp-compile's source as imported: the package ``fsdp_compile``, and the folder of
    ``fsdp_compile.passes`` where it lies outside it (a source tree keeps ``passes/`` at its top)."""
    package = Path(__file__).resolve().parents[1]
    passes = Path(_passes.__file__).resolve().parent
    return (package,) if passes.is_relative_to(package) else (package, passes)


def installed_version() -> str:
    """fsdp-compile's version as installed, or ``"not installed"`` (run from a source tree)."""
    try:
        return importlib.metadata.version("fsdp-compile")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def digest_sources(roots: Iterable[Path], version: str) -> str:
    """A digest of ``version`` and of every ``*.py`` file under ``roots`` (recursively), each by its
    path relative to its root's parent (``passes/schedule/prefetch.py``) and its bytes."""
    h = hashlib.sha256(version.encode() + b"\0")
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            data = path.read_bytes()
            h.update(f"{path.relative_to(root.parent).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """fsdp-compile's source and version as this process runs them (:func:`digest_sources` of the
    installed packages, computed once): new code, new cache entries."""
    return digest_sources(installed_roots(), installed_version())


def _group_names(gm: fx.GraphModule) -> list[str]:
    """Every group the graph's markers name."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        if not (is_unshard(node) or is_reduce_grad(node)):
            continue
        args = marker_args(node)
        names.update(n for n in (args.ag_group, args.rs_group, args.replicate_group) if n)
    return sorted(names)


def _ranks(names: Iterable[str]) -> dict[str, tuple[int, int, float]]:
    """``name -> (this process's rank in the group, the group's size, its timeout)``: the timeout is the
    agreement check's and the check-in's wait, which the compiled graph holds (NOTE [lockstep])."""
    out = {}
    for name in names:
        group = resolve_group(name)
        out[name] = (group.rank(), group.size(), group_timeout_s(group))
    return out


def cache_key(gm: fx.GraphModule, settings: str) -> str:
    """What, beside the Dynamo graph, decides the graphs our backend compiles from ``gm``:
    ``settings`` (the options and cost model, as text), the ranks and group sizes, our source."""
    world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    text = json.dumps({"settings": settings, "world": world, "groups": _ranks(_group_names(gm)),
                       "source": source_digest()})
    return hashlib.sha256(text.encode()).hexdigest()
