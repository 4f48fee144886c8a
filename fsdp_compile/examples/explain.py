"""``explain``: a model's FSDP schedule and its predicted cost, without a GPU or real memory.

The model (on the meta device) is sharded on a *fake* process group of ``world_size`` ranks, compiled with
``fsdp_backend`` without Inductor and run once, attention traced as the GPU's fused kernel. The scheduled graphs
are simulated with the cost model (``timeline.simulate``), the optimizer step is added, and the result is a
table per graph, a Perfetto trace, a PNG timeline and a summary.

NOTE [periodic blocks]: a built-in transformer's blocks are identical, so its schedule repeats block by block.
``explain`` traces ``trace_layers`` and ``trace_layers - 1`` blocks and extends the totals linearly to the full
depth; the tables, trace and picture show the traced depth, and say so. The shallower copy needs a periodic
middle: at least two blocks, and more than the prefetch reaches ahead (``_least_traced``), else the schedule's
start and end (first gathers, last reduce-scatters) differ between the copies too.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compile.api.groups import FsdpGroups
from fsdp_compile.api.sharding import MixedPrecisionPolicy, fully_shard
from fsdp_compile.compiler.backend import make_backend, observe_graphs
from fsdp_compile.examples.models import PRESETS, ModelConfig, Transformer, loss_fn
from fsdp_compile.inspection.autotune import DEPTHS
from fsdp_compile.inspection.cost import OPTIMIZER_PASSES, optimizer_seconds
from fsdp_compile.inspection.fused_attention import FusedAttention
from fsdp_compile.inspection.hardware import Hardware, load_hardware
from fsdp_compile.inspection.schedule import group_labels
from fsdp_compile.inspection.timeline import Span, Timeline, chrome_trace, simulate, table, write_png
from fsdp_compile.inspection.topology import Topology

__all__ = ["Explanation", "explain"]


@dataclass
class Explanation:
    """What ``explain`` found: scheduled graphs, their timelines (and ``"optimizer"``'s) and tables, a summary."""

    graphs: dict[str, fx.GraphModule]
    timelines: dict[str, Timeline]
    tables: dict[str, str]
    summary: dict[str, Any]
    files: list[Path] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"== {kind} ==\n{text}" for kind, text in self.tables.items()]
        return "\n\n".join([*parts, "== summary ==\n" + json.dumps(self.summary, indent=2)])


@dataclass(frozen=True)
class _Traced:
    graphs: dict[str, fx.GraphModule]
    labels: dict[str, str]
    shards: list[tuple[int, int]]  # (numel, element size) of each trainable local shard: the optimizer's state


def _trace(model: nn.Module, example: Tensor, loss: Callable[[Any], Tensor], world_size: int, dedicated: str,
           backend_kw: Mapping[str, Any], blocks: Callable[[nn.Module], list[nn.Module]], fused_attention: bool,
           mp_policy: MixedPrecisionPolicy | None, root_reshard: bool = True) -> _Traced:
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif dist.get_backend() != "fake" or dist.get_world_size() != world_size:
        raise ValueError("explain: a real process group is initialised in this process; explain runs on a fake one "
                         f"of world_size={world_size}: call it before init_process_group, or in a separate process.")
    try:
        groups = FsdpGroups.create(dedicated=dedicated)
        for block in blocks(model):  # not outlined: the cost model and FusedAttention must see every op
            fully_shard(block, groups=groups, outline=False, mp_policy=mp_policy)
        fully_shard(model, groups=groups, mp_policy=mp_policy, reshard_after_forward=root_reshard)
        shards = [(p.numel(), p.element_size()) for p in model.parameters() if p.requires_grad]
        backend = make_backend(inductor=False, check_agreement=False, **backend_kw)
        torch.compiler.reset()
        compiled = torch.compile(model, backend=backend)
        with observe_graphs() as seen, (FusedAttention() if fused_attention else contextlib.nullcontext()):
            out = loss(compiled(example))
            if out.requires_grad:
                out.backward()
        labels = group_labels(groups)
        groups.destroy()
        return _Traced(dict(seen), labels, shards)
    finally:
        if owned:
            dist.destroy_process_group()


