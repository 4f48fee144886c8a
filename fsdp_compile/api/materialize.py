"""Sharded parameters that ``module.to_empty(...)`` (or ``module.to(...)``) replaced: found and rebound.

NOTE [converted parameters]: ``nn.Module._apply`` registers a *new* ``nn.Parameter`` where it cannot swap
``.data`` (meta to CPU or CUDA in ``to_empty``, or under ``set_overwrite_module_params_on_conversion``), once
per owning module, so a shared parameter comes back as two, and the unit's records would point at the old
tensor. :func:`rebind_params`, run after each conversion (``FsdpModule._apply``), adopts the first owner's
new parameter, puts it back into every other owner (keeping the tie) and hooks it; the flat is laid out again.

NOTE [initialising sharded parameters]: after ``to_empty`` the model's own init runs as unsharded
(``nn.init.*`` on ``module.weight``, ``reset_parameters()``, ``w[0].fill_(0)``): each read gathers the full
parameter (``gathered.py``), in its own dtype outside a forward, every rank draws the same values from the
same RNG stream, and each in-place write copies this rank's rows back. So the values equal the unsharded
model's with the same seed, at any world size, with one full parameter at a time in memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList

from fsdp_compile.api.grads import ShardGrad, as_shard_grad
from fsdp_compile.api.groups import FsdpGroups
from fsdp_compile.api.units import ShardedParam, Unit, _params

__all__ = ["check_built_alike", "hand_out_global_grads", "local_sums", "rebind_params", "register_grad_hook"]


def register_grad_hook(p: nn.Parameter, hook: Callable[[Tensor], None]) -> None:
    """Register ``hook`` after grad accumulation, also on a frozen param."""
    frozen = not p.requires_grad
    p.requires_grad_(True)
    p.register_post_accumulate_grad_hook(hook)
    p.requires_grad_(not frozen)


def hand_out_global_grads(sp: ShardedParam) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook making the shard's ``.grad`` a :class:`ShardGrad` (NOTE [global norms])."""
    group_name = sp.unit.groups.all_gather.group_name
    rows = sp.real_rows

    def hook(param: Tensor) -> None:
        grad = param.grad
        if grad is not None and type(grad) is not ShardGrad:
            param.grad = as_shard_grad(grad, group_name, rows)

    return hook


def rebind_params(unit: Unit) -> bool:
    """(NOTE [converted parameters]) Whether any of ``unit``'s params was replaced, and rebound."""
    rebound = False
    for sp in unit.params:
        current: nn.Parameter | None = None
        for ref, name in sp.owners:
            owner = ref()
            if owner is None:
                continue
            slot = owner._modules["parametrizations"]._modules[name]._parameters  # type: ignore[index,union-attr]
            if current is None:
                current = slot["original"]
            elif slot["original"] is not current:
                slot["original"] = current  # a shared param, converted per owner: tie it again
        if current is None or current is sp.shard:
            continue
        _params.pop(sp.shard, None)
        sp.shard = current
        _params[current] = sp
        register_grad_hook(current, hand_out_global_grads(sp))
        rebound = True
    return rebound


# NOTE [ranks built alike]: ``fully_shard`` keeps each rank's rows of what that rank built; ranks built
# without a common seed would silently train a model stitched from different initialisations. So each call
# checksums its unit's parameters (``local_sums``) and compares the units not compared yet with one
# all-reduce per group (MAX of the sums and their negatives). All ranks see the same result, so all raise at
# the same call; only then do they gather each rank's sums, to say which differ. Meta tensors: counts only.
_TOLERANCE = 1e-9  # relative: float64 sums of the same values; only the reduction order may differ


def local_sums(params: Sequence[Tensor]) -> Tensor | None:
    """Sum, 2-norm and element count of ``params`` in float64 (of meta tensors the count); ``None`` for none."""
    if not params:
        return None
    real = [p for p in params if p.device.type != "meta"]
    device = real[0].device if real else torch.device("cpu")
    meta_count = torch.tensor([0.0, 0.0, float(sum(p.numel() for p in params if p.device.type == "meta"))],
                              dtype=torch.float64, device=device)
    with torch.no_grad():
        return torch.stack([torch.stack((p.detach().sum(dtype=torch.float64),
                                         torch.linalg.vector_norm(p.detach(), dtype=torch.float64),
                                         torch.tensor(float(p.numel()), dtype=torch.float64, device=p.device)))
                            for p in real] + [meta_count]).sum(0)


