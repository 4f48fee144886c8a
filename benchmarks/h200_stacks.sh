#!/usr/bin/env bash
# Issue 11 on one H200 (device kind nvidia-h200, torch 2.11, world size 1 with the collectives kept):
# the stacked blocks (one BlockStack, one loop: NOTE [stacked blocks]) beside the outlined default and
# SimpleFSDP, Llama blocks of D=1024, 1x1024 tokens, bf16.
#   compile  cold compile by stage at 4 and 32 blocks, 2 rounds alternated, 20 timed fwd+bwd steps each;
#   warm     second process start against the first (every cache on), stacked, 4 and 32 blocks;
#   kernels  GPU kernels by class per step, with where each copy kernel comes from, 16 blocks;
#   step     full training step (AdamW), outlined against stacked, 16 blocks, 3 alternated rounds;
#   bound    the same at a GPU-bound shape: 4 x D=4096, 2x2048 tokens.
# Usage: bash benchmarks/h200_stacked.sh OUT [part]   (part: smoke, compile, warm, kernels, step, profile
# (kernels and step), bound, late (warm and bound), peers (the default's step beside SimpleFSDP and
# FSDP2 + compile, 16 blocks), cudatest (tests/test_cuda.py's stacked test); default all)
set -uo pipefail
OUT=${1:-out}
PART=${2:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
source benchmarks/carried_wheels.sh
SHAPE=(--device cuda --dim 1024 --heads 16 --vocab 32000 --seq 1024 --batch 1 --dtype bf16)
quiet() { grep -v "^\[kernel\|Warning\|warn"; }
if [[ $PART == smoke ]]; then
  timeout 200 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 --variants fsdp-compile-stacked \
    --steps 5 --json "$OUT/compile_time-cold-cuda-w1-stacked-smoke.json" 2>&1 | quiet | tail -8
fi
if [[ $PART == all || $PART == compile ]]; then
  timeout 560 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 32 --rounds 2 --steps 20 \
    --variants fsdp-compile fsdp-compile-stacked simplefsdp \
    --json "$OUT/compile_time-cold-cuda-w1-L4-32-stacked.json" 2>&1 | quiet | tail -12
fi
if [[ $PART == all || $PART == warm || $PART == late ]]; then
  timeout 250 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 32 --warm-start \
    --variants fsdp-compile-stacked --json "$OUT/compile_time-warm-cuda-w1-stacked.json" 2>&1 | quiet | tail -8
fi
if [[ $PART == all || $PART == kernels || $PART == profile ]]; then
  timeout 200 python3 -m benchmarks.host_profile --preset gpu-llama-1024 --layers 16 --kernels --copy-sources \
    --steps 3 --variants fsdp-compile-keep,fsdp-compile-keep-stacked \
    --json "$OUT/kernels-gpu-llama-1024-L16-stacked.json" 2>&1 | quiet | tail -60
fi
if [[ $PART == all || $PART == step || $PART == profile ]]; then
  timeout 330 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 16 --spawn 1 --rounds 3 --no-png \
    --profile-steps 0 --variants fsdp-compile-keep,fsdp-compile-keep-stacked \
    --json "$OUT/step_time-gpu-llama-1024-L16-stacked-w1.json" 2>&1 | quiet | tail -10
fi
if [[ $PART == all || $PART == bound || $PART == late ]]; then
  timeout 300 python3 -m benchmarks.step_time --preset gpu-llama-4096 --spawn 1 --rounds 3 --no-png \
    --profile-steps 0 --variants fsdp-compile-keep,fsdp-compile-keep-stacked \
    --json "$OUT/step_time-gpu-llama-4096-stacked-w1.json" 2>&1 | quiet | tail -8
fi
if [[ $PART == cudatest ]]; then
  timeout 300 python3 -m pytest -q -x tests/test_cuda.py -k stacked 2>&1 | tail -15
fi
if [[ $PART == peers ]]; then
  timeout 330 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 16 --spawn 1 --rounds 3 --no-png \
    --profile-steps 0 --variants fsdp-compile,simplefsdp,fsdp2-compile \
    --json "$OUT/step_time-gpu-llama-1024-L16-peers-w1-stop22.json" 2>&1 | quiet | tail -8
fi
