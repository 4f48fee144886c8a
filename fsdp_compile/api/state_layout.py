"""A sharded model's state dict under the user's names, and shards <-> DTensors: what the sharded
(``checkpoint.py``) and the full (``full_state.py``) state dicts share.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_compile._compat import is_compiled_module
from fsdp_compile.api.groups import FsdpGroups
from fsdp_compile.api.markers import shard_rows
from fsdp_compile.api.units import ShardedParam, unit_of

__all__ = ["Entry", "few", "gather_full", "layout", "row_range", "to_dtensor", "to_padded", "unwrap"]


@dataclass(eq=False)
class Entry:
    """One distinct tensor of the model's state dict: every name it has and, if sharded, its param."""

    tensor: Tensor
    param: ShardedParam | None
    names: list[str] = field(default_factory=list)  # user names, the first one canonical
    raw_keys: list[str] = field(default_factory=list)  # the same, as ``model.state_dict()`` spells them


def unwrap(model: nn.Module) -> nn.Module:
    """The module itself, not ``torch.compile``'s wrapper (whose keys start with ``_orig_mod.``)."""
    while is_compiled_module(model):
        model = model._orig_mod
    return model


def layout(model: nn.Module, caller: str) -> tuple[list[Entry], list[tuple[str, Entry]]]:
    """The entries, and (name, entry) for every name (aliases included) in unsharded ``state_dict()`` order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: expected the sharded nn.Module, got {type(model).__name__}.")
    model = unwrap(model)
    managed = {id(sp.shard): sp for m in model.modules() if (u := unit_of(m)) is not None for sp in u.params}
    if not managed:
        raise ValueError(f"{caller}: {type(model).__name__} has no fully_shard units; call fully_shard(block, "
                         "groups=groups) on its blocks and then fully_shard(model, groups=groups) before "
                         "checkpointing (an unsharded model needs no conversion: use model.state_dict() / "
                         "load_state_dict()).")
    entries: dict[int, Entry] = {}
    order: list[tuple[str, Entry]] = []
    for raw_key, tensor in model.state_dict(keep_vars=True).items():
        sp = managed.get(id(tensor))
        name = raw_key
        if sp is not None:  # a.b.parametrizations.weight.original -> a.b.weight
            parts = raw_key.split(".")
            assert parts[-3:][::2] == ["parametrizations", "original"], raw_key
            name = ".".join(parts[:-3] + [parts[-2]])
        entry = entries.setdefault(id(tensor), Entry(tensor, sp))
        entry.names.append(name)
        entry.raw_keys.append(raw_key)
        order.append((name, entry))
    # state_dict() puts each module's params before its buffers; parametrize moved sharded params into a
    # ``parametrizations`` child, after the buffers. Sort back (stably).
    module_index: dict[str, int] = {}
    for path, _ in model.named_modules(remove_duplicate=False):
        module_index.setdefault(path, len(module_index))

    def position(item: tuple[str, Entry]) -> tuple[int, int]:
        path = item[0].rsplit(".", 1)[0] if "." in item[0] else ""
        return module_index.get(path, len(module_index)), 0 if isinstance(item[1].tensor, nn.Parameter) else 1

    return list(entries.values()), sorted(order, key=position)

_meshes: weakref.WeakKeyDictionary[FsdpGroups, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def _mesh(groups: FsdpGroups, device_type: str) -> DeviceMesh:
    """The mesh DTensors of ``groups``' params live on: 1-D (shard), or 2-D (replicate, shard) for HSDP."""
    per_device = _meshes.setdefault(groups, {})
    if device_type in per_device:
        return per_device[device_type]
    if groups.replicate is None:
        mesh = DeviceMesh.from_group(groups.all_gather, device_type, mesh_dim_names=("shard",))
    else:  # row i of the mesh is the shard group of replica i
        rows: list[Any] = [None] * groups.replicate_size
        dist.all_gather_object(rows, dist.get_process_group_ranks(groups.all_gather), group=groups.replicate)
        mesh = DeviceMesh.from_group([groups.replicate, groups.all_gather], device_type, mesh=torch.tensor(rows),
                                     mesh_dim_names=("replicate", "shard"))
    per_device[device_type] = mesh
    return mesh


