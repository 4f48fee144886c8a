"""Schedules in logs: ``TORCH_LOGS=fsdp_schedule`` and tlparse (structured trace) entries."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch._logging

import fsdp_compile_torch_logs

from ._compat import getArtifactLogger

__all__ = ["log_schedule"]

fsdp_compile_torch_logs.register()  # again, in case torch was imported without the entry point
# A child of the "torch" logger, so that the handlers TORCH_LOGS configures print it.
_log = getArtifactLogger("torch.fsdp_compile", fsdp_compile_torch_logs.ARTIFACT)


def log_schedule(kind: str, text_fn: Callable[[], str]) -> None:
    """Log a compiled graph's schedule table to the artifact logger and to the structured trace.

    ``text_fn`` is called only when one of them is enabled.
    """
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("fsdp-compile %s schedule:\n%s", kind, text_fn())
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"fsdp_schedule_{kind}", "encoding": "string"},
        payload_fn=text_fn,
    )
