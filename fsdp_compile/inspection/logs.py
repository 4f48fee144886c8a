"""Schedules in logs: ``TORCH_LOGS=fsdp_compile`` and tlparse (structured trace) entries.

NOTE [schedules in TORCH_LOGS]: the schedule table goes to this module's logger at INFO, so
``TORCH_LOGS=fsdp_compile`` prints it with the package's other INFO lines and
``TORCH_LOGS=fsdp_compile.inspection.logs`` prints the tables alone (or, in code,
``logging.getLogger("fsdp_compile").setLevel(logging.INFO)``). Only a level set on these loggers turns the
tables on, not one inherited from the root logger, since a table costs a compile from the cache.
Text logs come from rank 0 unless ``FSDP_COMPILE_LOG_RANKS`` says ``all`` or lists ranks (``0,3``); the
structured trace is written on every rank, as tlparse reads one file per rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch.distributed as dist

from fsdp_compile._compat import trace_structured_artifact

__all__ = ["log_schedule", "LOG_RANKS_ENV", "logs_on_rank", "schedule_logged"]

LOG_RANKS_ENV = "FSDP_COMPILE_LOG_RANKS"

_log = logging.getLogger(__name__)


def logs_on_rank(rank: int, setting: str | None) -> bool:
    """Whether ``rank`` logs schedules under ``setting`` (``FSDP_COMPILE_LOG_RANKS``: empty, ``all`` or ranks)."""
    if not setting:
        return rank == 0
    if setting.strip().lower() == "all":
        return True
    try:
        return rank in {int(r) for r in setting.split(",") if r.strip()}
    except ValueError:
        raise ValueError(f"{LOG_RANKS_ENV}={setting!r}: use 'all' or comma-separated ranks such as '0,3'") from None


def schedule_logged() -> bool:
    """Whether schedules are logged here: a level at or below INFO set on this module's logger or on a
    parent below the root (NOTE [schedules in TORCH_LOGS])."""
    logger: logging.Logger | None = _log
    while logger is not None and logger.parent is not None:  # (the root logger has no parent)
        if logger.level != logging.NOTSET:
            return logger.level <= logging.INFO
        logger = logger.parent
    return False


def log_schedule(kind: str, text_fn: Callable[[], str]) -> None:
    """Log a schedule table to this module's logger and to the structured trace; ``text_fn`` is called
    only when one of them is enabled."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if schedule_logged() and logs_on_rank(rank, os.environ.get(LOG_RANKS_ENV)):
        _log.info("fsdp-compile %s schedule (rank %d):\n%s", kind, rank, text_fn())
    trace_structured_artifact(f"fsdp_schedule_{kind}", text_fn)
