"""``explain``: see a model's FSDP schedule, and its predicted cost, without a GPU or real memory.

The model is built on the meta device (or taken as given), sharded as for a run at ``world_size``
ranks on a *fake* process group, compiled with ``fsdp_backend`` (no Inductor) and run once forward and
backward on meta tensors, attention traced as the GPU's fused kernel (``fused_attention.py``). The
scheduled graphs that would reach Inductor are then simulated with the cost model (``cost.py``,
``fusion.py``, ``timeline.py``), the optimizer step is added (``cost.optimizer_seconds``), and the
result is written out: a text table per graph, a Chrome/Perfetto trace, a PNG timeline and a summary
(estimated step time, exposed communication, peak bytes in flight).

NOTE [periodic blocks]: the blocks of a built-in transformer are identical, so its schedule repeats
block by block. Tracing 80 blocks costs minutes on a small CPU; ``explain`` traces ``trace_layers``
and ``trace_layers - 1`` blocks and extends the totals linearly to the full depth (peaks in flight are
those of the periodic middle). The tables, trace and picture show the traced depth, and say so. The
shallower copy must have a middle: at least two blocks, and more than the prefetch reaches ahead
(``_least_traced``), else the two copies' difference is not one block's cost: the start and end of
the schedule (the first gathers, the last reduce-scatters) differ between them as well.
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
    """What ``explain`` found: scheduled graphs, their timelines and tables, and a summary.

    ``timelines`` also holds ``"optimizer"`` (one span: the optimizer step) unless ``optimizer=None``.
    """

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


def _trace(
    model: nn.Module,
    example: Tensor,
    loss: Callable[[Any], Tensor],
    world_size: int,
    dedicated: str,
    backend_kw: Mapping[str, Any],
    blocks: Callable[[nn.Module], list[nn.Module]],
    fused_attention: bool,
    mp_policy: MixedPrecisionPolicy | None,
    root_reshard: bool = True,
) -> _Traced:
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif dist.get_backend() != "fake" or dist.get_world_size() != world_size:
        raise ValueError(
            "explain: a real process group is initialised in this process; explain runs on a fake one of "
            f"world_size={world_size}: call it before init_process_group, or in a separate process."
        )
    try:
        groups = FsdpGroups.create(dedicated=dedicated)
        for block in blocks(model):  # not outlined: the cost model estimates op by op, and FusedAttention
            fully_shard(block, groups=groups, outline=False, mp_policy=mp_policy)  # must see every block's attention
        fully_shard(model, groups=groups, mp_policy=mp_policy, reshard_after_forward=root_reshard)
        shards = [(p.numel(), p.element_size()) for p in model.parameters() if p.requires_grad]
        backend = make_backend(inductor=False, check_agreement=False, **backend_kw)  # hardware: see explain()
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
    """The fewest blocks the deeper trace may hold (NOTE [periodic blocks]): the shallower one holds two
    blocks and more than the units gathered ahead (``"auto"``: the deepest the cost model tries)."""
    ahead = max(DEPTHS) if prefetch == "auto" else int(prefetch)  # type: ignore[call-overload]
    return max(3, ahead + 2)


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _sum_loss(out: Any) -> Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float().sum()


def _preset(cfg: ModelConfig, dtype: torch.dtype, batch: int, seq: int) -> tuple[nn.Module, Tensor, Callable[[Any], Tensor]]:
    """A preset transformer on the meta device, its input, and its next-token loss."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, tokens, lambda logits: loss_fn(logits, tokens)


def _optimizer_timeline(seconds: float, optimizer: str, params: int) -> Timeline:
    span = Span(f"{optimizer}.step ({params / 1e6:.1f}M params)", optimizer, "compute", None, "", 0, 0.0, seconds)
    return Timeline(spans=(span,), step_seconds=seconds, compute_seconds=seconds, exposed_comm_seconds=0.0)


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
        timelines["optimizer"] = _optimizer_timeline(seconds, optimizer, sum(n for n, _ in traced.shards))
    return timelines


