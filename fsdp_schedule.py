"""Registers fsdp-compile's ``TORCH_LOGS`` artifact while torch imports (a ``torch.backends`` entry point).

``TORCH_LOGS`` is validated when torch is imported, before any user code runs. Torch 2.13 loads the
``torch.backends`` entry points just before that, so registering here makes ``TORCH_LOGS=fsdp_schedule``
a known artifact. Torch 2.11 validates first and loads entry points after; there a name passes if it is
a registered artifact *or a module that can be found*, which is why this module is named after the
artifact: the setting passes validation as a module name, and :func:`register`, run later as the entry
point, then switches the artifact on. The module is separate from the ``fsdp_compile`` package, whose
import would need the rest of torch.
"""

from __future__ import annotations

import os

ARTIFACT = "fsdp_schedule"


def _requested() -> bool:
    """Whether ``TORCH_LOGS`` names the artifact (``+`` and ``-`` prefixes allowed, as torch allows)."""
    return any(name.strip().lstrip("+-") == ARTIFACT for name in os.environ.get("TORCH_LOGS", "").split(","))


def register() -> None:
    """Register the ``fsdp_schedule`` logging artifact (idempotent) and switch it on where ``TORCH_LOGS``
    names it but torch parsed the setting before the artifact existed (torch 2.11)."""
    from torch._logging import _internal

    _internal.register_artifact(
        ARTIFACT,
        "fsdp-compile: the scheduled collectives of each compiled graph, with estimated times",
        off_by_default=True,
    )
    if _requested() and not _internal.log_state.is_artifact_enabled(ARTIFACT):
        _internal.log_state.enable_artifact(ARTIFACT)
