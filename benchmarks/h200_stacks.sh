#!/usr/bin/env bash
# Issue 11 on one H200 (device kind nvidia-h200, torch 2.11, world size 1 with the collectives kept):
# the blocks as one BlockStack (traced once, unrolled into calls of one body: NOTE [stacked blocks],
# NOTE [unrolled stacks]) beside the outlined default and SimpleFSDP; Llama blocks of D=1024, 1x1024
# tokens, bf16.
#   compile  cold compile by stage at 4 and 32 blocks, outlined and stacked, 20 timed fwd+bwd steps each;
#   simple   SimpleFSDP's cold compile at 4 blocks (the depth where it is fastest);
#   warm     second process start against the first (every cache on), stacked, 4 and 32 blocks;
#   step     full training step (AdamW), outlined against stacked, 16 blocks, alternated rounds;
#   bound    the same at a GPU-bound shape: 4 x D=4096, 2x2048 tokens;
#   peers    training step beside SimpleFSDP and FSDP2 + compile (collectives elided at world 1), 16 blocks;
#   cudatest tests/test_cuda.py (stacked and outlined, NCCL at world 1);
#   ab       cold compile at 4 and 32 blocks, stacked and outlined, in the tree at $BASE (an earlier
#            commit: git archive REV | tar -x -C .base, carried) and in this one, alternated, ROUNDS rounds
#            (AB_VARIANTS: which variants; default stacked and outlined).
# Usage: bash benchmarks/h200_stacks.sh OUT part [part ...]   (default: compile simple warm)
set -uo pipefail
OUT=${1:-out}
shift || true
PARTS=${*:-compile simple warm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
source benchmarks/carried_wheels.sh
SHAPE=(--device cuda --dim 1024 --heads 16 --vocab 32000 --seq 1024 --batch 1 --dtype bf16)
quiet() { grep -v "^\[kernel\|Warning\|warn"; }
for PART in $PARTS; do
  case $PART in
  compile)
    timeout 500 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 32 --rounds ${ROUNDS:-1} --steps 20 \
      --variants fsdp-compile fsdp-compile-stacked \
      --json "$OUT/compile_time-cold-cuda-w1-L4-32-stacks.json" 2>&1 | quiet | tail -8 ;;
  simple)
    timeout 120 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 --rounds 1 --steps 20 \
      --variants simplefsdp --json "$OUT/compile_time-cold-cuda-w1-L4-simplefsdp.json" 2>&1 | quiet | tail -5 ;;
  warm)
    timeout 200 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 32 --warm-start \
      --variants fsdp-compile-stacked --json "$OUT/compile_time-warm-cuda-w1-stacks.json" 2>&1 | quiet | tail -8 ;;
  step)
    timeout 300 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 16 --spawn 1 --rounds 3 --no-png \
      --profile-steps 0 --variants fsdp-compile-keep,fsdp-compile-keep-stacked \
      --json "$OUT/step_time-gpu-llama-1024-L16-stacks-w1.json" 2>&1 | quiet | tail -8 ;;
  bound)
    timeout 280 python3 -m benchmarks.step_time --preset gpu-llama-4096 --spawn 1 --rounds 3 --no-png \
      --profile-steps 0 --variants fsdp-compile-keep,fsdp-compile-keep-stacked \
      --json "$OUT/step_time-gpu-llama-4096-stacks-w1.json" 2>&1 | quiet | tail -8 ;;
  peers)
    timeout 330 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 16 --spawn 1 --rounds 3 --no-png \
      --profile-steps 0 --variants fsdp-compile,fsdp-compile-stacked,simplefsdp,fsdp2-compile \
      --json "$OUT/step_time-gpu-llama-1024-L16-stacks-peers-w1.json" 2>&1 | quiet | tail -10 ;;
  ab)
    for r in $(seq "${ROUNDS:-2}"); do
      for tree in "${BASE:-.base}" .; do
        tag=$([ "$tree" = . ] && echo new || echo base)
        (cd "$tree" && timeout 280 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 32 --rounds 1 \
          --variants ${AB_VARIANTS:-fsdp-compile-stacked fsdp-compile} --json "$OUT/compile_time-cold-cuda-w1-ab-$tag-$r.json" 2>&1 \
          | quiet | grep "^| [0-9]" | sed "s/^/$tag $r /")
      done
    done ;;
  cudatest)
    timeout 400 python3 -m pytest -q -x tests/test_cuda.py 2>&1 | tail -15 ;;
  *) echo "unknown part $PART" ;;
  esac
done
