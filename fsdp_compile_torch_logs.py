"""Registers fsdp-compile's TORCH_LOGS artifact while torch imports (a ``torch.backends`` entry point).

``TORCH_LOGS`` is validated when torch is imported, before any user code runs; torch loads the
``torch.backends`` entry points just before that, so registering here lets ``TORCH_LOGS=fsdp_schedule``
work. This module is deliberately separate from the ``fsdp_compile`` package, whose import would need
the rest of torch.
"""

from __future__ import annotations

ARTIFACT = "fsdp_schedule"


def register() -> None:
    """Register the ``fsdp_schedule`` logging artifact (idempotent)."""
    from torch._logging._internal import register_artifact

    register_artifact(
        ARTIFACT,
        "fsdp-compile: the scheduled collectives of each compiled graph, with estimated times",
        off_by_default=True,
    )
