#!/usr/bin/env bash
# Issue 11 on one H200 (device kind nvidia-h200, torch 2.11, world size 1 with the collectives kept):
# the blocks as one BlockStack (traced once, unrolled into calls of one body: NOTE [stacked blocks],
# NOTE [unrolled stacks]) beside the outlined default and SimpleFSDP; Llama blocks of D=1024, 1x1024
# tokens, bf16.
#   compile  cold compile by stage at 4 and 32 blocks, outlined (its later blocks stamped out of the first
#            one's trace: NOTE [stamped blocks]) and stacked, 20 timed fwd+bwd steps each;
#   simple   SimpleFSDP's cold compile at 4 blocks (the depth where it is fastest);
#   simple2  the same beside the stack and the outlined form, alternated, ROUNDS rounds, on a fake group of
#            2 ranks: every variant compiles world 2's collectives (at world 1 SimpleFSDP issues none);
#   warm     second process start against the first (every cache on), stacked, 4 and 32 blocks (WARM_VARIANTS,
#            WARM_LAYERS, WARM_TAG: other variants, depths, and the JSON's name);
#   step     full training step (AdamW), outlined against stacked, 16 blocks, alternated rounds;
#   bound    the same at a GPU-bound shape: 4 x D=4096, 2x2048 tokens;
#   peers    training step beside SimpleFSDP and FSDP2 + compile (collectives elided at world 1), 16 blocks;
#   cudatest tests/test_cuda.py (stacked and outlined, NCCL at world 1);
#   ab       cold compile at 4 and 32 blocks, stacked and outlined, in the tree at $BASE (an earlier
#            commit: git archive REV | tar -x -C .base, carried) and in this one, alternated, ROUNDS rounds
#            (AB_VARIANTS: which variants; default stacked and outlined);
#   warmab   warm start, stacked, of the tree at $BASE against this one: second process starts over one
#            cache directory, alternated, ROUNDS rounds at 32 blocks (benchmarks/warm_ab.py);
#   cold     cold compile of the outlined default alone at 4 and 32 blocks, ROUNDS rounds (depths alternated);
#   table    the issue's table: cold compile at 4, 16 and 32 blocks of plain torch.compile, the outlined
#            default, FSDP2 + compile and SimpleFSDP, one round, variants rotated per depth;
#   step32   training step with the collectives kept, outlined against the whole-model graph, 32 blocks;
#   commsetup  what the first collective on each of our two NCCL groups costs at world 1 (the
#            communicators' set-up, inside every variant's first step that issues collectives).
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
  simple2)
    timeout 560 python3 -m benchmarks.compile_time "${SHAPE[@]}" --world 2 --layers 4 --rounds ${ROUNDS:-3} \
      --variants fsdp-compile-stacked simplefsdp fsdp-compile --json "$OUT/compile_time-cold-cuda-w2fake-L4-simplefsdp.json" \
      2>&1 | quiet | tail -6 ;;
  cold)
    timeout 560 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 32 --rounds ${ROUNDS:-5} \
      --variants fsdp-compile --json "$OUT/compile_time-cold-cuda-w1-L4-32${TAG:-}.json" 2>&1 | quiet | tail -5 ;;
  table)
    timeout 560 python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers 4 16 32 --rounds 1 --steps 10 \
      --variants compile fsdp-compile fsdp2-compile simplefsdp \
      --json "$OUT/compile_time-cold-cuda-w1-L4-16-32-table${TAG:-}.json" 2>&1 | quiet | tail -16 ;;
  step32)
    timeout 400 python3 -m benchmarks.step_time --preset gpu-llama-1024 --layers 32 --spawn 1 --rounds 2 --no-png \
      --profile-steps 0 --variants fsdp-compile-keep,fsdp-compile-keep-whole \
      --json "$OUT/step_time-gpu-llama-1024-L32-whole-w1${TAG:-}.json" 2>&1 | quiet | tail -8 ;;
  warm)
    timeout ${WARM_TIMEOUT:-200} python3 -m benchmarks.compile_time "${SHAPE[@]}" --layers ${WARM_LAYERS:-4 32} --warm-start \
      --rounds ${WARM_ROUNDS:-1} \
      --variants ${WARM_VARIANTS:-fsdp-compile-stacked} --json "$OUT/compile_time-warm-cuda-w1-${WARM_TAG:-stacks}.json" \
      2>&1 | quiet | tail -8 ;;
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
  warmab)
    timeout 400 python3 -m benchmarks.warm_ab --trees "${BASE:-.base}" . --layers 32 --rounds ${ROUNDS:-4} \
      --device cuda --json "$OUT/compile_time-warm-ab-cuda-w1-L32.json" "${SHAPE[@]:2}" 2>&1 | quiet | tail -6 ;;
  commsetup)
    timeout 120 python3 - <<'EOF'
import time, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)
from fsdp_compile import FsdpGroups
groups, x = FsdpGroups.create(), torch.ones(4, device="cuda")
for name, group in (("all_gather group", groups.all_gather), ("reduce_scatter group", groups.reduce_scatter)):
    for when in ("first", "second"):
        t = time.perf_counter(); dist.all_reduce(x, group=group); torch.cuda.synchronize()
        print(f"{name}: {when} collective {time.perf_counter() - t:.3f} s")
EOF
    ;;
  cudatest)
    timeout 400 python3 -m pytest -q -x tests/test_cuda.py 2>&1 | tail -15 ;;
  *) echo "unknown part $PART" ;;
  esac
done
