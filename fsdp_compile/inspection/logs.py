"""Schedules in logs: ``TORCH_LOGS=fsdp_schedule`` and tlparse (structured trace) entries.

NOTE [the fsdp_schedule artifact]: ``import fsdp_compile`` registers the ``fsdp_schedule`` logging
artifact (nothing runs at ``import torch``). Torch checks ``TORCH_LOGS`` at its own import, before the
artifact exists; the setting passes that check because ``fsdp_schedule`` is also the name of an empty
top-level module (``fsdp_schedule.py``), and registering the artifact here switches it on when
``TORCH_LOGS`` names it. After import, torch's ``set_logs(modules={"fsdp_schedule": True})`` switches it
on too (``set_logs`` takes artifacts registered outside torch through ``modules``).

The text log comes from rank 0 alone by default (every rank compiles the same schedule: the agreement
check makes sure of it); ``FSDP_COMPILE_LOG_RANKS=all`` (or a list, ``0,3``) logs from other ranks
too. The structured trace is written on every rank, as tlparse reads one file per rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch.distributed as dist

from fsdp_compile._compat import getArtifactLogger, register_log_artifact, trace_structured_artifact

__all__ = ["ARTIFACT", "log_schedule", "LOG_RANKS_ENV", "logs_on_rank"]

LOG_RANKS_ENV = "FSDP_COMPILE_LOG_RANKS"
ARTIFACT = "fsdp_schedule"


def _requested() -> bool:
    """Whether ``TORCH_LOGS`` names the artifact (``+`` and ``-`` prefixes allowed, as torch allows)."""
    return any(name.strip().lstrip("+-") == ARTIFACT for name in os.environ.get("TORCH_LOGS", "").split(","))


def _register() -> None:
    """Register the artifact (NOTE [the fsdp_schedule artifact]); on where ``TORCH_LOGS`` names it."""
    register_log_artifact(ARTIFACT,
                          "fsdp-compile: the scheduled collectives of each compiled graph, with estimated times",
                          enable=_requested())


_register()
# A child of the "torch" logger, so that the handlers TORCH_LOGS configures print it.
_log = getArtifactLogger("torch.fsdp_compile", ARTIFACT)


def logs_on_rank(rank: int, setting: str | None) -> bool:
    """Whether ``rank`` logs schedules under ``setting`` (the value of ``FSDP_COMPILE_LOG_RANKS``):
    ``None`` or empty: rank 0; ``all``: every rank; else a comma-separated list of ranks."""
    if not setting:
        return rank == 0
    if setting.strip().lower() == "all":
        return True
    try:
        return rank in {int(r) for r in setting.split(",") if r.strip()}
    except ValueError:
        raise ValueError(f"{LOG_RANKS_ENV}={setting!r}: use 'all' or comma-separated ranks such as '0,3'") from None


def schedule_logged() -> bool:
    """Whether schedules are logged here (``TORCH_LOGS=fsdp_schedule``)."""
    return _log.isEnabledFor(logging.DEBUG)


def log_schedule(kind: str, text_fn: Callable[[], str]) -> None:
    """Log a compiled graph's schedule table to the artifact logger (on the ranks of ``logs_on_rank``)
    and to the structured trace (every rank).

    ``text_fn`` is called only when one of them is enabled.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _log.isEnabledFor(logging.DEBUG) and logs_on_rank(rank, os.environ.get(LOG_RANKS_ENV)):
        _log.debug("fsdp-compile %s schedule (rank %d):\n%s", kind, rank, text_fn())
    trace_structured_artifact(f"fsdp_schedule_{kind}", text_fn)
