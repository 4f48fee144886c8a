"""Rank functions for tests/test_meta_init.py (module level, so spawned processes can import them).

``Net`` is initialised torchtitan's way: built on the meta device, sharded, ``to_empty``, then its own
``init_weights`` (``nn.init`` on module attributes, ``reset_parameters``, in-place writes, a
non-persistent buffer). Its shapes divide by neither 2 nor 3 ranks.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.profiler import ProfilerActivity, profile

from fsdp_compile import (FsdpGroups, MixedPrecisionPolicy, fully_shard, get_model_state_dict, local_shard, make_backend,
                          set_model_state_dict)
from fsdp_compile.api.materialize import check_built_alike, local_sums

FULL = StateDictOptions(full_state_dict=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
SEED = 7


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(3 * dim, dim)
        self.gain = nn.Parameter(torch.ones(()))  # 0-d: one row on rank 0

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x)))) * self.gain


class Net(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 10, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=1)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freq", torch.empty(dim), persistent=False)

    def init_buffers(self) -> None:
        with torch.no_grad():
            self.freq.copy_(1.0 / (10.0 ** (torch.arange(self.freq.numel(), dtype=torch.float32) / self.freq.numel())))

    def init_weights(self) -> None:
        """torchtitan's style: ``nn.init`` on module attributes, ``reset_parameters``, in-place writes."""
        self.init_buffers()
        self.tok.reset_parameters()  # normal_, then the padding row zeroed through a view
        for i, block in enumerate(self.blocks):
            block.norm.reset_parameters()
            nn.init.trunc_normal_(block.fc.weight, std=0.02)
            nn.init.zeros_(block.fc.bias)
            nn.init.trunc_normal_(block.proj.weight, std=0.02 / math.sqrt(2 * (i + 1)), a=-0.03, b=0.03)
            with torch.no_grad():
                block.proj.bias.fill_(0.01)
                block.gain.data.copy_(torch.tensor(0.5))
        nn.init.trunc_normal_(self.head.weight, std=self.head.in_features ** -0.5)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok(tokens) * self.freq
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def reference(**net_kw: Any) -> Net:
    """The unsharded model, built on the CPU and initialised with the same seed."""
    model = Net(**net_kw)
    torch.manual_seed(SEED)
    model.init_weights()
    return model


def build_on_meta(groups: FsdpGroups, mp: MixedPrecisionPolicy | None = None, **net_kw: Any) -> Net:
    with torch.device("meta"):
        model = Net(**net_kw)
    for block in model.blocks:
        fully_shard(block, groups=groups, mp_policy=mp)
    fully_shard(model, groups=groups, mp_policy=mp)
    model.to_empty(device="cpu")
    return model


