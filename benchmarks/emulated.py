"""fsdp-compile and its peers as rank 0 of an emulated world of N GPUs (``fsdp_compile.emulate``), each in its own process.

    python -m benchmarks.emulated emulate --world 8 --variant all --out out/emulated-w8
    python -m benchmarks.emulated emulate --world 64 --hosts 8 --variant all --out out/emulated-w64

The variants of ``python -m fsdp_compile emulate`` plus SimpleFSDP (torchtitan's ``data_parallel`` in
``fully_shard`` mode, bf16 parameters and fp32 reduction, compiled with Inductor's overlap bucketing as in
``benchmarks/baselines.py``; the ``bench`` extra). Values are not a real run's: every rank holds rank
0's data (NOTE [emulated backend]).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.baselines import _simple_fsdp_backend, _simple_fsdp_module
from fsdp_compile.examples import emulate as cli
from fsdp_compile.examples.models import ModelConfig, _rope_tables

VARIANTS = (*cli.VARIANTS, "simplefsdp")


def build(variant: str, cfg: ModelConfig, tokens: int, device: torch.device, dtype: str,
          options: dict[str, Any] | None = None, root_reshard: bool = True) -> Callable[[], None]:
    """``cli.build_step``'s variants, and SimpleFSDP: sharded on meta, shards filled with N(0, 0.02)
    (SimpleFSDP re-gathers every parameter in backward: ``root_reshard`` does not apply)."""
    if variant != "simplefsdp":
        return cli.build_step(variant, cfg, tokens, device, dtype, options, root_reshard)
    from torch.distributed.device_mesh import init_device_mesh

    simple = _simple_fsdp_module()
    model = cli.meta_model(cfg, tokens, dtype)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    mp = simple.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "mixed" \
        else None
    simple.data_parallel(model, mesh, mode="fully_shard", mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():  # values do not change the step's time; every rank's are rank 0's anyway
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
        cos, sin = _rope_tables(model.cfg)  # to_empty left the RoPE tables uninitialised
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    forward = torch.compile(model, backend=_simple_fsdp_backend(device.type), fullgraph=True)
    return cli._step(forward, model, cfg, tokens, device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.emulated", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    cli.add_arguments(sub.add_parser("emulate"), VARIANTS)
    return cli.main(p.parse_args(argv), build=build, module="benchmarks.emulated")


if __name__ == "__main__":
    sys.exit(main())
