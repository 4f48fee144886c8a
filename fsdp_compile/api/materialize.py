"""Sharded parameters that ``module.to_empty(...)`` (or ``module.to(...)``) replaced: found and rebound.

NOTE [converted parameters]: ``nn.Module._apply`` keeps a parameter object and swaps its ``.data`` when
the converted tensor can share the old one's type, and otherwise registers a *new* ``nn.Parameter`` in its
place: meta to CPU or CUDA (``to_empty`` after meta-device initialisation), or any conversion under
``torch.__future__.set_overwrite_module_params_on_conversion(True)``. It does so once per module that
holds the parameter, so a parameter shared by two modules comes back as two. A unit's records
(``ShardedParam.shard``, the registry, the gradient hook) would then still point at the old meta tensor,
and compiled code would read it (``FakeTensorDeviceMismatchError: meta and cpu``). :func:`rebind_params`,
run after each conversion of a unit's module (``FsdpModule._apply`` through ``flat_shard.refresh_flat``), makes
the parameter the first owner now holds the unit's, puts that one object back into every other owner (the
tie is kept), and registers the gradient hook on it; the unit's flat shard is then laid out again.

NOTE [initialising sharded parameters]: after ``to_empty`` the model's own init runs as on the unsharded
model (torchtitan's ``init_weights``: ``nn.init.*`` on ``module.weight``, ``reset_parameters()``,
``w.data.copy_(...)``, ``with torch.no_grad(): w[0].fill_(0)``). Each read of ``module.weight`` outside
compiled code gathers the full parameter (``gathered.py``: every rank must read it, in the same order, as
any init does), in the parameter's own dtype outside a forward even under mixed precision
(``reads.eager_args``); every rank then draws the same full tensor from the same RNG stream, as the
unsharded model draws it, and each in-place write, through the tensor or any view of it, copies this
rank's rows back into its shard. So the values are exactly the unsharded model's with the same seed, at
any world size, for every ``torch.nn.init`` function (tests/test_meta_init.py). A rank's memory while
initialising: its shards, plus the parameter being initialised, which is the all-gather's output itself
(NOTE [eager gather, no copy] in ``markers.py``), written back by copying this rank's rows into the shard
and freed when the init drops it, plus what the init function allocates for itself, as on the unsharded
model (torch's ``trunc_normal_`` resamples through ``torch.where``: about 3 more of the parameter);
while gathering, gloo adds a staging buffer of the parameter's size inside the collective. Never the
model. Non-persistent buffers are in no checkpoint: the init method fills them.
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
    """Register ``hook`` after grad accumulation, also on a frozen param (it stays registered if the
    param is unfrozen later; torch only takes the registration while ``requires_grad`` is set)."""
    frozen = not p.requires_grad
    p.requires_grad_(True)
    p.register_post_accumulate_grad_hook(hook)
    p.requires_grad_(not frozen)


def hand_out_global_grads(sp: ShardedParam) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook: the shard's ``.grad`` becomes a :class:`ShardGrad` (NOTE [global
    norms]), so ``clip_grad_norm_`` and other norms over it are global."""
    group_name = sp.unit.groups.all_gather.group_name
    rows = sp.real_rows

    def hook(param: Tensor) -> None:
        grad = param.grad
        if grad is not None and type(grad) is not ShardGrad:
            param.grad = as_shard_grad(grad, group_name, rows)

    return hook


def _original_slot(owner: nn.Module, name: str) -> dict[str, nn.Parameter | None]:
    """The ``_parameters`` dict of ``owner``'s parametrization list for ``name`` (holding ``original``)."""
    return owner._modules["parametrizations"]._modules[name]._parameters  # type: ignore[index,union-attr]


def rebind_params(unit: Unit) -> bool:
    """(NOTE [converted parameters]) Make each of ``unit``'s params the parameter its modules hold now;
    whether any had been replaced."""
    rebound = False
    for sp in unit.params:
        current: nn.Parameter | None = None
        for ref, name in sp.owners:
            owner = ref()
            if owner is None:
                continue
            slot = _original_slot(owner, name)
            if current is None:
                current = slot["original"]
            elif slot["original"] is not current:
                slot["original"] = current  # a shared param, converted once per owner: tie it again
        if current is None or current is sp.shard:
            continue
        _params.pop(sp.shard, None)
        sp.shard = current
        _params[current] = sp
        register_grad_hook(current, hand_out_global_grads(sp))
        rebound = True
    return rebound


