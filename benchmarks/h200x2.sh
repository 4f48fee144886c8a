#!/usr/bin/env bash
# Issue 10 on two H200s (device kind nvidia-h200-x2), in one call of about 8 minutes:
#   1. step time, state/resident/transient memory and exposed communication of every variant, side by side:
#      Llama 4 x D=4096 (1x2048 tokens/rank) and MLP 6 x (8192 -> 32768 -> 8192) (256 tokens/rank), bf16,
#      fused AdamW;
#   2. per-variant kernel classes and buffers alive at the peak (benchmarks.world1_costs needs one rank:
#      run it at world 1 with --variants fsdp-compile-keep,... for the same buffers);
#   3. overlap of all-gather / reduce-scatter with compute and with each other, default vs delayed
#      baseline, at D=4096 and D=8192 (profiler traces, benchmarks.overlap).
# Usage (from the repo root, wheels of torchtitan==0.2.2 and megatron-fsdp in .whl/, see README):
#   bash benchmarks/h200x2.sh "$OUT"
set -euo pipefail
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# fsdp-compile-packed: every param bucketed and packed apart, as before 2026-12-01 (the memory baseline)
VARIANTS=fsdp-compile,fsdp-compile-packed,fsdp-compile-ag,fsdp-compile-delayed,fsdp2-eager-one-group,fsdp2-compile,simplefsdp,megatron-fsdp
RUN="torchrun --standalone --nproc-per-node=2 -m benchmarks.step_time --rounds 5 --steps 5 --warmup 3 --profile-steps 3 --no-png"
$RUN --preset gpu-llama-4096 --layers 4 --batch 1 --seq 2048 --variants $VARIANTS --json "$OUT/step_time-llama4096-w2.json" 2>&1 | grep -v step/s | tail -20
$RUN --model mlp --dim 8192 --layers 6 --tokens 256 --dtype bf16 --variants $VARIANTS --json "$OUT/step_time-mlp8192-w2.json" 2>&1 | grep -v step/s | tail -20
# overlap: default (eager reduce-scatter, dedicated communicator) and the delayed baseline, D=4096 and 8192
for D in 4096 8192; do
  $RUN --model mlp --dim $D --layers 6 --tokens 256 --dtype bf16 --variants fsdp-compile,fsdp-compile-delayed \
    --rounds 2 --steps 3 --json "$OUT/overlap-mlp$D-w2.json" 2>&1 | grep -v step/s | tail -8
done