def row_range(sp: ShardedParam) -> tuple[int, int]:
    """``[start, stop)``: the real (unpadded) rows of the full param that this rank's shard holds."""
    n = sp.full_shape[0] if sp.full_shape else 1
    rows = shard_rows(n, sp.unit.groups.shard_size)
    start = min(sp.unit.groups.all_gather.rank() * rows, n)
    return start, min(start + rows, n)


def to_dtensor(sp: ShardedParam, padded: Tensor) -> DTensor:
    """A DTensor of ``sp.full_shape`` from a tensor shaped like ``sp``'s padded shard."""
    groups = sp.unit.groups
    mesh = _mesh(groups, padded.device.type)
    padded = padded.detach()
    if not sp.full_shape:
        # A 0-d param is one row on group rank 0 and cannot be Shard(0): every rank gets it, replicated.
        value = padded[:1].clone()
        if groups.shard_size > 1:
            dist.broadcast(value, group=groups.all_gather, group_src=0)
        local, placements = value.reshape(()), [Replicate()] * mesh.ndim
    else:
        start, stop = row_range(sp)
        local, placements = padded[: stop - start], [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(
        local, mesh, placements, run_check=False,
        shape=torch.Size(sp.full_shape), stride=torch.empty(sp.full_shape, device="meta").stride(),
    )


def to_padded(sp: ShardedParam, value: Tensor, name: str) -> Tensor:
    """This rank's zero-padded shard of ``value``: a DTensor as :func:`to_dtensor` makes it, or a plain
    tensor of the full shape."""
    full = torch.Size(sp.full_shape)
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}: expected a tensor of shape {tuple(full)}, got {type(value).__name__}.")
    if value.shape != full:
        raise ValueError(f"{name}: the state dict holds shape {tuple(value.shape)} but the model's parameter has "
                         f"shape {tuple(full)}; the checkpoint comes from a different model: build it with the "
                         "config it was saved with.")
    start, stop = row_range(sp)
    if isinstance(value, DTensor):
        if not full:  # replicated (a 0-d DTensor cannot be sharded)
            local = value.to_local().reshape(1)[start:stop]
        else:
            want = ((stop - start, *full[1:]), (start,) + (0,) * (len(full) - 1))
            got = compute_local_shape_and_global_offset(full, value.device_mesh, value.placements)
            if (tuple(got[0]), tuple(got[1])) != want:
                raise ValueError(f"{name}: the DTensor's local part is rows at offset {got[1]} of shape {got[0]}, but "
                                 f"this rank holds {want[0]} at offset {want[1]}; load into the dict that "
                                 "get_model_state_dict / get_optimizer_state_dict returned for this model (dcp.load "
                                 "reshards into it), or pass plain full tensors.")
            local = value.to_local()
    else:
        local = value.reshape(1)[start:stop] if not full else value[start:stop]
    out = torch.zeros(sp.shard.shape, dtype=sp.shard.dtype, device=sp.shard.device)
    out[: local.shape[0]].copy_(local)
    return out


def gather_full(sp: ShardedParam) -> Tensor:
    """The full parameter (unpadded) from every rank's shard; collective."""
    groups, padded = sp.unit.groups, sp.shard.detach().contiguous()
    n = sp.full_shape[0] if sp.full_shape else 1
    if groups.shard_size > 1:
        shard, padded = padded, padded.new_empty(padded.shape[0] * groups.shard_size, *padded.shape[1:])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(padded, shard, group=groups.all_gather)
        if padded.shape[0] == n:  # no padding rows: the gathered buffer is the full param, no copy
            return padded.view(sp.full_shape)
    # A copy: of the shard itself (one rank), or of the real rows alone (not the whole storage).
    return padded[:n].reshape(sp.full_shape).clone()


def few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})" if names else "[]"
