"""DCP checkpoints that a crash during a save cannot destroy: a new directory per step, made current last.

NOTE [checkpoint directories]: ``dcp.save`` rewrites its directory's files in place, so a rank killed while
saving into one directory again leaves a truncated file, or an old file beside new ones (a checkpoint that
silently mixes two steps). So :func:`save_checkpoint` writes each step into its own directory
(``root/step-000000500``), and once every rank has finished, rank 0 names it in ``root/latest`` (written to
``latest.tmp``, then renamed: atomic). A crash leaves ``root/latest`` naming the previous complete
checkpoint; a directory never made current is ignored, and removed when its step is saved again.

    ckpt = latest_checkpoint("checkpoints")          # None on the first start
    if ckpt is not None:
        dcp.load(state, checkpoint_id=ckpt)
    ...
    save_checkpoint(state, "checkpoints", step)       # every rank, in the same order
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["latest_checkpoint", "save_checkpoint"]

_POINTER = "latest"
_STEP = re.compile(r"step-(\d+)$")


def _step_dirs(root: Path) -> dict[int, Path]:
    return {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agreed(value: Any) -> Any:
    """Rank 0's ``value`` (an object, or the exception it raised) on every rank; raised where it is one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    if isinstance(value, BaseException):
        raise value
    return value


def save_checkpoint(state_dict: dict[str, Any], root: str | os.PathLike[str], step: int, *, keep: int = 2,
                    **save_kw: Any) -> str:
    """Save ``state_dict`` with ``dcp.save`` into ``root/step-<step>``, make it current once every rank has
    written (NOTE [checkpoint directories]), then keep only the ``keep`` newest complete ones. Collective.
    ``save_kw`` goes to ``dcp.save``. Returns the directory."""
    if keep < 1:
        raise ValueError(f"save_checkpoint: keep={keep}; keep at least 1 checkpoint (2 keeps the previous one too).")
    root = Path(root)
    target = root / f"step-{step:09d}"
    prepared: Any = None
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if target.exists():  # a save of this step that crashed, or a rerun
                if _current(root) == target.name:
                    raise ValueError(f"save_checkpoint: {target} is the current checkpoint; save a later step, or "
                                     "delete it first.")
                shutil.rmtree(target)
        except Exception as e:  # raised on every rank (the others would hang in dcp.save)
            prepared = RuntimeError(f"save_checkpoint: rank 0 could not prepare {target}: {type(e).__name__}: {e}")
    _agreed(prepared)
    dcp.save(state_dict, checkpoint_id=str(target), **save_kw)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # every rank has returned from dcp.save: its part is written
    outcome: Any = None
    if _rank() == 0:
        try:
            tmp = root / f"{_POINTER}.tmp"
            with open(tmp, "w") as f:
                f.write(target.name)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, root / _POINTER)
            _prune(root, step, keep)
        except Exception as e:
            outcome = RuntimeError(f"save_checkpoint: rank 0 could not make {target} current: {type(e).__name__}: {e}")
    _agreed(outcome)
    return str(target)


def _current(root: Path) -> str | None:
    pointer = root / _POINTER
    return pointer.read_text().strip() if pointer.exists() else None


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete the checkpoints before ``step`` but the ``keep - 1`` newest complete ones."""
    older = sorted((s, p) for s, p in _step_dirs(root).items() if s < step)
    complete = [s for s, p in older if (p / ".metadata").exists()]
    kept = set(complete[max(0, len(complete) - (keep - 1)):]) if keep > 1 else set()
    for s, p in older:
        if s not in kept:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint :func:`save_checkpoint` completed under ``root`` (for ``dcp.load``), or ``None``.
    Rank 0 reads, every rank gets its answer (collective when a process group is initialised)."""
    found: Any = None
    if _rank() == 0:
        try:
            found = _read_latest(Path(root))
        except Exception as e:
            found = e
    return _agreed(found)


def _read_latest(root: Path) -> str | None:
    name = _current(root) if root.is_dir() else None
    if name is None:
        leftovers = sorted(_step_dirs(root)) if root.is_dir() else []
        if leftovers:
            raise FileNotFoundError(f"latest_checkpoint: {root} holds {len(leftovers)} step directories but no "
                                    f"'{_POINTER}' file naming the current one: none was completed by "
                                    "save_checkpoint (or the file was deleted). Pass the directory to dcp.load "
                                    "yourself if you know it is complete.")
        return None
    target = root / name
    if not _STEP.match(name) or not (target / ".metadata").exists():
        raise FileNotFoundError(f"latest_checkpoint: {root / _POINTER} names {name!r}, which is not a complete "
                                "checkpoint (no .metadata): the directory was moved or deleted.")
    return str(target)