# NOTE [ranks built alike]: ``fully_shard`` keeps each rank's rows of the full parameters that rank was built
# with. Ranks that built their model without a common seed would train a model stitched together from
# different initialisations, and nothing else would notice. So each call sums its unit's full parameters
# before sharding (the sum, the 2-norm and the element count, in float64: ``local_sums``) and compares
# the sums of every unit under it not compared yet across the ranks, with one all-reduce per group (MAX
# of the sums and of their negatives: the largest and smallest at once). Every call compares, because no
# call knows whether it is the last: a block's looks like a model's of one unit (only the root
# ``fully_shard(model)``), and a model's blocks would otherwise wait for a root call that may never come.
# All ranks get the same reduced values, so they raise at the same call, and ranks that built different
# numbers of blocks are caught where their calls first pair different units instead of hanging. Only
# then do they gather each rank's sums, so that the error says in words which ranks differ, in sizes or
# in values, and where the unit sits in the model. Of meta tensors (meta-device init: the values come
# later, the same on every rank through the init or a rank-0 broadcast) only the element count is
# compared. Groups of one rank compare nothing. The cost: one small
# all-reduce per ``fully_shard`` call (tests/test_meta_init.py measures one).
_TOLERANCE = 1e-9  # relative: float64 sums of the same values; only the reduction order may differ


def local_sums(params: Sequence[Tensor]) -> Tensor | None:
    """Sum, 2-norm and element count of ``params`` in float64 (no float64 copy on CUDA, where the kernels
    accumulate in it); of meta tensors the count alone (on the CPU when all are meta); ``None`` for none."""
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
    """(NOTE [ranks built alike]) Compare the checksums of ``units`` not compared yet across the ranks of
    ``groups`` (every rank must call this at the same point, from ``fully_shard(module)``, whose class is
    ``unit_name``); raise a ``ValueError`` that says where and what differs, and names the fixes."""
    pending = [u.built_sums for u in units if u.built_sums is not None]
    for u in units:
        u.built_sums = None
    group_list = [g for g in (groups.all_gather, groups.replicate) if g is not None and g.size() > 1]
    if not group_list:
        return
    device = pending[0].device if pending else torch.device("cpu")
    # (a device explicitly: fully_shard may run inside ``with torch.device("meta")``)
    sums = (torch.stack([s.to(device) for s in pending]).sum(0) if pending
            else torch.zeros(3, dtype=torch.float64, device=device))
    for group in group_list:
        both = torch.cat((sums, -sums))
        if both.device.type == "cpu" and "nccl" in str(dist.get_backend(group)):  # a CPU-built model, NCCL ranks
            both = both.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        high, low = both[:3], -both[3:]
        if bool(_differ(high, low).any()):
            # Every rank of the group saw the same maxima, so all of them gather here (the error path only).
            mine = sums.to(both.device)
            every = [torch.empty_like(mine) for _ in range(group.size())]
            dist.all_gather(every, mine, group=group)
            raise ValueError(
                f"fully_shard of {_path_in_model(module)} ({unit_name}): {_what_differs(every, group)}, so each "
                "rank would keep its rows of a different model. Build it the same on every rank: call "
                "torch.manual_seed(seed) with one seed on every rank before building the model; or build it on "
                "the meta device (with torch.device('meta'): ...), fully_shard, model.to_empty(device=...), then "
                "run its init under a common seed; or, to load the same checkpoint on every rank, build on the "
                "meta device and load it from rank 0 with fsdp_compile.set_model_state_dict(model, sd, "
                "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))."
            )


def _differ(a: Tensor, b: Tensor) -> Tensor:
    """Which of two checksums (sum, 2-norm, element count) differ beyond float64 reduction order."""
    return (a - b).abs() > _TOLERANCE * (1 + torch.maximum(a.abs(), b.abs()))


def _what_differs(every: Sequence[Tensor], group: dist.ProcessGroup) -> str:
    """In words: which ranks (global numbers) built what, from each rank's checksum (``every``, in group order)."""
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
    """``module``'s name in the outermost module that holds it, as ``named_modules`` spells it
    (``module 'layers.3'``), or ``the model's root``. A module does not know its parent: this searches the
    live modules (``gc``, a fraction of a second), for this error message only."""
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
