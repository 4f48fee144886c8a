"""Checkpoints of sharded models with ``torch.distributed.checkpoint`` (DCP), at any world size.

Counterparts of ``torch.distributed.checkpoint.state_dict``'s functions (same signatures), under the user's
names. A sharded param (or shard-shaped optimizer state) is a ``DTensor`` of the full shape whose local
part is this rank's unpadded rows: ``Shard(0)``, or ``(Replicate(), Shard(0))`` for HSDP. Our split (NOTE
[padding] in ``markers.py``) is DTensor's ``Shard(0)`` chunking, so DCP reshards to any world size.

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=path)
    # at any world size, the same dict of a fresh sharded model and optimizer:
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])

The ``get_*`` functions may run collectives: call them on every rank, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_compile.api.full_state import broadcast_full_state_dict, full_state_dict
from fsdp_compile.api.state_layout import Entry, few, layout, to_dtensor, to_padded, unwrap

__all__ = ["StateDictOptions", "get_full_model_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict"]


def get_model_state_dict(model: nn.Module, *, submodules: set[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Tensor]:
    """The model's state dict under the user's names, as torch's function of this name gives it for FSDP2.

    By default for DCP: sharded params are DTensors viewing this rank's rows (call :func:`set_model_state_dict`
    after ``dcp.load`` all the same). ``full_state_dict=True``: plain full tensors; with ``cpu_offload=True``
    too, on the CPU and on global rank 0 alone (the others get ``{}``). ``ignore_frozen_params`` and
    ``submodules`` filter, as in torch. A tensor with several names appears under each.
    """
    options = _options(options, "get_model_state_dict")
    entries, order = layout(model, "get_model_state_dict")
    order = _select(model, order, submodules, options)
    if options.full_state_dict:
        return full_state_dict(entries, order, rank0_only=options.cpu_offload, cpu_offload=options.cpu_offload)
    values = {id(e): to_dtensor(e.param, e.tensor) if e.param is not None else e.tensor.detach()
              for e in {id(e): e for _, e in order}.values()}
    return {name: values[id(e)] for name, e in order}


def _options(options: StateDictOptions | None, caller: str) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"{caller}: options must be a torch.distributed.checkpoint.state_dict.StateDictOptions, got "
                        f"{type(options).__name__}.")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(f"{caller}: broadcast_from_rank0=True needs full_state_dict=True (rank 0 holds full tensors).")
    if options.cpu_offload and not options.full_state_dict:
        raise NotImplementedError(f"{caller}: cpu_offload=True is supported with full_state_dict=True only; the "
                                  "sharded dict's DTensors stay on the model's device.")
    return options


def _select(model: nn.Module, order: list[tuple[str, Entry]], submodules: set[nn.Module] | None,
            options: StateDictOptions) -> list[tuple[str, Entry]]:
    if options.ignore_frozen_params:
        order = [(n, e) for n, e in order if not (isinstance(e.tensor, nn.Parameter) and not e.tensor.requires_grad)]
    if submodules is None:
        return order
    prefixes = [f"{name}." for name, m in unwrap(model).named_modules() if m in submodules]
    kept = [(n, e, next((p for p in prefixes if n.startswith(p)), None)) for n, e in order]
    return [(n if options.keep_submodule_prefixes else n[len(p):], e) for n, e, p in kept if p is not None]


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Tensor], *,
                         options: StateDictOptions | None = None, strict: bool | None = None) -> _IncompatibleKeys:
    """Load ``model_state_dict`` (as :func:`get_model_state_dict` returns, or full plain tensors) into
    ``model``, as torch's function of this name does for FSDP2; a tensor with several names needs only one.

    ``full_state_dict=True, broadcast_from_rank0=True``: global rank 0 holds the full state dict, the others
    pass ``{}`` (NOTE [rank-0 broadcast] in ``full_state.py``). With ``options.strict`` (default; ``strict=``
    overrides it) missing or unknown names raise; otherwise they are returned as ``(missing, unexpected)``.
    """
    state_dict = model_state_dict
    options = _options(options, "set_model_state_dict")
    strict = options.strict if strict is None else strict
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"set_model_state_dict: state_dict must be a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}.")
    if options.broadcast_from_rank0:
        return broadcast_full_state_dict(model, state_dict, strict)
    entries, order = layout(model, "set_model_state_dict")
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
            value = to_padded(e.param, value, f"set_model_state_dict: {name!r}")
        elif isinstance(value, DTensor):
            raise TypeError(f"set_model_state_dict: {name!r} is a DTensor but the model keeps it unsharded (a buffer "
                            "or a param no fully_shard unit manages); pass a plain tensor (get_model_state_dict's).")
        raw.update(dict.fromkeys(e.raw_keys, value))
    if strict and (missing or unexpected):
        raise ValueError(f"set_model_state_dict: missing keys {few(missing)}, unexpected keys {few(unexpected)}. "
                         "Fill the dict get_model_state_dict(model) returns (dcp.load(sd, ...) does), or pass "
                         "strict=False to load a partial state dict.")
    unwrap(model).load_state_dict(raw, strict=strict)
    return _IncompatibleKeys(missing, unexpected)


def get_full_model_state_dict(model: nn.Module, *, rank0_only: bool = True,
                              cpu_offload: bool = True) -> dict[str, Tensor]:
    """Plain full tensors, as the unsharded model's ``state_dict()`` holds them (for export); collective.
    ``rank0_only``: the others get ``{}``; ``cpu_offload``: on the CPU. Buffers are the live tensors."""
    entries, order = layout(model, "get_full_model_state_dict")
    return full_state_dict(entries, order, rank0_only=rank0_only, cpu_offload=cpu_offload)


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (for ``dcp.load`` to fill): a step at lr 0 with zero grads."""
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


