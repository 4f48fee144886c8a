"""Full (unsharded) state dicts: export on rank 0, and load what rank 0 alone holds.

NOTE [rank-0 broadcast]: a full checkpoint is read on rank 0 alone; the others pass ``{}``. Rank 0 first
tells every rank which tensors it holds (names, shapes, dtypes, missing and unexpected keys) in one
``broadcast_object_list``; then each tensor travels alone, in model order, through one ``dist.broadcast``
into one reused staging buffer (the largest tensor's bytes), and each rank copies its rows into its shard
in place (so a unit's flat stays the parameters' storage) before the next. A rank's extra memory is that
buffer, never the model. Torch calls this ``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_compile.api.state_layout import Entry, few, gather_full, layout, row_range

__all__ = ["broadcast_full_state_dict", "full_state_dict", "raise_on_every_rank"]


def full_state_dict(entries: list[Entry], order: list[tuple[str, Entry]], rank0_only: bool,
                    cpu_offload: bool) -> dict[str, Tensor]:
    """Plain full tensors under the unsharded model's names; collective. ``rank0_only``: the others get ``{}``."""
    keep = not rank0_only or dist.get_rank() == 0
    values: dict[int, Tensor] = {}
    for e in entries:
        value = gather_full(e.param) if e.param is not None else e.tensor.detach()
        if keep:
            values[id(e)] = value.cpu() if cpu_offload else value
    return {name: values[id(e)] for name, e in order if id(e) in values} if keep else {}


def _plan(entries: list[Entry], known: set[str], state_dict: Mapping[str, Any]) -> tuple[list, list[str], list[str], str]:
    """On rank 0: (entry index, name, shape, dtype) of each tensor to send, the missing and unexpected keys,
    and an error to raise on every rank ("" when none)."""
    plan: list[tuple[int, str, tuple[int, ...], torch.dtype]] = []
    missing: list[str] = []
    for i, e in enumerate(entries):
        name = next((n for n in e.names if n in state_dict), None)
        if name is None:
            missing.append(e.names[0])
            continue
        value = state_dict[name]
        if not isinstance(value, Tensor) or isinstance(value, DTensor):
            return [], [], [], (f"{name!r} is a {type(value).__name__}; broadcast_from_rank0 takes plain full tensors "
                                "on rank 0 (torch.load / safetensors.torch.load_file give them).")
        want = tuple(e.param.full_shape) if e.param is not None else tuple(e.tensor.shape)
        if tuple(value.shape) != want:
            return [], [], [], (f"{name!r} has shape {tuple(value.shape)} in the state dict but {want} in the model; "
                                "the checkpoint comes from a different model: build it with the config it was saved with.")
        plan.append((i, name, want, value.dtype))
    unexpected = [k for k in state_dict if k not in known]
    return plan, missing, unexpected, ""


def raise_on_every_rank(error: BaseException | None, what: str) -> None:
    """Collective: raise rank 0's ``error`` (the others pass ``None``) on every rank, as the same builtin
    type (else ``RuntimeError``), saying ``what`` rank 0 did."""
    box: list[Any] = [None if error is None else (type(error).__name__, str(error))]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return
    name, text = box[0]
    kind = getattr(builtins, name, None)
    kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
    message = text if text.startswith(what.split(":")[0]) else f"{what}: rank 0 failed: {name}: {text}"
    raise kind(message) from error


def broadcast_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool, *,
                              caller: str = "") -> _IncompatibleKeys:
    """(NOTE [rank-0 broadcast]) Load the full ``state_dict`` global rank 0 holds (the others pass ``{}``)
    into ``model``; collective. An error found on any rank is raised on every rank."""
    caller = caller or "set_model_state_dict(broadcast_from_rank0=True)"
    entries, order = layout(model, caller)
    rank = dist.get_rank()
    # A rank other than 0 given entries: every rank raises.
    given: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(given, len(state_dict) if rank != 0 else 0)
    ranks = [r for r, n in enumerate(given) if n]
    if ranks:
        raise ValueError(f"{caller}: rank(s) {ranks} were given {[given[r] for r in ranks]} entries; only rank 0 "
                         "reads the checkpoint, every other rank passes {} (what it holds would be overwritten "
                         "anyway).")
    header: list[Any] = [None]
    if rank == 0:
        header[0] = _plan(entries, {name for name, _ in order}, state_dict)
    dist.broadcast_object_list(header, src=0)
    plan, missing, unexpected, error = header[0]
    if error:
        raise ValueError(f"{caller}: {error}")
    if strict and (missing or unexpected):
        raise ValueError(f"{caller}: missing keys {few(missing)}, unexpected keys {few(unexpected)} in rank 0's "
                         "state dict; pass StateDictOptions(strict=False) to load a partial state dict.")
    largest = max((math.prod(shape) * dtype.itemsize for _, _, shape, dtype in plan), default=0)
    staging: dict[torch.device, Tensor] = {}  # bytes for the largest tensor, one buffer per device, reused
    with torch.no_grad():
        for index, name, shape, dtype in plan:
            e = entries[index]
            target = (e.param.shard if e.param is not None else e.tensor).detach()
            held = state_dict[name] if rank == 0 else None
            if held is not None and held.device == target.device and held.is_contiguous():
                buffer = held  # sent from where it lies
            else:
                if target.device not in staging:
                    staging[target.device] = torch.empty(largest, dtype=torch.uint8, device=target.device)
                nbytes = math.prod(shape) * dtype.itemsize
                buffer = staging[target.device][:nbytes].view(dtype).view(shape)
                if held is not None:
                    buffer.copy_(held)
            dist.broadcast(buffer, src=0)
            if e.param is None:
                target.copy_(buffer)
                continue
            start, stop = row_range(e.param)
            rows = buffer.reshape(1) if not shape else buffer
            target[: stop - start].copy_(rows[start:stop])
            target[stop - start:].zero_()  # NOTE [padding]
    return _IncompatibleKeys(missing, unexpected)
