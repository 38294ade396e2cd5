#!/usr/bin/env bash
# optimizer.offload on one GPU, through `troupe train` (actors) with the shipped defaults:
#  1. GPT-2 1.5B (48 layers of 1600, bf16, 4 micro-batches of 4 x 1024 tokens) with offload off and
#     on: peak device memory (every stage's and optimizer shard's allocator, from the run's
#     metrics.jsonl through bench/train_bench.py) and tokens/s (median of the steps after the
#     first 3), the final losses of both runs side by side (the same bits: offload does not change
#     the arithmetic).
#  2. A GPT-2-style model of 6.65 billion parameters (32 layers of 4096, bf16, full recompute, one
#     sequence of 1024 per step) whose weights, gradients, bf16 copy, master weights and moments
#     (22 bytes a parameter, 146 GB) exceed one H200's 141 GB: `troupe plan` of it without and
#     with offload (the device-memory drop and the host memory), `troupe train` without offload
#     refused by the plan check before allocation (exit 3) and, with --no-plan-check, running out
#     of device memory (exit 1); with offload it trains (about 71 GiB planned on the device, 77 GiB
#     of page-locked host memory; stopped after 3 steps, see below).
#
#   bash bench/gpu/pack.sh build-cuda     # where troupe was built with CUDA: stages build-gpu/
#   bash bench/gpu/offload.sh [PKG]       # on the GPU machine, from the repository root
#
# PKG (default build-gpu; RESULTS and WORK as in bench/gpu/common.sh). Results: the JSON lines in
# $RESULTS/offload.jsonl, the table in $RESULTS/offload.md, logs beside them; also on stdout.
if [[ $# -ge 1 ]]; then PKG=$1; fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
describe_machine | tee $RESULTS/offload_machine.txt
python3 bench/train_bench.py data $WORK/data --tokens 4000000 --vocab 50257 >/dev/null
rm -f $RESULTS/offload.jsonl
failed=0

# 1. GPT-2 1.5B, offload off and on.
GPT2_XL="--set model.num_layers=48 --set model.hidden_size=1600 --set model.num_heads=25
         --set parallel.micro_batch_size=4 --set parallel.micro_batch_num=4
         --set data.train=$WORK/data/train.bin --set data.val=$WORK/data/val.bin"
for off in false true; do
  python3 bench/train_bench.py run --troupe $BIN/troupe bench/configs/gpt2_124m_1gpu.toml \
    --mode train --steps 10 --skip 3 --out $RESULTS/offload.jsonl $GPT2_XL \
    --set optimizer.offload=$off --label "GPT-2 1.5B, offload $off" --keep --run-dir $WORK/xl_$off \
    || failed=1
done
python3 bench/train_bench.py table $RESULTS/offload.jsonl --baseline "GPT-2 1.5B, offload false" \
  | tee $RESULTS/offload.md
echo "losses per step (offload false | true):" | tee -a $RESULTS/offload.md
paste <(grep -o '"loss":[^,]*' $WORK/xl_false/metrics.jsonl) \
      <(grep -o '"loss":[^,]*' $WORK/xl_true/metrics.jsonl) | tee -a $RESULTS/offload.md
if cmp -s <(grep -o '"loss":[^,]*' $WORK/xl_false/metrics.jsonl) \
          <(grep -o '"loss":[^,]*' $WORK/xl_true/metrics.jsonl); then
  echo "losses: identical" | tee -a $RESULTS/offload.md
else
  echo "losses: DIFFERENT" | tee -a $RESULTS/offload.md; failed=1
fi

# 2. 6.65B parameters: does not fit without offload, trains with it. The run is stopped after its
#    third step: its final checkpoint would need another 12 bytes a parameter (80 GB) of host
#    memory beside the 80 GB of page-locked optimizer state.
BIG="--set model.num_layers=32 --set model.hidden_size=4096 --set model.num_heads=32
     --set parallel.micro_batch_size=1 --set parallel.micro_batch_num=1 --set recompute.mode=full
     --set train.steps=50 --set train.warmup_steps=1 --set train.eval_interval=0
     --set data.train=$WORK/data/train.bin --set data.val=$WORK/data/val.bin"
CFG=bench/configs/gpt2_124m_1gpu.toml
echo "== troupe plan, 6.65B without offload" | tee -a $RESULTS/offload.md
$BIN/troupe plan $CFG $BIG 2>&1 | tee -a $RESULTS/offload.md
echo "== troupe plan, 6.65B with offload" | tee -a $RESULTS/offload.md
$BIN/troupe plan $CFG $BIG --set optimizer.offload=true 2>&1 | tee -a $RESULTS/offload.md
echo "== troupe train, 6.65B without offload: refused by the plan check before allocating (exit 3)" \
  | tee -a $RESULTS/offload.md
$BIN/troupe train $CFG $BIG --set runtime.run_dir=$WORK/big_off > $RESULTS/offload_big_off.log 2>&1
echo "exit $?" | tee -a $RESULTS/offload.md
grep -m3 -E "error|DOES NOT FIT|memory:" $RESULTS/offload_big_off.log | tee -a $RESULTS/offload.md
echo "== troupe train --no-plan-check, 6.65B without offload: out of device memory (exit 1)" \
  | tee -a $RESULTS/offload.md
timeout 900 $BIN/troupe train $CFG $BIG --no-plan-check --set runtime.run_dir=$WORK/big_off \
  > $RESULTS/offload_big_off_forced.log 2>&1
echo "exit $?" | tee -a $RESULTS/offload.md
grep -m3 -E "out of device memory|error" $RESULTS/offload_big_off_forced.log | tee -a $RESULTS/offload.md
echo "== troupe train, 6.65B with offload (stopped after 3 steps)" | tee -a $RESULTS/offload.md
rm -rf $WORK/big_on
$BIN/troupe train $CFG $BIG --set optimizer.offload=true --set runtime.run_dir=$WORK/big_on \
  > $RESULTS/offload_big_on.log 2>&1 &
pid=$!
for _ in $(seq 1 1800); do
  [[ -f $WORK/big_on/metrics.jsonl && $(wc -l < $WORK/big_on/metrics.jsonl) -ge 3 ]] && break
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null  # no final checkpoint
if [[ -f $WORK/big_on/metrics.jsonl && $(wc -l < $WORK/big_on/metrics.jsonl) -ge 3 ]]; then
  python3 - $WORK/big_on/metrics.jsonl <<'PY' | tee -a $RESULTS/offload.md
import json, sys
sys.path.insert(0, "bench")
from train_bench import peak_bytes
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for m in lines:
    print("step %d: loss %.4f, %.0f tokens/s, peak device memory %.2f GiB"
          % (m["step"], m["loss"], m["tokens_per_s"], peak_bytes(m) / 2**30))
PY
else
  echo "6.65B with offload: fewer than 3 steps (see $RESULTS/offload_big_on.log)" | tee -a $RESULTS/offload.md
  tail -5 $RESULTS/offload_big_on.log; failed=1
fi
if [[ $failed -eq 0 ]]; then echo "offload.sh: done"; else echo "offload.sh: FAILURES above"; fi
exit $failed
