"""What a compiled graph's schedule looks like, as text and files (``make_backend(dump_dir=...)``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from torch import fx

from fsdp_compile.inspection.cost import Hardware
from fsdp_compile.inspection.timeline import Timeline, chrome_trace, simulate, table, write_png

__all__ = ["report", "dump"]


def report(gm: fx.GraphModule, hw: Hardware, timeline: Timeline | None = None) -> str:
    """The schedule table of one compiled graph with estimated times on ``hw``, and a summary."""
    timeline = timeline if timeline is not None else simulate(gm, hw)
    s = timeline.summary()
    return (
        f"{table(gm, timeline)}\n"
        f"estimated on {hw.name}: {1e3 * s['step_seconds']:.3f} ms, exposed communication "
        f"{1e3 * s['exposed_comm_seconds']:.3f} ms ({s['exposed_comm_pct']:.1f}%), peak bytes in flight "
        f"{s['peak_bytes_in_flight']}"
    )


def dump(gm: fx.GraphModule, directory: str | os.PathLike[str], name: str, hw: Hardware) -> list[Path]:
    """Write ``gm``'s schedule under ``directory``: ``<name>.rank<r>.txt``, ``.json`` (Chrome trace) and
    ``.png`` (timeline, when matplotlib is installed); return the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}.rank{dist.get_rank() if dist.is_initialized() else 0}"
    timeline = simulate(gm, hw)
    paths = [out / f"{stem}.txt", out / f"{stem}.json"]
    paths[0].write_text(report(gm, hw, timeline) + "\n")
    paths[1].write_text(json.dumps(chrome_trace({name: timeline})))
    try:
        write_png({name: timeline}, out / f"{stem}.png")
        paths.append(out / f"{stem}.png")
    except RuntimeError:
        pass  # matplotlib is optional
    return paths