def _optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer, caller: str) -> list[list[Entry]]:
    """Per param group of ``optimizer``, each param's entry."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{caller}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    by_tensor = {id(e.tensor): e for e in layout(model, caller)[0]}
    for p in (p for g in optimizer.param_groups for p in g["params"] if id(p) not in by_tensor):
        raise ValueError(f"{caller}: the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                         "the model's; build the optimizer from model.parameters() after fully_shard (the params "
                         "are then the shards).")
    return [[by_tensor[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizer's state keyed by param names: ``{"state": {fqn: {...}}, "param_groups": [...]}``.

    Sharded only (no ``full_state_dict``). State shaped like a param's shard (Adam's moments) becomes
    DTensors of the full shape; scalars stay. A fresh optimizer's state is created first, for ``dcp.load``.
    """
    _sharded_only(options, "get_optimizer_state_dict")
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


def _sharded_only(options: StateDictOptions | None, caller: str) -> None:
    if _options(options, caller).full_state_dict:
        raise NotImplementedError(f"{caller}: full_state_dict=True is not supported for optimizer state; save and load "
                                  "it sharded with dcp.save / dcp.load (any world size).")


def _state_out(entry: Entry, key: str, value: Any) -> Any:
    sp = entry.param
    if sp is None or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if value.shape != sp.shard.shape:
        raise ValueError(f"get_optimizer_state_dict: state {key!r} of {entry.names[0]!r} has shape "
                         f"{tuple(value.shape)}, neither the shard's {tuple(sp.shard.shape)} nor a scalar; only "
                         "element-wise optimizer state (SGD, Adam, AdamW, ...) can be resharded.")
    return to_dtensor(sp, value)


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load an optimizer state dict keyed by param names (as :func:`get_optimizer_state_dict` returns).
    DTensors (or full-shape tensors) become this rank's shard; the groups must hold the params they held."""
    caller = "set_optimizer_state_dict"
    _sharded_only(options, caller)
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        got = f"keys {few(list(state_dict))}" if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise TypeError(f"{caller}: expected a dict with 'state' and 'param_groups' (from get_optimizer_state_dict), "
                        f"got {got}.")
    groups = _optimizer_entries(model, optimizer, caller)
    saved_groups, saved_state = list(state_dict["param_groups"]), state_dict["state"]
    ours = [[e.names[0] for e in entries] for entries in groups]
    unexpected = sorted(set(saved_state) - {name for names in ours for name in names})
    if len(saved_groups) != len(groups) or unexpected or any(
            sorted(names) != sorted(saved["params"]) for names, saved in zip(ours, saved_groups)):
        theirs = " | ".join(few(list(g["params"])) for g in saved_groups)
        raise ValueError(f"{caller}: the optimizer's {len(groups)} param groups hold "
                         f"{' | '.join(few(n) for n in ours)}, the saved {len(saved_groups)} hold {theirs} (state for "
                         f"params the optimizer lacks: {few(unexpected)}); build it with the same params and groups "
                         "as the saved one.")
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


def _state_in(entry: Entry, key: str, value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    if entry.param is not None and (isinstance(value, DTensor) or value.dim() > 0):
        return to_padded(entry.param, value, f"set_optimizer_state_dict: state {key!r} of {entry.names[0]!r}")
    if isinstance(value, DTensor):
        raise TypeError(f"set_optimizer_state_dict: state {key!r} of {entry.names[0]!r} is a DTensor but the param "
                        "is not sharded; pass a plain tensor, as get_optimizer_state_dict gives.")
    return value.detach().clone()  # the optimizer updates state in place
