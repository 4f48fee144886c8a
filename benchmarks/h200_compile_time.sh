#!/usr/bin/env bash
# Issue 11 on one H200 (device kind nvidia-h200): cold compile by stage at world size 1 with the collectives
# kept (NCCL), plain torch.compile, fsdp-compile (outlined blocks, the default), fsdp-compile-whole (one
# whole-model graph) and FSDP2 + torch.compile side by side, Llama blocks of D=1024, 1x1024 tokens, bf16;
# forward+backward step times after each compile (--steps). Usage: bash benchmarks/h200_compile_time.sh OUT L...
set -euo pipefail
OUT=${1:-out}; shift
LAYERS=${*:-4 16 32}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m benchmarks.compile_time --device cuda --dim 1024 --heads 16 --vocab 32000 --seq 1024 --batch 1 \
  --dtype bf16 --layers $LAYERS --rounds 1 --steps 20 --json "$OUT/compile_time-cuda-w1-L${LAYERS// /-}.json" 2>&1 \
  | grep -v "^\[kernel" | tail -14
