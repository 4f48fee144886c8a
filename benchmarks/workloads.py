"""What ``benchmarks.step_time`` trains and how one step is measured: models, batches, FLOPs, steps.

Two model kinds, both a stack of blocks that ``fully_shard`` makes one unit each:

* ``llama``: :class:`fsdp_compile.examples.models.Transformer` (``model.layers``), next-token cross-entropy;
* ``mlp``: ``layers`` blocks of ``Linear(D, 4D) -> GELU -> Linear(4D, D)`` on a ``(tokens, D)`` input,
  loss ``output.float().pow(2).mean()``.

``ModelSpec`` holds the shapes and the parameter dtype; the same spec, seed and rank give the same
parameters and batch, whichever variant (``benchmarks.variants``) builds them. A ``Runner`` trains a built
variant one (timed) step at a time with AdamW (fused by default), and ``RssSampler`` / ``CudaPeak``
measure the memory its steps take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from fsdp_compile.examples.models import ModelConfig, Transformer, loss_fn

__all__ = ["DTYPES", "MODEL_KINDS", "PEAK_FLOPS", "PRESETS", "CudaPeak", "Mlp", "ModelSpec", "RssSampler", "Runner",
           "blocks_of", "build_model", "loss_of", "make_batch", "peak_flops_for", "read_rss_bytes", "run_delay_s",
           "train_flops"]

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


def stack_blocks(model: nn.Module) -> nn.Module:
    """Put a Llama's blocks into one :class:`fsdp_compile.api.stack.BlockStack` (``model.layers``), which
    Dynamo then traces one block for all (NOTE [stacked blocks]); returns the stack."""
    from fsdp_compile.examples.models import Transformer
    from fsdp_compile.api.stack import BlockStack

    if not isinstance(model, Transformer):
        raise ValueError(f"stack_blocks: only the llama model calls a BlockStack, not {type(model).__name__}; "
                         "use --model llama (or a preset of it) for the stacked variants.")
    model.layers = BlockStack(model.layers)  # type: ignore[assignment]
    return model.layers


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
