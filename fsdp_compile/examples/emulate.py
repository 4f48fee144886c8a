"""``python -m fsdp_compile emulate``: train a preset model as rank 0 of an emulated world and report the step.

One variant per process (``--variant all``: one process each, then their table): fsdp-compile (reduce-scatters
on their own communicator), fsdp-compile-delayed (one communicator, the delayed schedule) and FSDP2 +
``torch.compile``. ``benchmarks/emulated.py`` adds SimpleFSDP.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile._compat import inductor_config_patch
from fsdp_compile.emulate.group import init_emulated_world
from fsdp_compile.emulate.measure import StepReport, measure_steps
from fsdp_compile.emulate.timing import EmulatedTopology
from fsdp_compile.examples.models import PRESETS, ModelConfig, Transformer, loss_fn
from fsdp_compile.inspection.hardware import HARDWARE, load_hardware
from fsdp_compile.inspection.topology import SHARED_LINKS

__all__ = ["VARIANTS", "add_arguments", "main", "build_step", "meta_model", "run_variant", "train_flops"]

VARIANTS = ("fsdp-compile", "fsdp-compile-delayed", "fsdp2-compile")
VALUES_NOTE = ("emulated world: compute and memory are this GPU's, collectives are timed by the hardware model, and "
               "every rank's data is rank 0's, so losses are not a real run's")


def train_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of one training step over one sequence: 6 N per token (N without the embedding) plus attention's."""
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(cfg).parameters()) - cfg.vocab_size * cfg.dim
    return float(tokens * (6 * n + 12 * cfg.n_layers * cfg.dim * tokens))


def meta_model(cfg: ModelConfig, tokens: int, dtype: str) -> Transformer:
    """The model on the meta device, its parameters fp32 (``dtype="mixed"``) or bf16 (``"bf16"``)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.with_(max_seq_len=max(cfg.max_seq_len, tokens)))
    return model.to(torch.bfloat16) if dtype == "bf16" else model


def build_step(variant: str, cfg: ModelConfig, tokens: int, device: torch.device, dtype: str = "mixed",
               options: dict[str, Any] | None = None, root_reshard: bool = True) -> Callable[[], None]:
    """One training step of ``variant`` on this rank's shards; ``options`` go to our variants' ``make_backend``,
    ``root_reshard`` is our root unit's ``reshard_after_forward``."""
    from fsdp_compile import FsdpGroups, MixedPrecisionPolicy, fully_shard, make_backend
    model = meta_model(cfg, tokens, dtype)
    bf16_over_fp32 = dtype == "mixed"
    if variant in ("fsdp-compile", "fsdp-compile-delayed"):
        delayed = variant.endswith("delayed")
        groups = FsdpGroups.create(dedicated="none" if delayed else "reduce_scatter")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_over_fp32 else None
        for block in model.layers:
            fully_shard(block, groups=groups, mp_policy=mp)
        fully_shard(model, groups=groups, mp_policy=mp, reshard_after_forward=root_reshard)
        backend = make_backend(**{"schedule": "delayed" if delayed else "eager", **(options or {})})
        forward: Any = torch.compile(model, backend=backend)
    elif variant == "fsdp2-compile":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Mp
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp2 = Fsdp2Mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_over_fp32 else Fsdp2Mp()
        for block in model.layers:
            fsdp2_fully_shard(block, mesh=mesh, mp_policy=mp2)
        fsdp2_fully_shard(model, mesh=mesh, mp_policy=mp2)
        forward = torch.compile(model)
    else:
        raise ValueError(f"build_step: unknown variant {variant!r}; expected one of {VARIANTS}")
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    return _step(forward, model, cfg, tokens, device)