def check_built_alike(module: nn.Module, unit_name: str, units: Sequence[Unit], groups: FsdpGroups) -> None:
    """(NOTE [ranks built alike]) Compare the checksums of ``units`` across ``groups``; collective."""
    pending = [u.built_sums for u in units if u.built_sums is not None]
    for u in units:
        u.built_sums = None
    group_list = [g for g in (groups.all_gather, groups.replicate) if g is not None and g.size() > 1]
    if not group_list:
        return
    device = pending[0].device if pending else torch.device("cpu")
    # (a device explicitly: fully_shard may run under ``torch.device("meta")``)
    sums = (torch.stack([s.to(device) for s in pending]).sum(0) if pending
            else torch.zeros(3, dtype=torch.float64, device=device))
    for group in group_list:
        both = torch.cat((sums, -sums))
        if both.device.type == "cpu" and "nccl" in str(dist.get_backend(group)):  # a CPU-built model, NCCL ranks
            both = both.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        high, low = both[:3], -both[3:]
        if bool(_differ(high, low).any()):
            # Every rank saw the same maxima, so all of them gather here.
            mine = sums.to(both.device)
            every = [torch.empty_like(mine) for _ in range(group.size())]
            dist.all_gather(every, mine, group=group)
            raise ValueError(f"fully_shard of {_path_in_model(module)} ({unit_name}): {_what_differs(every, group)}, "
                             "so each rank would keep its rows of a different model. Build it the same on every "
                             "rank: call torch.manual_seed(seed) with one seed on every rank before building the "
                             "model; or build it on the meta device (with torch.device('meta'): ...), fully_shard, "
                             "model.to_empty(device=...), then run its init under a common seed; or, to load the "
                             "same checkpoint on every rank, build on the meta device and load it from rank 0 with "
                             "fsdp_compile.set_model_state_dict(model, sd, options=StateDictOptions("
                             "full_state_dict=True, broadcast_from_rank0=True)).")


def _differ(a: Tensor, b: Tensor) -> Tensor:
    """Which of two checksums differ beyond float64 reduction order."""
    return (a - b).abs() > _TOLERANCE * (1 + torch.maximum(a.abs(), b.abs()))


def _what_differs(every: Sequence[Tensor], group: dist.ProcessGroup) -> str:
    """In words: which ranks built what, from each rank's checksum (``every``, in group order)."""
    ranks = dist.get_process_group_ranks(group)
    sizes = [int(s[2].item()) for s in every]
    if len(set(sizes)) > 1:
        built = ", ".join(f"{n:,} on rank {r}" for r, n in zip(ranks, sizes))
        return (f"the parameter sizes differ across ranks (elements in this unit: {built}): the ranks built "
                "different models (another depth or width), or called fully_shard on different modules")
    classes: list[list[int]] = []  # ranks whose checksums agree
    for i, s in enumerate(every):
        same = next((c for c in classes if not bool(_differ(every[c[0]], s).any())), None)
        if same is None:
            classes.append([i])
        else:
            same.append(i)
    alike = " vs ".join(("rank " if len(c) == 1 else "ranks ") + ", ".join(str(ranks[i]) for i in c) for c in classes)
    return f"the parameter values differ across ranks ({alike}: same sizes, different values)"


def _path_in_model(module: nn.Module) -> str:
    """``module``'s name in the outermost module holding it (searching the live modules), for the error."""
    parents: dict[int, tuple[nn.Module, str]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):
            for name, child in obj.__dict__.get("_modules", {}).items():
                if child is not None and not isinstance(obj, ParametrizationList):
                    parents.setdefault(id(child), (obj, name))
    names, seen, child = [], {id(module)}, module
    while id(child) in parents:
        child, name = parents[id(child)]
        if id(child) in seen:
            break
        seen.add(id(child))
        names.append(name)
    return f"module {'.'.join(reversed(names))!r}" if names else "the model's root"
