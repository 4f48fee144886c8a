"""Checkpoints of sharded models with ``torch.distributed.checkpoint`` (DCP), at any world size.

After ``fully_shard``, ``model.state_dict()`` holds padded local shards under parametrization names
(``layers.0.attn.wq.parametrizations.weight.original``). These functions, our counterparts of
``torch.distributed.checkpoint.state_dict``, use the user's names (``layers.0.attn.wq.weight``) and
give each sharded param (and each shard-shaped optimizer state tensor) as a ``DTensor`` of the full
shape whose local part is this rank's *unpadded* rows: ``Shard(0)`` on a mesh of the all-gather group,
``(Replicate(), Shard(0))`` on the (replicate, shard) mesh of HSDP. Our split (``ceil(n / world)`` rows
per rank, the last ranks short or empty: NOTE [padding] in ``ops``) is exactly DTensor's ``Shard(0)``
chunking, so DCP reshards to any world size. Buffers and params no unit manages stay plain tensors.

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=path)
    # any world size, a freshly built and sharded model with its optimizer:
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)  # fills the dicts in place
    set_model_state_dict(model, sd["model"]); set_optimizer_state_dict(model, opt, sd["optim"])

The ``get_*`` functions may run collectives (a 0-d param is broadcast, full params are gathered, an
HSDP mesh is built once per ``FsdpGroups``): call them on every rank, in the same order.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.modules.module import _IncompatibleKeys

from .groups import FsdpGroups
from .ops import shard_rows
from .sharding import ShardedParam, unit_of

__all__ = ["get_full_model_state_dict", "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict",
           "set_optimizer_state_dict"]


# --- Layout: the distinct tensors of a model's state dict and their user-facing names ---


@dataclass(eq=False)
class _Entry:
    """One distinct tensor of the model's state dict: every name it has and, if sharded, its param."""

    tensor: Tensor
    param: ShardedParam | None
    names: list[str] = field(default_factory=list)  # user names, the first one canonical
    raw_keys: list[str] = field(default_factory=list)  # the same, as ``model.state_dict()`` spells them


def _unwrap(model: nn.Module) -> nn.Module:
    """The module itself, not ``torch.compile``'s wrapper (whose keys start with ``_orig_mod.``)."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def _layout(model: nn.Module, caller: str) -> tuple[list[_Entry], list[tuple[str, _Entry]]]:
    """The entries, and (name, entry) for every name (aliases included) in unsharded ``state_dict()`` order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: expected the sharded nn.Module, got {type(model).__name__}.")
    model = _unwrap(model)
    managed = {id(sp.shard): sp for m in model.modules() if (u := unit_of(m)) is not None for sp in u.params}
    if not managed:
        raise ValueError(
            f"{caller}: {type(model).__name__} has no fully_shard units; call fully_shard(block, groups=groups) "
            "on its blocks and then fully_shard(model, groups=groups) before checkpointing (an unsharded "
            "model needs no conversion: use model.state_dict() / load_state_dict())."
        )
    entries: dict[int, _Entry] = {}
    order: list[tuple[str, _Entry]] = []
    for raw_key, tensor in model.state_dict(keep_vars=True).items():
        sp = managed.get(id(tensor))
        name = raw_key
        if sp is not None:  # a.b.parametrizations.weight.original -> a.b.weight
            parts = raw_key.split(".")
            assert parts[-3:][::2] == ["parametrizations", "original"], raw_key
            name = ".".join(parts[:-3] + [parts[-2]])
        entry = entries.setdefault(id(tensor), _Entry(tensor, sp))
        entry.names.append(name)
        entry.raw_keys.append(raw_key)
        order.append((name, entry))
    # state_dict() walks modules in pre-order, each one's params before its buffers; parametrize moved
    # sharded params into a ``parametrizations`` child, after the buffers. Sort back (stably).
    module_index: dict[str, int] = {}
    for path, _ in model.named_modules(remove_duplicate=False):
        module_index.setdefault(path, len(module_index))

    def position(item: tuple[str, _Entry]) -> tuple[int, int]:
        path = item[0].rsplit(".", 1)[0] if "." in item[0] else ""
        return module_index.get(path, len(module_index)), 0 if isinstance(item[1].tensor, nn.Parameter) else 1

    return list(entries.values()), sorted(order, key=position)