def _step(forward: Any, model: torch.nn.Module, cfg: ModelConfig, tokens: int,
          device: torch.device) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    data = torch.randint(0, cfg.vocab_size, (1, tokens + 1), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> None:
        loss_fn(forward(data[:, :-1]), data[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def add_arguments(p: argparse.ArgumentParser, variants: tuple[str, ...] = VARIANTS) -> None:
    p.set_defaults(variants=variants)
    p.add_argument("--world", type=int, default=8, help="ranks in the emulated world")
    p.add_argument("--hosts", type=int, default=1, help="hosts the world is spread over (world %% hosts == 0)")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE), help="the hardware model's preset")
    p.add_argument("--calibration", default=None, help="JSON of measured numbers overriding the preset")
    p.add_argument("--blocks", type=int, default=32,
                   help="thread blocks an emulated collective holds (an NCCL kernel holds one per channel)")
    p.add_argument("--shared", type=float, default=SHARED_LINKS,
                   help="bandwidth concurrent collectives share, in solo collectives (NOTE [collective time])")
    p.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step (one sequence)")
    p.add_argument("--dtype", default="mixed", choices=["mixed", "bf16"],
                   help="'mixed': bf16 compute over fp32 shards, fp32 reduction; 'bf16': everything bf16")
    p.add_argument("--variant", default="fsdp-compile", choices=[*variants, "all"],
                   help="one variant in this process, or 'all': each in a process of its own")
    p.add_argument("--option", action="append", default=None, metavar="NAME=VALUE",
                   help="a make_backend option for our variants, VALUE a Python literal (e.g. bucket_alone_bytes=None)")
    p.add_argument("--root-reshard", action=argparse.BooleanOptionalAction, default=True,
                   help="our root unit reshards after forward (--no-root-reshard: the parameters backward reads "
                        "first, such as the output head, stay gathered into backward, as FSDP2's root does)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let compiles load from the compile caches (default: every compile cold, so that a run "
                        "measures what this code compiles, not what an earlier run left in the cache)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="out/emulate", help="directory for summary.json and each variant's trace")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)  # a child's report, for --variant all


def _argv(ns: argparse.Namespace, variant: str, json_path: str) -> list[str]:
    """The command line of one variant's process."""
    argv = ["emulate", "--variant", variant, "--json", json_path]
    for name in ("world", "hosts", "hardware", "calibration", "blocks", "shared", "model", "layers", "tokens", "dtype",
                 "steps", "warmup", "out"):
        if getattr(ns, name) is not None:
            argv += [f"--{name}", str(getattr(ns, name))]
    for pair in ns.option or []:
        argv += ["--option", pair]
    if not ns.root_reshard:
        argv.append("--no-root-reshard")
    if ns.warm_cache:
        argv.append("--warm-cache")
    return argv


Builder = Callable[..., Callable[[], None]]


def backend_options(pairs: list[str] | None) -> dict[str, Any]:
    """``--option`` pairs ``["name=value", ...]`` as make_backend keyword arguments."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        try:
            options[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"emulate: --option {pair!r}: expected NAME=VALUE with a Python literal value, "
                             "e.g. --option bucket_alone_bytes=None or --option prefetch=2") from None
        if not sep or not name.strip():
            raise SystemExit(f"emulate: --option {pair!r}: expected NAME=VALUE, e.g. --option prefetch=2")
    return options


def run_variant(ns: argparse.Namespace, variant: str, build: Builder = build_step) -> StepReport:
    """Start the emulated world ``ns`` describes, build ``variant`` with ``build`` and measure its steps."""
    hw = load_hardware(ns.hardware, ns.calibration)
    init_emulated_world(EmulatedTopology(ns.world, hw, hosts=ns.hosts, blocks=ns.blocks, shared=ns.shared))
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = PRESETS[ns.model].with_(**({"n_layers": ns.layers} if ns.layers else {}))
    with inductor_config_patch({"force_disable_caches": not ns.warm_cache}):
        step = build(variant, cfg, ns.tokens, device, ns.dtype, backend_options(ns.option), ns.root_reshard)
        report = measure_steps(step, label=variant, steps=ns.steps, warmup=ns.warmup,
                               flops_per_step=train_flops(cfg, ns.tokens), peak_flops=hw.peak_flops_bf16,
                               trace=Path(ns.out) / f"trace-{variant}-w{ns.world}.json.gz")
    dist.destroy_process_group()
    return report


def _write_summary(path: Path, args: dict[str, Any], reports: list[dict[str, Any]]) -> None:
    """Write ``reports`` to ``path``, keeping the other variants' runs there with the same settings."""
    same = {k: v for k, v in args.items() if k not in ("variant", "variants", "json")}
    runs: list[dict[str, Any]] = []
    if path.exists():
        old = json.loads(path.read_text())
        if {k: v for k, v in old.get("args", {}).items() if k not in ("variant", "variants", "json")} == same:
            labels = {r["label"] for r in reports}
            runs = [r for r in old.get("runs", []) if r.get("label") not in labels]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": args, "note": VALUES_NOTE, "runs": runs + reports}, indent=1))


def main(ns: argparse.Namespace, build: Builder = build_step, module: str = "fsdp_compile") -> int:
    """Run ``ns.variant`` here, or (``--variant all``) each of ``ns.variants`` in a ``python -m <module>``
    process of its own, and print their table."""
    if not torch.cuda.is_available():
        print("emulate: needs a CUDA GPU (the emulated collectives run kernels; the bookkeeping alone runs on "
              "CPU: see tests/test_emulate.py)", file=sys.stderr)
        return 2
    variants = list(getattr(ns, "variants", VARIANTS)) if ns.variant == "all" else [ns.variant]
    reports: list[dict[str, Any]] = []
    for variant in variants:
        if len(variants) == 1:
            reports.append(run_variant(ns, variant, build).to_json())
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", module, *_argv(ns, variant, f.name)]
            proc = subprocess.run(cmd, text=True, capture_output=True)
            if proc.returncode != 0:
                reports.append({"label": variant, "failed": proc.stderr[-3000:]})
            else:
                reports.append(json.loads(Path(f.name).read_text()))
    if getattr(ns, "json", None):
        Path(ns.json).write_text(json.dumps(reports[0]))
    _write_summary(Path(ns.out) / f"summary-w{ns.world}.json", vars(ns), reports)
    hw = load_hardware(ns.hardware, ns.calibration)
    print(EmulatedTopology(ns.world, hw, hosts=ns.hosts, blocks=ns.blocks, shared=ns.shared).describe())
    print(f"{ns.model}, {ns.layers or PRESETS[ns.model].n_layers} blocks, {ns.tokens} tokens per rank, {ns.dtype}; "
          f"{VALUES_NOTE}")
    print(StepReport.header())
    for r in reports:
        print(f"{r['label']:24} failed: {r['failed'].strip().splitlines()[-1][:160]}" if "failed" in r
              else StepReport(**r).row())
    return 0