def explain(
    model: str | ModelConfig | nn.Module = "demo",
    *,
    world_size: int = 8,
    hosts: int | None = None,
    hardware: str | Hardware = "h200",
    calibration: str | Path | Mapping[str, Any] | None = None,
    batch: int = 1,
    seq: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    mp_policy: MixedPrecisionPolicy | None = None,
    root_reshard_after_forward: bool = True,
    example_input: Tensor | None = None,
    loss: Callable[[Any], Tensor] | None = None,
    blocks: Callable[[nn.Module], list[nn.Module]] = _default_blocks,
    dedicated: str = "reduce_scatter",
    optimizer: str | None = "adamw",
    fused_attention: bool | None = None,
    trace_layers: int | None = 4,
    out_dir: str | Path | None = None,
    **backend_kw: Any,
) -> Explanation:
    """Schedule ``model`` for ``world_size`` ranks and predict its training step on ``hardware``; no GPU needed.

    ``model``: a preset name (``"tiny"``, ``"demo"``, ``"llama3-8b"``, ``"llama3-70b"``), a
    ``ModelConfig``, or an unsharded ``nn.Module`` (then give ``example_input``, and ``loss``, a function
    of the output, if ``output.float().sum()`` is not the loss; ``blocks(model)`` lists the modules
    sharded before the root, by default ``model.layers``). Presets are built on the meta device in
    ``dtype`` with ``batch`` sequences of ``seq`` tokens per rank and a next-token cross-entropy loss.
    ``mp_policy``: ``fully_shard``'s mixed precision for every unit, e.g. bf16 compute over fp32 shards
    with fp32 gradient reduction: ``dtype=torch.float32, mp_policy=MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (the CLI's ``--dtype mixed``).
    ``root_reshard_after_forward``: the root unit's ``reshard_after_forward`` (``False``: the root's
    parameters that backward reads, such as the output head, stay gathered from forward into backward).
    ``hardware``: a preset of ``cost.HARDWARE``; ``calibration``: measured numbers overriding it.
    ``hosts``: the hosts the ``world_size`` ranks sit on, the same number of GPUs on each (default:
    hosts of the preset's ``ranks_per_node`` GPUs, ``Topology.of``); a group that spans hosts runs at
    the inter-host bandwidth (NOTE [collective time]).
    ``optimizer``: the step after backward, costed over this rank's shards (``"adamw"``, ``"adam"``,
    ``"sgd"``: torch.optim's default foreach implementations; ``"adamw-fused"``: ``AdamW(fused=True)``;
    ``None``: forward and backward only).
    ``fused_attention``: trace SDPA as the GPU's fused kernel (default: unless ``hardware`` is the CPU).
    ``trace_layers``: see NOTE [periodic blocks] (``None`` traces every block). Other keyword arguments
    go to ``make_backend`` (``schedule``, ``prefetch``, ``prefetch_bytes``, ``reduce_scatter_bytes``),
    and the graphs are scheduled as that backend schedules them on a GPU: with ``prefetch="auto"`` it
    picks its settings with this cost model (``hardware``, ``calibration``), else ``reduce_scatter_bytes
    ="auto"`` keeps one unit's reduce-scatters in flight.
    With ``out_dir``, writes ``<graph>.txt``, ``trace.json``, ``timeline.png`` and ``summary.json`` there.
    """
    hw = load_hardware(hardware, calibration)
    topology = Topology.of(world_size, hw, hosts)
    if optimizer is not None and optimizer not in OPTIMIZER_PASSES:
        raise ValueError(f"explain: unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_PASSES)} or None")
    if isinstance(hardware, str) and backend_kw.get("prefetch") == "auto":  # the backend's choices: this cost model
        backend_kw = {"hardware": hardware, "calibration": calibration if isinstance(calibration, (str, Path)) else None,
                      **backend_kw}
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
        depth = cfg.n_layers
        if trace_layers is not None and depth > trace_layers >= 1:
            k = max(trace_layers, _least_traced(backend_kw.get("prefetch", 1)))
            if depth > k:
                extrapolate = (k, depth)
                depth = k
        traced_layers = depth

        def build(layers: int) -> _Traced:
            built, tokens, preset_loss = _preset(cfg.with_(n_layers=layers, max_seq_len=max(seq, cfg.max_seq_len)),
                                                 dtype, batch, seq)  # type: ignore[arg-type]
            return _trace(built, tokens, loss or preset_loss, world_size, dedicated, backend_kw, blocks, fused, mp_policy,
                          root_reshard_after_forward)

        traced = build(depth)
    elif isinstance(model, nn.Module):
        if example_input is None:
            raise TypeError("explain: pass example_input=... (a tensor the module takes) with a module")
        traced = _trace(model, example_input, loss or _sum_loss, world_size, dedicated, backend_kw, blocks, fused,
                        mp_policy, root_reshard_after_forward)
    else:
        raise TypeError(f"explain: model must be a preset name, a ModelConfig or an nn.Module, not {type(model).__name__}")

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
        summary["exposed_comm_pct"] = 100.0 * summary["exposed_comm_ms"] / summary["step_ms"] if summary["step_ms"] else 0.0
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
    files = []
    for kind, text in result.tables.items():
        path = out / f"{kind}.txt"
        path.write_text(text + "\n")
        files.append(path)
    trace = out / "trace.json"
    trace.write_text(json.dumps(chrome_trace(result.timelines)))
    summary = out / "summary.json"
    summary.write_text(json.dumps(result.summary, indent=2) + "\n")
    files += [trace, summary]
    try:
        png = out / "timeline.png"
        write_png(result.timelines, png, title=note)
        files.append(png)
    except RuntimeError as e:  # matplotlib missing: the rest is still useful
        print(f"explain: no PNG ({e})")
    return files