# --- Shards <-> DTensors ---

_meshes: weakref.WeakKeyDictionary[FsdpGroups, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def _mesh(groups: FsdpGroups, device_type: str) -> DeviceMesh:
    """The mesh DTensors of ``groups``' params live on: 1-D (shard), or 2-D (replicate, shard) for HSDP."""
    per_device = _meshes.setdefault(groups, {})
    if device_type in per_device:
        return per_device[device_type]
    if groups.replicate is None:
        mesh = DeviceMesh.from_group(groups.all_gather, device_type, mesh_dim_names=("shard",))
    else:  # row i of the mesh is the shard group of replica i: collect the rows over the replicate group
        rows: list[Any] = [None] * groups.replicate_size
        dist.all_gather_object(rows, dist.get_process_group_ranks(groups.all_gather), group=groups.replicate)
        mesh = DeviceMesh.from_group([groups.replicate, groups.all_gather], device_type, mesh=torch.tensor(rows),
                                     mesh_dim_names=("replicate", "shard"))
    per_device[device_type] = mesh
    return mesh


def _row_range(sp: ShardedParam) -> tuple[int, int]:
    """``[start, stop)``: the real (unpadded) rows of the full param that this rank's shard holds."""
    n = sp.full_shape[0] if sp.full_shape else 1
    rows = shard_rows(n, sp.unit.groups.shard_size)
    start = min(sp.unit.groups.all_gather.rank() * rows, n)
    return start, min(start + rows, n)


def _to_dtensor(sp: ShardedParam, padded: Tensor) -> DTensor:
    """A DTensor of ``sp.full_shape`` from a tensor shaped like ``sp``'s padded shard (param or state)."""
    groups = sp.unit.groups
    mesh = _mesh(groups, padded.device.type)
    padded = padded.detach()
    if not sp.full_shape:
        # A 0-d param is one row on group rank 0 (zeros elsewhere), and a 0-d tensor cannot be
        # Shard(0): give every rank the value and call it replicated.
        value = padded[:1].clone()
        if groups.shard_size > 1:
            dist.broadcast(value, group=groups.all_gather, group_src=0)
        local, placements = value.reshape(()), [Replicate()] * mesh.ndim
    else:
        start, stop = _row_range(sp)
        local, placements = padded[: stop - start], [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(
        local, mesh, placements, run_check=False,
        shape=torch.Size(sp.full_shape), stride=torch.empty(sp.full_shape, device="meta").stride(),
    )


def _to_padded(sp: ShardedParam, value: Tensor, name: str) -> Tensor:
    """This rank's zero-padded shard of ``value``: a DTensor laid out as ``_to_dtensor`` makes it, or a
    plain tensor of the full shape."""
    full = torch.Size(sp.full_shape)
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}: expected a tensor of shape {tuple(full)}, got {type(value).__name__}.")
    if value.shape != full:
        raise ValueError(
            f"{name}: the state dict holds shape {tuple(value.shape)} but the model's parameter has shape "
            f"{tuple(full)}; the checkpoint comes from a different model: build it with the config it was saved with."
        )
    start, stop = _row_range(sp)
    if isinstance(value, DTensor):
        if not full:  # replicated (a 0-d DTensor cannot be sharded)
            local = value.to_local().reshape(1)[start:stop]
        else:
            want = ((stop - start, *full[1:]), (start,) + (0,) * (len(full) - 1))
            got = compute_local_shape_and_global_offset(full, value.device_mesh, value.placements)
            if (tuple(got[0]), tuple(got[1])) != want:
                raise ValueError(
                    f"{name}: the DTensor's local part is rows at offset {got[1]} of shape {got[0]}, but this "
                    f"rank holds {want[0]} at offset {want[1]}; load into the dict that get_model_state_dict / "
                    "get_optimizer_state_dict returned for this model (dcp.load reshards into it), or pass "
                    "plain full tensors."
                )
            local = value.to_local()
    else:
        local = value.reshape(1)[start:stop] if not full else value[start:stop]
    out = torch.zeros(sp.shard.shape, dtype=sp.shard.dtype, device=sp.shard.device)
    out[: local.shape[0]].copy_(local)
    return out


# --- Model ---


def get_model_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict under the user's names, for ``dcp.save`` / ``dcp.load``.

    Sharded params are DTensors of their full shape whose local part is a view of this rank's unpadded
    shard rows (call :func:`set_model_state_dict` after ``dcp.load`` all the same). Persistent buffers
    and params no unit manages are plain tensors. A tensor with several names (a module used twice, a
    shared param) appears under each, as in ``nn.Module.state_dict()``.
    """
    entries, order = _layout(model, "get_model_state_dict")
    values = {id(e): _to_dtensor(e.param, e.tensor) if e.param is not None else e.tensor.detach() for e in entries}
    return {name: values[id(e)] for name, e in order}


def set_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, Tensor], *, strict: bool = True
) -> _IncompatibleKeys:
    """Load ``state_dict`` (as :func:`get_model_state_dict` returns, or full plain tensors) into ``model``.

    Sharded params take this rank's rows, re-padded with zeros. A tensor with several names (aliases)
    needs only one of them. With ``strict`` (default) missing or unknown names raise; otherwise they
    are skipped and returned as ``(missing_keys, unexpected_keys)``.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"set_model_state_dict: state_dict must be a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}.")
    entries, order = _layout(model, "set_model_state_dict")
    known = {name for name, _ in order}
    unexpected = [k for k in state_dict if k not in known]
    missing: list[str] = []
    raw: dict[str, Tensor] = {}
    for e in entries:
        name = next((n for n in e.names if n in state_dict), None)
        if name is None:
            missing.append(e.names[0])
            continue
        value = state_dict[name]
        if e.param is not None:
            value = _to_padded(e.param, value, f"set_model_state_dict: {name!r}")
        elif isinstance(value, DTensor):
            raise TypeError(f"set_model_state_dict: {name!r} is a DTensor but the model keeps it unsharded (a buffer "
                            "or a param no fully_shard unit manages); pass a plain tensor (get_model_state_dict's).")
        for raw_key in e.raw_keys:
            raw[raw_key] = value
    if strict and (missing or unexpected):
        raise ValueError(f"set_model_state_dict: missing keys {_few(missing)}, unexpected keys {_few(unexpected)}. "
                         "Fill the dict get_model_state_dict(model) returns (dcp.load(sd, ...) does), or pass "
                         "strict=False to load a partial state dict.")
    _unwrap(model).load_state_dict(raw, strict=strict)
    return _IncompatibleKeys(missing, unexpected)