def _batch(vocab: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def train_steps(model: nn.Module, steps: int = 2, compiled: bool = True) -> list[float]:
    """SGD steps on one batch that every rank sees (the averaged gradient is the unsharded one)."""
    run = torch.compile(model, backend=make_backend(inductor=False)) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(model.head.out_features)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(run(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def meta_init(rank: int, world: int, bf16: bool = False) -> dict[str, Any]:
    """Meta device, shard, to_empty, init_weights: the full state dict, then two compiled steps (``bf16``:
    with bf16 compute, whose init still writes fp32 values)."""
    groups = FsdpGroups.create()
    model = build_on_meta(groups, MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None)
    with warnings.catch_warnings(record=True) as caught:  # none of it warns (NOTE [the slow-path warning])
        warnings.simplefilter("always")
        torch.manual_seed(SEED)
        model.init_weights()
        full = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
        losses = train_steps(model)
    slow = [str(w.message) for w in caught if "gathered eagerly" in str(w.message)]
    out = {"full": full, "freq": model.freq.clone(), "losses": losses, "slow_path_warnings": slow}
    groups.destroy()
    return out


def broadcast_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Meta device, shard, to_empty, then rank 0's full state dict broadcast (the others pass {})."""
    warnings.simplefilter("ignore")
    groups = FsdpGroups.create()
    model = build_on_meta(groups)
    sd = torch.load(path) if rank == 0 else {}
    keys = set_model_state_dict(model, sd, options=BROADCAST)
    model.init_buffers()  # non-persistent: not in any state dict
    full = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    exported = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"full": full, "exported_keys": sorted(exported), "keys": (list(keys.missing_keys), list(keys.unexpected_keys)),
           "losses": train_steps(model)}
    groups.destroy()
    return out


@contextmanager
def _every_free_counted() -> Iterator[None]:
    """The CPU allocator counts a free toward the bytes allocated only on a thread the profiler runs in,
    unless c10's ``caffe2_report_cpu_memory_usage`` flag is set (``c10/core/CPUAllocator.cpp``): gloo's
    worker threads free what a collective held (its work object), so without the flag the count only
    grows, by up to a tensor per collective. Set while measuring (no Python binding: the flag itself)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    was, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = was


def _memory(fn: Callable[[], None]) -> dict[str, int]:
    """While ``fn`` runs: ``peak``, the most bytes the CPU allocator held above where it started (every
    tensor of every thread, temporaries and collective buffers included), and ``here``, the bytes
    allocated on this thread (not in a collective's worker thread), from the profiler's memory events."""
    with _every_free_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return {"peak": 0, "here": 0}
    # "Total Allocated" counts from the first profile of the process: start from where this one began.
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    me = threading.get_native_id()
    return {"peak": max(0, *(m["args"]["Total Allocated"] - start for m in memory)),
            "here": sum(m["args"]["Bytes"] for m in memory if m["args"]["Bytes"] > 0 and m.get("tid") == me)}


MEMORY_NET = {"vocab": 64, "dim": 96, "layers": 8}


def init_memory(rank: int, world: int, path: str) -> dict[str, int]:
    """Bytes allocated on this rank by to_empty + init_weights, by the same init on the unsharded model
    (what torch's init functions allocate themselves), by one read and write of the largest parameter,
    and by to_empty + a rank-0 broadcast load; beside its shards, the largest parameter and the model."""
    warnings.simplefilter("ignore")
    groups = FsdpGroups.create()
    out: dict[str, int] = {}
    with torch.device("meta"):
        meta = Net(**MEMORY_NET)
        unsharded = Net(**MEMORY_NET)
    out["model"] = sum(p.numel() * 4 for p in meta.parameters())
    out["largest"] = max(p.numel() * 4 for p in meta.parameters())
    unsharded.to_empty(device="cpu")
    torch.manual_seed(SEED)
    out["init_own"] = _memory(unsharded.init_weights)["peak"]
    del unsharded

    def shard(model: Net) -> Net:
        for block in model.blocks:
            fully_shard(block, groups=groups)
        return fully_shard(model, groups=groups)

    model = shard(meta)

    def init() -> None:
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        model.init_weights()

    out["init_peak"] = _memory(init)["peak"]
    out["shards"] = sum(p.numel() * p.element_size() for p in model.parameters()) + model.freq.numel() * 4
    fc = model.blocks[0].fc
    assert fc.in_features * fc.out_features * 4 == out["largest"]
    out["fc_shard"] = local_shard(fc, "weight").numel() * 4
    read = _memory(lambda: nn.init.normal_(fc.weight))  # (what it gathers dies with the call)
    out["read_peak"], out["read_here"] = read["peak"], read["here"]
    with torch.device("meta"):
        other = shard(Net(**MEMORY_NET))
    sd = torch.load(path) if rank == 0 else {}
    held = sum(t.numel() * t.element_size() for t in sd.values())

    def load() -> None:
        other.to_empty(device="cpu")
        set_model_state_dict(other, sd, options=BROADCAST)

    out["load_peak"] = _memory(load)["peak"]
    out["state_dict_held"] = held
    groups.destroy()
    return out


def disagreeing(rank: int, world: int, blocks: int = 0) -> dict[str, Any]:
    """Each rank seeds differently before building (``blocks``: rank 1 builds that many blocks more, all
    seeded alike): a fully_shard call must refuse (on every rank, at the same call). Then what the check
    costs on a tiny model."""
    warnings.simplefilter("ignore")
    groups = FsdpGroups.create()
    torch.manual_seed(rank if not blocks else 0)
    model = Net(layers=3 + blocks * rank)
    out: dict[str, Any] = {"error": None}
    try:
        for block in model.blocks:
            fully_shard(block, groups=groups)  # each call compares its unit
        fully_shard(model, groups=groups)
    except ValueError as e:
        out["error"] = str(e)
    torch.manual_seed(0)
    params = list(Net().parameters())
    check_built_alike(model, "Net", [], groups)  # warm
    start = time.perf_counter()
    for _ in range(10):
        local_sums(params)
    out["sums_s"] = (time.perf_counter() - start) / 10
    start = time.perf_counter()
    for _ in range(10):
        check_built_alike(model, "Net", [], groups)  # the one all-reduce
    out["collective_s"] = (time.perf_counter() - start) / 10
    groups.destroy()
    return out


def _shard_error(build: Callable[[], Net], groups: FsdpGroups, blocks: bool) -> str | None:
    """The error ``fully_shard`` raises on the model ``build`` makes (its blocks first when ``blocks``)."""
    model = build()
    try:
        for block in model.blocks if blocks else ():
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
    except ValueError as e:
        return str(e)
    return None


def one_unit(rank: int, world: int) -> dict[str, str | None]:
    """A model sharded as one unit (the root ``fully_shard`` alone) built with different seeds, then with
    one seed; and a model built on the meta device with one block more on rank 1."""
    warnings.simplefilter("ignore")
    groups = FsdpGroups.create()

    def seeded(seed: int) -> Callable[[], Net]:
        return lambda: (torch.manual_seed(seed), Net())[1]

    def on_meta() -> Net:
        with torch.device("meta"):
            return Net(layers=3 + rank)

    out = {"seeds": _shard_error(seeded(rank), groups, False), "alike": _shard_error(seeded(0), groups, False),
           "meta_depth": _shard_error(on_meta, groups, True)}
    groups.destroy()
    return out


class InitNet(nn.Module):
    """A parameter of each rank nn.init takes: 1-D, 2-D (Linear, Embedding), 3-D (Conv1d), 0-d."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 7)
        self.conv = nn.Conv1d(4, 5, 3)
        self.emb = nn.Embedding(11, 3)
        self.scale = nn.Parameter(torch.ones(()))


I = nn.init
INITS: dict[str, Callable[[Tensor], Any]] = {
    "uniform_": lambda t: I.uniform_(t, -0.3, 0.7), "normal_": lambda t: I.normal_(t, 0.1, 0.5),
    "trunc_normal_": lambda t: I.trunc_normal_(t, std=0.02), "constant_": lambda t: I.constant_(t, 0.25),
    "ones_": I.ones_, "zeros_": I.zeros_, "eye_": I.eye_, "dirac_": I.dirac_,
    "xavier_uniform_": I.xavier_uniform_, "xavier_normal_": lambda t: I.xavier_normal_(t, gain=2.0),
    "kaiming_uniform_": lambda t: I.kaiming_uniform_(t, a=math.sqrt(5)), "kaiming_normal_": I.kaiming_normal_,
    "orthogonal_": I.orthogonal_, "sparse_": lambda t: I.sparse_(t, 0.3),
}


def _takes(name: str, t: Tensor) -> bool:
    if name in ("eye_", "sparse_"):
        return t.dim() == 2
    if name == "dirac_":
        return 3 <= t.dim() <= 5
    if name.startswith(("xavier", "kaiming", "orthogonal")):
        return t.dim() >= 2
    return True


def apply_init(model: InitNet, name: str) -> None:
    """``INITS[name]`` on every parameter it takes, read as ``module.<name>``; ``uniform_`` on the rest."""
    for module in (model.fc, model.conv, model.emb, model):
        for pname in ("weight", "bias", "scale"):
            if hasattr(module, pname) and (module is model) == (pname == "scale"):
                t = getattr(module, pname)
                (INITS[name] if _takes(name, t) else INITS["uniform_"])(t)


def every_init(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    """For each nn.init function: InitNet on the meta device, sharded, to_empty, initialised; full values."""
    warnings.simplefilter("ignore")
    groups = FsdpGroups.create()
    out = {}
    for name in INITS:
        with torch.device("meta"):
            model = InitNet()
        fully_shard(model.fc, groups=groups)
        fully_shard(model, groups=groups)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        apply_init(model, name)
        out[name] = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    groups.destroy()
    return out
