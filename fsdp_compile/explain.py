"""``explain``: see a model's FSDP schedule, and its predicted cost, without a GPU or real memory.

The model is built on the meta device (or taken as given), sharded as for a run at ``world_size``
ranks on a *fake* process group, compiled with ``fsdp_backend`` (no Inductor) and run once forward and
backward on meta tensors. The scheduled graphs that would reach Inductor are then simulated with the
cost model (``cost.py``, ``timeline.py``) and written out: a text table per graph, a Chrome/Perfetto
trace, a PNG timeline and a summary (estimated step time, exposed communication, peak bytes in flight).

NOTE [periodic blocks]: the blocks of a built-in transformer are identical, so its schedule repeats
block by block. Tracing 80 blocks costs minutes on a small CPU; ``explain`` traces ``trace_layers``
and ``trace_layers - 1`` blocks and extends the totals linearly to the full depth (peaks in flight are
those of the periodic middle). The tables, trace and picture show the traced depth.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from .backend import make_backend, observe_graphs
from .cost import Hardware, load_hardware
from .groups import FsdpGroups
from .models import PRESETS, ModelConfig, Transformer
from .schedule import group_labels
from .sharding import fully_shard
from .timeline import Timeline, chrome_trace, simulate, table, write_png

__all__ = ["Explanation", "explain"]


@dataclass
class Explanation:
    """What ``explain`` found: scheduled graphs, their timelines and tables, and a summary."""

    graphs: dict[str, fx.GraphModule]
    timelines: dict[str, Timeline]
    tables: dict[str, str]
    summary: dict[str, Any]
    files: list[Path] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"== {kind} ==\n{text}" for kind, text in self.tables.items()]
        return "\n\n".join([*parts, "== summary ==\n" + json.dumps(self.summary, indent=2)])


def _graphs_for(
    model: nn.Module,
    example: torch.Tensor,
    world_size: int,
    dedicated: str,
    backend_kw: Mapping[str, Any],
    blocks: Callable[[nn.Module], list[nn.Module]],
) -> tuple[dict[str, fx.GraphModule], dict[str, str]]:
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
        for block in blocks(model):
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        backend = make_backend(inductor=False, check_agreement=False, **backend_kw)  # hardware: see explain()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        with observe_graphs() as seen:
            out = compiled(example)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if out.requires_grad:
                out.float().sum().backward()
        labels = group_labels(groups)
        groups.destroy()
        return dict(seen), labels
    finally:
        if owned:
            dist.destroy_process_group()


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _preset_model(cfg: ModelConfig, dtype: torch.dtype, batch: int, seq: int) -> tuple[nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    return model, torch.zeros(batch, seq, dtype=torch.long, device="meta")


def _summarize(timelines: Mapping[str, Timeline], hw: Hardware) -> dict[str, Any]:
    step = sum(t.step_seconds for t in timelines.values())
    exposed = sum(t.exposed_comm_seconds for t in timelines.values())
    compute = sum(t.compute_seconds for t in timelines.values())
    peaks: dict[str, int] = {}
    for t in timelines.values():
        for kind, b in t.in_flight.items():
            peaks[kind] = max(peaks.get(kind, 0), b)
    return {
        "hardware": hw.name,
        "step_ms": 1e3 * step,
        "compute_ms": 1e3 * compute,
        "exposed_comm_ms": 1e3 * exposed,
        "exposed_comm_pct": 100.0 * exposed / step if step else 0.0,
        "peak_bytes_in_flight": peaks,
        "per_graph": {k: t.summary() for k, t in timelines.items()},
    }


def explain(
    model: str | ModelConfig | nn.Module = "demo",
    *,
    world_size: int = 8,
    hardware: str | Hardware = "h200",
    calibration: str | Path | Mapping[str, Any] | None = None,
    batch: int = 1,
    seq: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    example_input: torch.Tensor | None = None,
    blocks: Callable[[nn.Module], list[nn.Module]] = _default_blocks,
    dedicated: str = "reduce_scatter",
    trace_layers: int | None = 4,
    out_dir: str | Path | None = None,
    **backend_kw: Any,
) -> Explanation:
    """Schedule ``model`` for ``world_size`` ranks and predict its cost on ``hardware``; no GPU needed.

    ``model``: a preset name (``"tiny"``, ``"demo"``, ``"llama3-8b"``, ``"llama3-70b"``), a
    ``ModelConfig``, or an unsharded ``nn.Module`` (then give ``example_input``; ``blocks(model)`` lists
    the modules sharded before the root, by default ``model.layers``). Presets are built on the meta
    device in ``dtype`` with input ``(batch, seq)``. ``hardware``: a preset of ``cost.HARDWARE``;
    ``calibration``: measured numbers overriding it. ``trace_layers``: see NOTE [periodic blocks]
    (``None`` traces every block). Other keyword arguments go to ``make_backend`` (``schedule``,
    ``prefetch``, ``prefetch_bytes``, ``reduce_scatter_bytes``). With ``out_dir``, writes
    ``<graph>.txt``, ``trace.json``, ``timeline.png`` and ``summary.json`` there.
    """
    hw = load_hardware(hardware, calibration)
    if isinstance(hardware, str):  # "auto" settings use the same cost model
        backend_kw = {"hardware": hardware, "calibration": calibration if isinstance(calibration, (str, Path)) else None,
                      **backend_kw}
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"explain: unknown model preset {model!r}; use one of {sorted(PRESETS)} or pass a module")
        model = PRESETS[model]
    extrapolate: tuple[int, int] | None = None
    if isinstance(model, ModelConfig):
        cfg = model
        seq = seq or cfg.max_seq_len
        depth = cfg.n_layers
        if trace_layers is not None and depth > trace_layers >= 2:
            extrapolate = (trace_layers, depth)
            depth = trace_layers
        built, example = _preset_model(cfg.with_(n_layers=depth, max_seq_len=max(seq, cfg.max_seq_len)),
                                       dtype, batch, seq)
        graphs, labels = _graphs_for(built, example, world_size, dedicated, backend_kw, blocks)
    elif isinstance(model, nn.Module):
        if example_input is None:
            raise TypeError("explain: pass example_input=... (a tensor the module takes) with a module")
        graphs, labels = _graphs_for(model, example_input, world_size, dedicated, backend_kw, blocks)
    else:
        raise TypeError(f"explain: model must be a preset name, a ModelConfig or an nn.Module, not {type(model).__name__}")

    timelines = {kind: simulate(gm, hw) for kind, gm in graphs.items()}
    summary = _summarize(timelines, hw)
    summary.update(world_size=world_size, traced_layers=depth if isinstance(model, ModelConfig) else None)
    if extrapolate is not None:
        k, n = extrapolate
        shallower, _ = _graphs_for(*_preset_model(cfg.with_(n_layers=k - 1, max_seq_len=max(seq, cfg.max_seq_len)),
                                                  dtype, batch, seq),
                                   world_size, dedicated, backend_kw, blocks)
        base = _summarize({kind: simulate(gm, hw) for kind, gm in shallower.items()}, hw)
        for key in ("step_ms", "compute_ms", "exposed_comm_ms"):
            summary[key] = summary[key] + (n - k) * (summary[key] - base[key])
        summary["exposed_comm_pct"] = 100.0 * summary["exposed_comm_ms"] / summary["step_ms"] if summary["step_ms"] else 0.0
        summary["layers"] = n
        summary["extrapolated_from_layers"] = [k - 1, k]
    tables = {kind: table(gm, timelines[kind], labels) for kind, gm in graphs.items()}
    result = Explanation(graphs, timelines, tables, summary)
    if out_dir is not None:
        result.files = _write(result, Path(out_dir))
    return result


def _write(result: Explanation, out: Path) -> list[Path]:
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
        write_png(result.timelines, png)
        files.append(png)
    except RuntimeError as e:  # matplotlib missing: the rest is still useful
        print(f"explain: no PNG ({e})")
    return files
