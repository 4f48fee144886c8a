#!/usr/bin/env bash
# Step time of fsdp-compile beside its peers on one H200 (device kind nvidia-h200, torch 2.11, world
# size 1), with where each copy kernel comes from:
#   1. GPU kernels by class and the launch site of every copy kernel (benchmarks/host_profile.py
#      --kernels --copy-sources), fsdp-compile and SimpleFSDP, Llama 4 x D4096, 2x2048 tokens;
#   2. step time side by side, variants alternated, at 4 x D4096 (GPU-bound) and 32 x D1024 (launch-bound);
#   3. (part megatron, not in all) Megatron-FSDP beside fsdp-compile at both shapes, 3 rounds each.
# SimpleFSDP and Megatron-FSDP come from wheels carried in .whl/ (torchtitan==0.2.2, megatron-fsdp 0.6.1
# and einops, --no-deps; see the device README).
# Usage: bash benchmarks/h200_peers_step.sh OUT [part]   (part: kernels, gpu, launch, megatron; default all)
set -uo pipefail
OUT=${1:-out}
PART=${2:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/carried_wheels.sh
quiet() { grep -v "^\[kernel\|Warning\|warn"; }
if [[ $PART == all || $PART == kernels ]]; then
  timeout 200 python3 -m benchmarks.host_profile --preset gpu-llama-4096 --variants fsdp-compile,simplefsdp \
    --kernels --copy-sources --steps 3 --json "$OUT/kernels-gpu-llama-4096-copies.json" 2>&1 | quiet | tail -30
fi
if [[ $PART == all || $PART == gpu ]]; then
  timeout 260 python3 -m benchmarks.step_time --preset gpu-llama-4096 --spawn 1 --rounds 5 --no-png \
    --variants fsdp-compile,simplefsdp,fsdp-compile-whole,fsdp2-compile \
    --json "$OUT/step_time-gpu-llama-4096-peers-w1.json" 2>&1 | quiet | tail -12
fi
if [[ $PART == all || $PART == launch ]]; then
  timeout 330 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 32 --spawn 1 --rounds 5 --no-png \
    --variants fsdp-compile,fsdp-compile-whole,simplefsdp,compile \
    --json "$OUT/step_time-gpu-llama-1024-L32-peers-w1.json" 2>&1 | quiet | tail -12
fi
if [[ $PART == megatron ]]; then
  timeout 280 python3 -m benchmarks.step_time --preset gpu-llama-4096 --spawn 1 --rounds 3 --no-png \
    --variants fsdp-compile,fsdp-compile-keep,megatron-fsdp,fsdp2-eager \
    --json "$OUT/step_time-gpu-llama-4096-megatron-w1.json" 2>&1 | quiet | tail -12
  timeout 280 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 32 --spawn 1 --rounds 3 --no-png \
    --variants fsdp-compile-keep,megatron-fsdp \
    --json "$OUT/step_time-gpu-llama-1024-L32-megatron-w1.json" 2>&1 | quiet | tail -12
fi
