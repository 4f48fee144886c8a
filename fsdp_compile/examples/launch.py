"""Run a function on several ranks in spawned processes, with a deadline and every rank's traceback.

Used by the demo, the benchmarks and the tests (gloo ranks with one worker thread per group: NOTE [one gloo
thread per group]; no torchrun needed). A rank that raises, or a run past its deadline, raises ``RankFailure``,
so a wrong schedule fails instead of hanging.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compile._compat import print_native_stacks_on_fatal_signal, serial_gloo
from fsdp_compile.safety import peers

__all__ = ["RankFailure", "run_ranks"]


class RankFailure(RuntimeError):
    """One or more ranks raised or the run timed out; the message holds every rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any,
            args: tuple, pg_timeout_s: float, threads: int, backend: str, stderr: Any) -> None:
    os.dup2(stderr.fileno(), 2)  # into the parent's _Stderr
    stderr.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    print_native_stacks_on_fatal_signal()  # a crash prints every thread's native stack ...
    faulthandler.enable()  # ... after every thread's Python stack
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(serial_gloo() if backend == "gloo" else backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        torch.manual_seed(0)  # one seed on every rank, as a training script sets (NOTE [ranks built alike])
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # by value: the process may exit before the parent maps its shared memory
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # reported to the parent, which raises
        tb = traceback.format_exc()
        try:
            peers.note_failure(f"{type(e).__name__}: {e}")  # and to the peers, so they stop waiting
        finally:
            results.put((rank, "error", tb))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_TAIL_BYTES = 1 << 18  # room for every thread's native stack after a crash


class _Stderr:
    """A rank's file descriptor 2, passed on to this process's as it comes; its last ``_TAIL_BYTES`` kept."""

    def __init__(self, ctx: Any) -> None:
        self.read_end, self.write_end = ctx.Pipe(duplex=False)
        self.tail = b""
        self.thread = threading.Thread(target=self._pump, name="run_ranks-stderr", daemon=True)

    def start(self) -> None:
        self.write_end.close()  # the rank holds its own copy: end of file when it exits
        self.thread.start()

    def _pump(self) -> None:
        fd = self.read_end.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            try:
                os.write(2, data)
            except OSError:
                pass
            self.tail = (self.tail + data)[-_TAIL_BYTES:]
        self.read_end.close()

    def text(self, wait_s: float) -> str:
        """What the rank wrote last (after up to ``wait_s`` for the rest to arrive)."""
        self.thread.join(timeout=wait_s)
        return self.tail.decode(errors="replace")


def _last_words(text: str, size: int = 12000) -> str:
    """``size`` characters of a dead rank's stderr from its fatal error (glibc's, else faulthandler's) on."""
    starts = [i for i in (text.rfind("malloc"), text.rfind("Fatal Python error")) if i >= 0]
    if not starts:
        return text[-size:]
    start = text.rfind("\n", 0, min(starts)) + 1
    return text[start:start + size]


def _collect(results: Any, world_size: int, procs: list, deadline: float, grace_s: float) -> dict[int, tuple[str, Any]]:
    got: dict[int, tuple[str, Any]] = {}
    while len(got) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=min(max(deadline - time.monotonic(), 0.01), 1.0))
            got[rank] = (status, payload)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
        if any(s == "error" for s, _ in got.values()):
            # a failed rank leaves its peers blocked in a collective: they get ``grace_s`` to report
            grace = min(deadline, time.monotonic() + grace_s)
            while len(got) < world_size and time.monotonic() < grace:
                try:
                    rank, status, payload = results.get(timeout=0.5)
                    got[rank] = (status, payload)
                except queue.Empty:
                    if all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                        break  # the rest died without a word
            break
    return got


def _how_it_ended(exitcode: int | None, hung: bool, timeout: float) -> str:
    """Why a rank sent no result."""
    if hung:
        return f"was still running when the run stopped waiting ({timeout:.0f}s, or a peer had failed): a hang; killed"
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        why = {"SIGKILL": "most often the kernel's out-of-memory killer (see `dmesg`); fewer ranks or a smaller "
                          "model need less memory",
               "SIGSEGV": "a crash in native code; every thread's Python and native stack is in the rank's stderr",
               "SIGABRT": "an abort in native code; every thread's Python and native stack is in the rank's stderr"}
        return f"died of {name} without reporting: {why.get(name, 'killed by a signal')}"
    return f"exited with code {exitcode} without reporting (it called exit, or its interpreter failed)"


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0,
              pg_timeout_s: float = 120.0, threads: int | None = None, backend: str = "gloo",
              grace_s: float = 10.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks, torch seeded alike; return results
    by rank.

    ``fn`` must be importable. ``threads``: intra-op threads per rank (default: the cores divided among the
    ranks). With ``backend="nccl"`` rank ``r`` uses GPU ``r``. Results travel by value (``torch.save``). Once a
    rank has failed, the others get ``grace_s`` seconds before they are killed. A rank that died without
    reporting is described by the end of its stderr.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    errs = [_Stderr(ctx) for _ in range(world_size)]
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args, pg_timeout_s, threads, backend,
                                          errs[r].write_end), daemon=True)
        for r in range(world_size)
    ]
    for p, err in zip(procs, errs):
        p.start()
        err.start()
    try:
        got = _collect(results, world_size, procs, time.monotonic() + timeout, grace_s)
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        until = time.monotonic() + 2.0  # the ranks' last words
        for err in errs:
            err.thread.join(timeout=max(0.0, until - time.monotonic()))
    failed = {r: payload for r, (s, payload) in got.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in got]
    if failed or missing:
        parts = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failed.items())]
        died = [r for r in missing if r not in hung and (procs[r].exitcode or 0) < 0]
        last = {r: errs[r].text(wait_s=5.0) for r in died}
        parts += [f"--- rank {r} {_how_it_ended(procs[r].exitcode, r in hung, timeout)}"
                  + (f"\n    its stderr ended with:\n{_last_words(last[r])}" if last.get(r) else "") for r in missing]
        raise RankFailure("\n".join(parts))
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