def _least_traced(prefetch: object) -> int:
    """The fewest blocks the deeper trace may hold (NOTE [periodic blocks]); ``"auto"``: the deepest tried."""
    ahead = max(DEPTHS) if prefetch == "auto" else int(prefetch)  # type: ignore[call-overload]
    return max(3, ahead + 2)


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _sum_loss(out: Any) -> Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float().sum()


def _summarize(timelines: Mapping[str, Timeline], hw: Hardware) -> dict[str, Any]:
    step = sum(t.step_seconds for t in timelines.values())
    exposed = sum(t.exposed_comm_seconds for t in timelines.values())
    compute = sum(t.compute_seconds for t in timelines.values())
    peaks: dict[str, int] = {}
    for t in timelines.values():
        for kind, b in t.in_flight.items():
            peaks[kind] = max(peaks.get(kind, 0), b)
    opt = timelines.get("optimizer")
    return {
        "hardware": hw.name,
        "step_ms": 1e3 * step,
        "compute_ms": 1e3 * compute,
        "optimizer_ms": 1e3 * opt.step_seconds if opt is not None else 0.0,
        "exposed_comm_ms": 1e3 * exposed,
        "exposed_comm_pct": 100.0 * exposed / step if step else 0.0,
        "peak_bytes_in_flight": peaks,
        "per_graph": {k: t.summary() for k, t in timelines.items()},
    }


def _timelines(traced: _Traced, topology: Topology, optimizer: str | None) -> dict[str, Timeline]:
    timelines = {kind: simulate(gm, topology, traced.labels) for kind, gm in traced.graphs.items()}
    if optimizer is not None and "backward" in traced.graphs:
        seconds = optimizer_seconds(traced.shards, topology.hardware, optimizer)
        name = f"{optimizer}.step ({sum(n for n, _ in traced.shards) / 1e6:.1f}M params)"
        span = Span(name, optimizer, "compute", None, "", 0, 0.0, seconds)
        timelines["optimizer"] = Timeline(spans=(span,), step_seconds=seconds, compute_seconds=seconds,
                                          exposed_comm_seconds=0.0)
    return timelines


