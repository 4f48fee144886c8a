"""What ``benchmarks.step_time`` trains and how one step is measured: models, batches, FLOPs, variants.

Two model kinds, both a stack of blocks that ``fully_shard`` makes one unit each:

* ``llama``: :class:`fsdp_compile.models.Transformer` (``model.layers``), next-token cross-entropy;
* ``mlp``: ``layers`` blocks of ``Linear(D, 4D) -> GELU -> Linear(4D, D)`` on a ``(tokens, D)`` input,
  loss ``output.float().pow(2).mean()``.

``ModelSpec`` holds the shapes and the parameter dtype; the same spec, seed and rank give the same
parameters and batch, whichever variant builds them. A *variant* (``VARIANTS``, ``build_variant``) is
how the model is sharded and compiled: fsdp-compile with each communicator layout, FSDP2 eager or
compiled, the peers of ``benchmarks.peers`` (SimpleFSDP, Megatron-FSDP), or plain ``torch.compile``;
its ``Runner`` trains it one (timed) step at a time with AdamW (fused by default), and
``RssSampler`` / ``CudaPeak`` measure the memory its steps take.
"""

from __future__ import annotations

import inspect
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.peers import PEERS, build_megatron_fsdp, build_simple_fsdp, peer_reason
from fsdp_compile import FsdpGroups, fully_shard, make_backend
from fsdp_compile.models import ModelConfig, Transformer, loss_fn