def _gather(sp: ShardedParam) -> Tensor:
    """The full parameter (unpadded) from every rank's shard; collective over the all-gather group."""
    groups, padded = sp.unit.groups, sp.shard.detach().contiguous()
    if groups.shard_size > 1:
        shard, padded = padded, padded.new_empty(padded.shape[0] * groups.shard_size, *padded.shape[1:])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the old name is deprecated
        gather(padded, shard, group=groups.all_gather)
    n = sp.full_shape[0] if sp.full_shape else 1
    return padded[:n].reshape(sp.full_shape).clone()


def get_full_model_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Tensor]:
    """Plain full tensors, equal to what the unsharded model's ``state_dict()`` would hold (for export).

    Every rank must call it (params are all-gathered). With ``rank0_only`` (default) only global rank 0
    gets the tensors, the others ``{}``; ``cpu_offload`` moves them to the CPU. Buffers and unmanaged
    params are the live tensors (detached), as in ``state_dict()``: clone them to keep a snapshot.
    """
    entries, order = _layout(model, "get_full_model_state_dict")
    keep = not rank0_only or dist.get_rank() == 0
    values: dict[int, Tensor] = {}
    for e in entries:
        value = _gather(e.param) if e.param is not None else e.tensor.detach()
        if keep:
            values[id(e)] = value.cpu() if cpu_offload else value
    return {name: values[id(e)] for name, e in order} if keep else {}


