#!/usr/bin/env bash
# Issue 11 on one H200 (device kind nvidia-h200), Llama blocks of D=1024, 1x1024 tokens, bf16, world size 1
# with the collectives kept (NCCL):
#   1. warm start (NOTE [warm start] in fsdp_compile/cache.py): first and second process start over one
#      cache directory, every cache on, fsdp-compile at 4 and 32 blocks, plain torch.compile at 4;
#   2. cold compile of fsdp-compile beside torchtitan's SimpleFSDP (Inductor's overlap bucketing) at 4, 16
#      and 32 blocks, variants alternated, forward+backward step times after each compile.
# SimpleFSDP comes from a wheel carried in .whl/ (torchtitan==0.2.2, --no-deps; see the device README).
# Usage: bash benchmarks/h200_warm_and_peers.sh OUT
set -uo pipefail
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/carried_wheels.sh
MODEL="--device cuda --dim 1024 --heads 16 --vocab 32000 --seq 1024 --batch 1 --dtype bf16 --rounds 1"
timeout 230 python3 -m benchmarks.compile_time $MODEL --warm-start --layers 4 32 --variants fsdp-compile \
  --json "$OUT/compile_time-warm-cuda-w1.json" 2>&1 | tail -6
timeout 60 python3 -m benchmarks.compile_time $MODEL --warm-start --layers 4 --variants compile \
  --json "$OUT/compile_time-warm-cuda-w1-compile.json" 2>&1 | tail -3
timeout 330 python3 -m benchmarks.compile_time $MODEL --layers 4 16 32 --variants fsdp-compile simplefsdp --steps 10 \
  --json "$OUT/compile_time-cold-cuda-w1-simplefsdp.json" 2>&1 | grep -v "^\[kernel" | tail -9