def explain(model: str | ModelConfig | nn.Module = "demo", *, world_size: int = 8, hosts: int | None = None,
            hardware: str | Hardware = "h200", calibration: str | Path | Mapping[str, Any] | None = None,
            batch: int = 1, seq: int | None = None, dtype: torch.dtype = torch.bfloat16,
            mp_policy: MixedPrecisionPolicy | None = None, root_reshard_after_forward: bool = True,
            example_input: Tensor | None = None, loss: Callable[[Any], Tensor] | None = None,
            blocks: Callable[[nn.Module], list[nn.Module]] = _default_blocks, dedicated: str = "reduce_scatter",
            optimizer: str | None = "adamw", fused_attention: bool | None = None, trace_layers: int | None = 4,
            out_dir: str | Path | None = None, **backend_kw: Any) -> Explanation:
    """Schedule ``model`` for ``world_size`` ranks and predict its training step on ``hardware``; no GPU needed.

    ``model``: a preset name, a ``ModelConfig`` (built on meta in ``dtype``, ``batch`` sequences of ``seq``
    tokens per rank, next-token loss) or an unsharded ``nn.Module`` (give ``example_input``, and ``loss`` of
    the output unless it is ``output.float().sum()``; ``blocks(model)``: the modules sharded before the root,
    default ``model.layers``). ``mp_policy``: every unit's mixed precision (the CLI's ``--dtype mixed`` is
    ``dtype=torch.float32`` with bf16 params and fp32 reduction). ``root_reshard_after_forward``: the root
    unit's ``reshard_after_forward``. ``hardware``: a preset of ``cost.HARDWARE``; ``calibration``: measured
    numbers overriding it. ``hosts``: default, hosts of the preset's ``ranks_per_node`` GPUs. ``optimizer``:
    ``"adamw"``, ``"adam"``, ``"sgd"``, ``"adamw-fused"`` or ``None``, costed over this rank's shards.
    ``fused_attention``: trace SDPA as the GPU's fused kernel (default: unless ``hardware`` is the CPU).
    ``trace_layers``: NOTE [periodic blocks] (``None``: every block). Other keyword arguments go to
    ``make_backend``, which schedules as on a GPU (``prefetch="auto"``: with this cost model). With
    ``out_dir``, writes ``<graph>.txt``, ``trace.json``, ``timeline.png`` and ``summary.json`` there.
    """
    hw = load_hardware(hardware, calibration)
    topology = Topology.of(world_size, hw, hosts)
    if optimizer is not None and optimizer not in OPTIMIZER_PASSES:
        raise ValueError(f"explain: unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_PASSES)} or None")
    if isinstance(hardware, str) and backend_kw.get("prefetch") == "auto":  # the backend chooses with this model
        path = calibration if isinstance(calibration, (str, Path)) else None
        backend_kw = {"hardware": hardware, "calibration": path, **backend_kw}
    fused = hw.name != "cpu" if fused_attention is None else fused_attention
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"explain: unknown model preset {model!r}; use one of {sorted(PRESETS)} or pass a module")
        model = PRESETS[model]
    extrapolate: tuple[int, int] | None = None
    traced_layers: int | None = None
    if isinstance(model, ModelConfig):
        cfg = model
        seq = seq or cfg.max_seq_len
        traced_layers = cfg.n_layers
        if trace_layers is not None and cfg.n_layers > trace_layers >= 1:
            k = max(trace_layers, _least_traced(backend_kw.get("prefetch", 1)))
            if cfg.n_layers > k:
                extrapolate, traced_layers = (k, cfg.n_layers), k

        def build(layers: int) -> _Traced:
            """The preset at ``layers`` blocks on the meta device, traced with a next-token loss."""
            with torch.device("meta"):
                built = Transformer(cfg.with_(n_layers=layers, max_seq_len=max(seq, cfg.max_seq_len))).to(dtype)
            tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")  # type: ignore[arg-type]
            return _trace(built, tokens, loss or (lambda logits: loss_fn(logits, tokens)), world_size, dedicated,
                          backend_kw, blocks, fused, mp_policy, root_reshard_after_forward)

        traced = build(traced_layers)
    elif isinstance(model, nn.Module):
        if example_input is None:
            raise TypeError("explain: pass example_input=... (a tensor the module takes) with a module")
        traced = _trace(model, example_input, loss or _sum_loss, world_size, dedicated, backend_kw, blocks, fused,
                        mp_policy, root_reshard_after_forward)
    else:
        raise TypeError("explain: model must be a preset name, a ModelConfig or an nn.Module, "
                        f"not {type(model).__name__}")
    timelines = _timelines(traced, topology, optimizer)
    summary = _summarize(timelines, hw)
    summary.update(world_size=world_size, hosts=topology.hosts, traced_layers=traced_layers, optimizer=optimizer,
                   attention="fused" if fused else "as traced")
    note = ""
    if extrapolate is not None:
        k, n = extrapolate
        base = _summarize(_timelines(build(k - 1), topology, optimizer), hw)
        for key in ("step_ms", "compute_ms", "optimizer_ms", "exposed_comm_ms"):
            summary[key] = summary[key] + (n - k) * (summary[key] - base[key])
        step_ms = summary["step_ms"]
        summary["exposed_comm_pct"] = 100.0 * summary["exposed_comm_ms"] / step_ms if step_ms else 0.0
        summary["layers"] = n
        summary["extrapolated_from_layers"] = [k - 1, k]
        note = (f"# {k} of the model's {n} identical blocks traced; times here are theirs. "
                f"summary.json extends the totals to {n} blocks ({summary['step_ms']:.1f} ms a step).\n")
    tables = {kind: note + table(gm, timelines[kind], traced.labels) for kind, gm in traced.graphs.items()}
    result = Explanation(traced.graphs, timelines, tables, summary)
    if out_dir is not None:
        result.files = _write(result, Path(out_dir), note.lstrip("# ").rstrip())
    return result


def _write(result: Explanation, out: Path, note: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    texts = {f"{kind}.txt": text + "\n" for kind, text in result.tables.items()}
    texts["trace.json"] = json.dumps(chrome_trace(result.timelines))
    texts["summary.json"] = json.dumps(result.summary, indent=2) + "\n"
    files = [out / name for name in texts]
    for path, text in zip(files, texts.values()):
        path.write_text(text)
    try:
        write_png(result.timelines, out / "timeline.png", title=note)
        files.append(out / "timeline.png")
    except RuntimeError as e:  # matplotlib missing
        print(f"explain: no PNG ({e})")
    return files
