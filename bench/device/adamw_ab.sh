#!/bin/bash
# A/B of the AdamW kernel inside the GPT-2 124M step: gpu_prev_gpt2_bench (one 4-element group per
# thread and iteration), gpu_u2a_gpt2_bench (two groups, registers unbounded), gpu_u2b_gpt2_bench
# (two groups, at least 4 blocks of 256 per SM), interleaved, each with its per-op profile; and the
# adamw_runs tests of the build (the u2a variant).
source "$(dirname "$0")/unpack.sh"
cd /tmp
timeout 100 $B/test_kernels -tc='cuda*adamw*' 2>&1 | tail -2
for round in 1 2; do
  for v in prev u2a u2b; do
    timeout 90 $B/gpu_${v}_gpt2_bench --tag $v-$round --steps 20 --profile > $O/$v-$round.log 2>&1
    echo "$v-$round $(grep -o '"step_ms": [0-9.]*' $O/$v-$round.log) $(grep -i 'adamw' $O/$v-$round.log | head -1)"
  done
done
true