# --- Optimizer ---


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (for ``dcp.load`` to fill): one step at lr 0 with zero grads."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads, lrs = [p.grad for p in params], [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in (g for g in optimizer.param_groups if "lr" in g):
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if "lr" in g:
                g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def _optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer, caller: str) -> list[list[_Entry]]:
    """Per param group of ``optimizer``, each param's entry (``entry.names[0]`` names it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{caller}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    by_tensor = {id(e.tensor): e for e in _layout(model, caller)[0]}
    for p in (p for g in optimizer.param_groups for p in g["params"] if id(p) not in by_tensor):
        raise ValueError(
            f"{caller}: the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's; "
            "build the optimizer from model.parameters() after fully_shard (the params are then the shards)."
        )
    return [[by_tensor[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by param names: ``{"state": {fqn: {...}}, "param_groups": [...]}``.

    State tensors shaped like a sharded param's shard (Adam's moments, SGD's momentum) become DTensors
    of the full shape, as in :func:`get_model_state_dict`; scalars (``step``) are kept as they are.
    A fresh optimizer gets its state created first (a step at learning rate 0 with zero grads), so
    that the dict can be handed to ``dcp.load``.
    """
    groups = _optimizer_entries(model, optimizer, "get_optimizer_state_dict")
    if not optimizer.state:
        _init_optimizer_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for group, entries in zip(optimizer.param_groups, groups):
        for p, entry in zip(group["params"], entries):
            if optimizer.state.get(p):
                state[entry.names[0]] = {k: _state_out(entry, k, v) for k, v in optimizer.state[p].items()}
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [entry.names[0] for entry in entries]
        if "param_names" in saved:
            saved["param_names"] = list(saved["params"])
        param_groups.append(saved)
    return {"state": state, "param_groups": param_groups}


def _state_out(entry: _Entry, key: str, value: Any) -> Any:
    sp = entry.param
    if sp is None or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if value.shape != sp.shard.shape:
        raise ValueError(
            f"get_optimizer_state_dict: state {key!r} of {entry.names[0]!r} has shape {tuple(value.shape)}, "
            f"neither the shard's {tuple(sp.shard.shape)} nor a scalar; only element-wise optimizer state (SGD, "
            "Adam, AdamW, ...) can be resharded."
        )
    return _to_dtensor(sp, value)


def set_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load an optimizer state dict keyed by param names (as :func:`get_optimizer_state_dict` returns).

    DTensor state (or plain tensors of a param's full shape) becomes this rank's zero-padded shard;
    0-d tensors and other values are kept. The hyperparameters of each param group are restored; the
    groups must hold the same params as when saved. Params without saved state get none.
    """
    caller = "set_optimizer_state_dict"
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        got = f"keys {_few(list(state_dict))}" if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise TypeError(f"{caller}: expected a dict with 'state' and 'param_groups' (from get_optimizer_state_dict), "
                        f"got {got}.")
    groups = _optimizer_entries(model, optimizer, caller)
    saved_groups, saved_state = list(state_dict["param_groups"]), state_dict["state"]
    ours = [[e.names[0] for e in entries] for entries in groups]
    unexpected = sorted(set(saved_state) - {name for names in ours for name in names})
    if len(saved_groups) != len(groups) or unexpected or any(
        sorted(names) != sorted(saved["params"]) for names, saved in zip(ours, saved_groups)
    ):
        theirs = " | ".join(_few(list(g["params"])) for g in saved_groups)
        raise ValueError(
            f"{caller}: the optimizer's {len(groups)} param groups hold {' | '.join(_few(n) for n in ours)}, the "
            f"saved {len(saved_groups)} hold {theirs} (state for params the optimizer lacks: {_few(unexpected)}); "
            "build it with the same params and groups as the saved one."
        )
    torch_state: dict[int, dict[str, Any]] = {}
    torch_groups: list[dict[str, Any]] = []
    index = 0
    for entries, saved in zip(groups, saved_groups):
        torch_groups.append({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        torch_groups[-1]["params"] = list(range(index, index + len(entries)))
        for entry in entries:
            if entry.names[0] in saved_state:
                torch_state[index] = {k: _state_in(entry, k, v) for k, v in saved_state[entry.names[0]].items()}
            index += 1
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})


def _state_in(entry: _Entry, key: str, value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    if entry.param is not None and (isinstance(value, DTensor) or value.dim() > 0):
        return _to_padded(entry.param, value, f"set_optimizer_state_dict: state {key!r} of {entry.names[0]!r}")
    if isinstance(value, DTensor):
        raise TypeError(
            f"set_optimizer_state_dict: state {key!r} of {entry.names[0]!r} is a DTensor but the param is not "
            "sharded; pass a plain tensor, as get_optimizer_state_dict gives."
        )
    return value.detach().clone()  # the optimizer updates state in place: do not alias the caller's dict


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})" if names else "[]"
