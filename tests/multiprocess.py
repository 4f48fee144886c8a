"""Run a function on several gloo ranks in spawned processes, with a deadline and every rank's traceback.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each initialising a gloo process
group and calling ``fn(rank, world_size, *args)``; it returns the per-rank results in rank order.
A rank that raises makes it raise ``RankFailure`` carrying each failed rank's traceback; a run that
passes ``timeout`` seconds is killed and raises too, so a wrong schedule fails instead of hanging.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankFailure", "run_ranks"]


class RankFailure(AssertionError):
    """One or more ranks raised or the run timed out; the message holds every rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any,
            args: tuple, pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # by value: the process may exit before the parent reads shared memory
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0,
              pg_timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args, pg_timeout_s), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
                got[rank] = (status, payload)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
            if any(s == "error" for s, _ in got.values()):
                # Give the other ranks a moment to report their own error, then stop waiting.
                grace = time.monotonic() + 10
                while len(got) < world_size and time.monotonic() < grace:
                    try:
                        rank, status, payload = results.get(timeout=0.5)
                        got[rank] = (status, payload)
                    except queue.Empty:
                        pass
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: payload for r, (s, payload) in got.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in got]
    if failed or missing:
        parts = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failed.items())]
        if missing:
            parts.append(f"--- ranks {missing} did not finish within {timeout:.0f}s (killed; a hang or a crash)")
        raise RankFailure("\n".join(parts))
    import torch

    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
