"""What a compiled graph's schedule looks like, as text and files (``make_backend(dump_dir=...)``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
from torch import fx

from .schedule import listing

__all__ = ["report", "dump"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def report(gm: fx.GraphModule) -> str:
    """The schedule table of one compiled graph."""
    return listing(gm)


def dump(gm: fx.GraphModule, directory: str | os.PathLike[str], name: str) -> list[Path]:
    """Write ``gm``'s schedule under ``directory`` as ``<name>.rank<r>.txt``; return the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.rank{_rank()}.txt"
    path.write_text(report(gm) + "\n")
    return [path]