__all__ = ["COMPARISONS", "DEFAULT_VARIANTS", "DTYPES", "MODEL_KINDS", "PEAK_FLOPS", "PRESETS", "VARIANTS", "CudaPeak", "Mlp", "ModelSpec",
           "OPTIMIZERS", "RssSampler", "Runner", "SharedGroups", "blocks_of", "build_model", "build_variant", "loss_of",
           "make_batch", "own_forward", "peak_flops_for", "raise_recompile_limit", "read_rss_bytes",
           "run_delay_s", "train_flops", "unavailable_reason"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_KINDS: tuple[str, ...] = ("llama", "mlp")

Batch = tuple[Tensor, ...]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of the benchmark model and of one rank's batch.

    ``llama`` uses ``dim, layers, heads, vocab, seq, batch`` (``batch`` sequences of ``seq`` tokens per
    rank); ``mlp`` uses ``dim, layers, tokens`` (``tokens`` rows of width ``dim`` per rank).
    """

    kind: str = "llama"
    dim: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 512
    seq: int = 64
    batch: int = 4
    tokens: int = 8192
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"ModelSpec: kind={self.kind!r}; use one of {MODEL_KINDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelSpec: dtype={self.dtype!r}; use one of {tuple(DTYPES)}")
        if self.kind == "llama" and self.dim % self.heads:
            raise ValueError(f"ModelSpec: dim={self.dim} is not a multiple of heads={self.heads}")
        if min(self.dim, self.layers, self.heads, self.vocab, self.seq, self.batch, self.tokens) <= 0:
            raise ValueError(f"ModelSpec: every size must be positive: {self}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank processes per step."""
        return self.batch * self.seq if self.kind == "llama" else self.tokens

    def describe(self) -> str:
        """A one-line description, e.g. ``llama L4 D256 H4 V512, batch 4x64/rank, fp32``."""
        if self.kind == "llama":
            return (f"llama L{self.layers} D{self.dim} H{self.heads} V{self.vocab}, "
                    f"batch {self.batch}x{self.seq}/rank, {self.dtype}")
        return f"mlp {self.layers} blocks D{self.dim}, {self.tokens} tokens/rank, {self.dtype}"


PRESETS: dict[str, ModelSpec] = {
    # the CPU target: a 4-block GPT of width 256
    "cpu": ModelSpec("llama", dim=256, layers=4, heads=4, vocab=512, seq=64, batch=4, dtype="fp32"),
    # "H200, world size 1, bf16, 4 blocks, D=4096, 8192 tokens"
    "h200-mlp": ModelSpec("mlp", dim=4096, layers=4, tokens=8192, dtype="bf16"),
    # a few Llama blocks of real widths; at world size 1 every variant's copy (params + AdamW state, bf16)
    # stays resident: about 6.4 GiB per variant for 4096, 12 GiB for 8192
    "gpu-llama-4096": ModelSpec("llama", dim=4096, layers=4, heads=32, vocab=32000, seq=2048, batch=2,
                                dtype="bf16"),
    "gpu-llama-8192": ModelSpec("llama", dim=8192, layers=2, heads=64, vocab=32000, seq=4096, batch=1,
                                dtype="bf16"),
    # issue 11's model: narrow, deep, few tokens (the host launching kernels is what a step waits for)
    "gpu-llama-1024": ModelSpec("llama", dim=1024, layers=16, heads=16, vocab=32000, seq=1024, batch=1,
                                dtype="bf16"),
}

PEAK_FLOPS: dict[str, dict[str, float]] = {
    # dense peak FLOP/s of one GPU by parameter dtype, matched as a substring of the device name
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
}


def peak_flops_for(device_name: str, dtype: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device from ``PEAK_FLOPS`` (``override`` wins); ``None`` if unknown."""
    if override:
        return override
    return next((t[dtype] for key, t in PEAK_FLOPS.items() if key.lower() in device_name.lower()), None)


class MlpBlock(nn.Module):
    """``Linear(D, 4D) -> GELU -> Linear(4D, D)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Mlp(nn.Module):
    """A stack of :class:`MlpBlock` (``self.layers``); ``(tokens, D) -> (tokens, D)``."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MlpBlock(dim) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.layers:
            x = block(x)
        return x


def build_model(spec: ModelSpec, device: torch.device | str) -> nn.Module:
    """A fresh model on ``device`` with parameters in ``spec.dtype``; seed the RNG first for equal copies."""
    with torch.device(device):
        if spec.kind == "llama":
            cfg = ModelConfig(vocab_size=spec.vocab, dim=spec.dim, n_layers=spec.layers, n_heads=spec.heads,
                              max_seq_len=spec.seq)
            model: nn.Module = Transformer(cfg)
        else:
            model = Mlp(spec.dim, spec.layers)
    return model.to(spec.torch_dtype)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The blocks that each become one ``fully_shard`` unit (the root is the last unit)."""
    return list(model.layers)  # type: ignore[arg-type]


def make_batch(spec: ModelSpec, seed: int, device: torch.device | str) -> Batch:
    """One rank's batch, drawn from a CPU generator seeded with ``seed`` (then moved to ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    if spec.kind == "llama":
        tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=gen)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    x = torch.randn(spec.tokens, spec.dim, generator=gen)
    return (x.to(device=device, dtype=spec.torch_dtype),)


def loss_of(spec: ModelSpec, model: nn.Module | object, batch: Batch) -> Tensor:
    """The scalar training loss of ``model`` (a module or a compiled callable) on ``batch``."""
    if spec.kind == "llama":
        inputs, targets = batch
        return loss_fn(model(inputs), targets)  # type: ignore[operator]
    return model(batch[0]).float().pow(2).mean()  # type: ignore[operator]


def train_flops(spec: ModelSpec) -> int:
    """FLOPs of one rank's forward + backward on the unsharded model (counted on the meta device).

    ``FlopCounterMode`` counts matmuls and attention; causal attention is counted as full attention
    and elementwise work is not counted, so MFU from this number is the usual "model FLOPs" one.
    """
    model = build_model(spec, "meta")
    batch = make_batch(spec, seed=0, device="meta")
    with FlopCounterMode(display=False) as counter:
        loss_of(spec, model, batch).backward()
    return int(counter.get_total_flops())


# --- measuring a variant's steps ------------------------------------------------------------------------


def read_rss_bytes(status_path: str = "/proc/self/status") -> int | None:
    """Resident set size (``VmRSS``) from a ``/proc/<pid>/status`` file, or ``None`` where there is none."""
    try:
        with open(status_path, encoding="ascii") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:")), None)
    except OSError:
        return None


class RssSampler:
    """Peak RSS of this process while open, sampled every ``interval_s`` by a thread; ``growth`` = peak - RSS
    at entry (``None`` without ``/proc``)."""

    def __init__(self, interval_s: float = 0.002, status_path: str = "/proc/self/status") -> None:
        self.interval_s, self.status_path = interval_s, status_path
        self.baseline: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        rss = read_rss_bytes(self.status_path)
        if rss is not None:
            self.peak = rss if self.peak is None else max(self.peak, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = read_rss_bytes(self.status_path)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def growth(self) -> int | None:
        return None if self.baseline is None or self.peak is None else max(0, self.peak - self.baseline)


class CudaPeak:
    """``growth`` = ``max_memory_allocated`` (reset at entry) - the allocation at entry."""

    growth: int | None = None

    def __enter__(self) -> CudaPeak:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.baseline = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.growth = torch.cuda.max_memory_allocated() - self.baseline


def run_delay_s() -> float:
    """Seconds this thread has waited for a CPU while runnable (``/proc/thread-self/schedstat``; 0 without)."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class Runner:
    """A built variant: the module that owns the parameters, what to call, its optimizer."""

    name: str
    model: nn.Module
    forward: Callable[..., Any]
    opt: torch.optim.Optimizer

    def step(self, spec: ModelSpec, batch: Batch) -> None:
        loss_of(spec, self.forward, batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self, spec: ModelSpec, batch: Batch, cuda: bool) -> tuple[float, float]:
        """One step: (wall seconds, share of it this thread was *blocked*: neither running nor waiting for a
        CPU; on a training thread that is waiting for collectives, whatever else the machine runs)."""
        if cuda:
            torch.cuda.synchronize()
        t0, c0, d0 = time.perf_counter(), time.thread_time(), run_delay_s()
        self.step(spec, batch)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return wall, max(0.0, wall - (time.thread_time() - c0) - (run_delay_s() - d0)) / wall

    def state_bytes(self) -> int:
        """Bytes of this rank's parameters, persistent gradients and optimizer state (see ``state_parts``)."""
        return sum(self.state_parts())

    def state_parts(self) -> tuple[int, int, int]:
        """(params, grads, optimizer state): bytes of the storages behind this rank's parameters (local shards
        of DTensors), behind the gradients that stay set between steps (none after ``zero_grad(set_to_none)``
        for most variants; Megatron-FSDP keeps a gradient buffer, counted here where ``.grad`` views it), and
        behind the optimizer's state. A storage counts once, in the first part that holds it."""
        params = list(self.model.parameters())
        parts = (params, [p.grad for p in params], [v for s in self.opt.state.values() for v in s.values()])
        seen: set[tuple[str, int]] = set()
        sizes = []
        for tensors in parts:
            total = 0
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    t = t.to_local() if hasattr(t, "to_local") else t
                    key = (str(t.device), t.untyped_storage().data_ptr())
                    if key not in seen and t.untyped_storage().nbytes():
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
            sizes.append(total)
        return sizes[0], sizes[1], sizes[2]


# --- variants -------------------------------------------------------------------------------------------


VARIANTS: tuple[str, ...] = ("fsdp-compile", "fsdp-compile-whole", "fsdp-compile-bucketed", "fsdp-compile-packed",
                             "fsdp-compile-ag", "fsdp-compile-delayed", "fsdp2-eager",
                             "fsdp2-eager-one-group", "fsdp2-compile", *PEERS, "compile", "fsdp-compile-keep",
                             "fsdp-compile-keep-whole", "fsdp-compile-keep-bucketed", "fsdp-compile-keep-packed")
_KEEP = ("fsdp-compile-keep", "fsdp-compile-keep-whole", "fsdp-compile-keep-bucketed",
         "fsdp-compile-keep-packed")  # world 1 only
COMPARISONS: tuple[str, ...] = ("fsdp-compile-whole", "fsdp-compile-bucketed", "fsdp-compile-packed",
                                "fsdp-compile-keep-whole", "fsdp-compile-keep-bucketed", "fsdp-compile-keep-packed")
"""Variants that only take one of fsdp-compile's choices back (see ``_BACKEND_KW``): run when named."""
DEFAULT_VARIANTS: tuple[str, ...] = tuple(v for v in VARIANTS if v not in COMPARISONS)
OPTIMIZERS: tuple[str, ...] = ("fused", "foreach")
_DEDICATED = {"fsdp-compile": "reduce_scatter", "fsdp-compile-whole": "reduce_scatter",
              "fsdp-compile-bucketed": "reduce_scatter",
              "fsdp-compile-packed": "reduce_scatter", "fsdp-compile-ag": "all_gather", "fsdp-compile-delayed": "none",
              **{k: "reduce_scatter" for k in _KEEP}}
_BUCKETED: dict[str, Any] = {"bucket_alone_bytes": None}  # every param bucketed, gathered in place
_PACKED: dict[str, Any] = {"bucket_alone_bytes": None, "inplace_gather": False}  # as before 2026-12-01
_WHOLE: dict[str, Any] = {"outline": False}  # every block inline, one whole-model graph (before 2026-12-01)
_BACKEND_KW: dict[str, dict[str, Any]] = {"fsdp-compile-delayed": {"schedule": "delayed"}, "fsdp-compile-whole": _WHOLE,
                                          "fsdp-compile-keep-whole": {"elide_single_rank": False, **_WHOLE},
                                          "fsdp-compile-bucketed": _BUCKETED, "fsdp-compile-packed": _PACKED,
                                          "fsdp-compile-keep": {"elide_single_rank": False},
                                          "fsdp-compile-keep-bucketed": {"elide_single_rank": False, **_BUCKETED},
                                          "fsdp-compile-keep-packed": {"elide_single_rank": False, **_PACKED}}


def unavailable_reason(name: str, world: int, device: torch.device | str = "cpu") -> str | None:
    """Why ``name`` cannot run here (the same answer on every rank), or ``None``."""
    if name in PEERS:
        return peer_reason(name, torch.device(device))
    if (name == "compile" or name in _KEEP) and world != 1:
        return f"only at world size 1 (this run: {world})"
    if name == "fsdp2-eager":
        from torch.distributed.fsdp import FSDPModule
        if not hasattr(FSDPModule, "set_separate_reduce_scatter_group"):
            return f"torch {torch.__version__} has no FSDPModule.set_separate_reduce_scatter_group"
    if name == "fsdp-compile-keep" and "elide_single_rank" not in inspect.signature(make_backend).parameters:
        return "make_backend has no elide_single_rank option"
    return None


@dataclass
class SharedGroups:
    """Process groups made once per process, in variant order (the same on every rank)."""

    device: torch.device
    world: int
    fsdp: dict[str, FsdpGroups] = field(default_factory=dict)
    mesh: Any = None

    def groups(self, dedicated: str) -> FsdpGroups:
        if dedicated not in self.fsdp:
            self.fsdp[dedicated] = FsdpGroups.create(dedicated=dedicated)
        return self.fsdp[dedicated]

    mesh_2d: Any = None

    def fsdp2_mesh(self) -> Any:
        """The 1-D mesh of FSDP2 and SimpleFSDP."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = init_device_mesh(self.device.type, (self.world,))
        return self.mesh

    def megatron_mesh(self) -> Any:
        """Megatron-FSDP's ``(fsdp, tp)`` mesh, tp of size 1."""
        if self.mesh_2d is None:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh_2d = init_device_mesh(self.device.type, (self.world, 1), mesh_dim_names=("fsdp", "tp"))
        return self.mesh_2d

    def destroy(self) -> None:
        for g in self.fsdp.values():
            g.destroy()


def own_forward(model: nn.Module) -> None:
    """Give ``model`` a ``forward`` with a code object of its own (same code, a distinct object).

    Dynamo keeps state per code object: cache entries, and a "skip this frame" mark when a graph break
    falls inside a loop, as FSDP2 + ``torch.compile(model)`` breaks at every block. With one shared
    ``Transformer.forward``, that mark would make every variant compiled later, or stepped later, run
    its forward eagerly and compile each block apart; with its own code, each variant runs as compiled.
    """
    fn = type(model).forward
    code = fn.__code__.replace()
    model.forward = types.MethodType(  # type: ignore[method-assign]
        types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), model)


def build_variant(name: str, spec: ModelSpec, shared: SharedGroups, seed: int, optimizer: str = "fused") -> Runner:
    """A fresh model from ``seed``, sharded (blocks first, then the root) and compiled as ``name`` says,
    with AdamW in ``optimizer`` form (``"fused"``: one kernel per step; ``"foreach"``: grouped kernels)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"build_variant: optimizer={optimizer!r}; use one of {OPTIMIZERS}")
    fused = optimizer == "fused"
    torch.manual_seed(seed)
    model = build_model(spec, shared.device)
    own_forward(model)
    forward: Callable[..., Any] = model
    if name == "megatron-fsdp":
        units = list(dict.fromkeys(type(b) for b in blocks_of(model)))
        wrapped, opt = build_megatron_fsdp(model, units, shared.megatron_mesh(), lr=1e-5, fused=fused)
        return Runner(name, wrapped, wrapped, opt)
    if name == "simplefsdp":
        forward = build_simple_fsdp(model, shared.fsdp2_mesh())
    elif name in _DEDICATED:
        groups = shared.groups(_DEDICATED[name])
        for block in blocks_of(model):
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        forward = torch.compile(model, backend=make_backend(**_BACKEND_KW.get(name, {})))
    elif name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
        mesh = shared.fsdp2_mesh()
        for block in blocks_of(model):
            fsdp2_fully_shard(block, mesh=mesh)
        fsdp2_fully_shard(model, mesh=mesh)
        if name == "fsdp2-eager":
            model.set_separate_reduce_scatter_group()  # type: ignore[operator]
        if name == "fsdp2-compile":
            forward = torch.compile(model)
    elif name == "compile":
        forward = torch.compile(model)
    return Runner(name, model, forward, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused,
                                                          foreach=None if fused else True))


def raise_recompile_limit(n: int) -> None:
    """Variants share the code of nested forwards (blocks, norms), which FSDP2 + compile compiles as frames
    of their own, one cache entry per module type: allow several per variant."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 16 * n))
