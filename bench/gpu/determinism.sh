#!/usr/bin/env bash
# The same training run several times on one GPU: do the losses come out the same bits each time?
# Runs `troupe train` on a config (default: GPT-2 124M at pipeline_stage 4, 8 micro-batches, bf16,
# 10 steps, random-token shards) RUNS times with recording off and RUNS times with it on, replays
# every recorded run (`troupe replay`, which names the first tensor that differs from the log), and
# prints each run's last three losses and how many distinct loss sequences each half produced.
# Each recorded run is then compared with run 1 (`troupe replay --compare`): where they part, which
# worker and which message first.
#
#   bash bench/gpu/determinism.sh [RUNS] [--set key=value ...]     (default RUNS 8)
#   RECORD="false" bash bench/gpu/determinism.sh 8                  (only the half without recording)
#
# From the repository root, with the package of bench/gpu/pack.sh staged (common.sh). Results:
# $RESULTS/determinism.txt.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
RUNS=8
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then RUNS=$1; shift; fi
out=$RESULTS/determinism.txt
: > "$out"
python3 bench/train_bench.py data "$WORK/data" --tokens 3000000 --vocab 50257 >/dev/null
args=(bench/configs/gpt2_124m_1gpu.toml --set parallel.pipeline_stage=4 --set parallel.micro_batch_num=8
      --set train.steps=10 --set train.eval_interval=0 --set checkpoint.interval=0
      --set data.train="$WORK/data/train.bin" --set data.val="$WORK/data/val.bin" "$@")
losses() {  # the last three losses of a run's metrics.jsonl
  python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(" ".join(repr(r["loss"]) for r in [r for r in rows if "loss" in r][-3:]))' "$1/metrics.jsonl" 2>/dev/null ||
    echo "no losses"
}
for record in ${RECORD:-false true}; do
  seen=()
  for i in $(seq 1 "$RUNS"); do
    dir=$WORK/record-$record-$i
    timeout 300 "$BIN/troupe" train "${args[@]}" --set runtime.record=$record \
      --set runtime.run_dir="$dir" > "$dir.log" 2>&1 || echo "run $i failed: $dir.log"
    l=$(losses "$dir")
    seen+=("$l")
    line="record=$record run $i: $l"
    if [[ $record == true ]]; then
      line+=" | replay: $(timeout 300 "$BIN/troupe" replay "$dir" 2>&1 | tail -n 1)"
    fi
    echo "$line" | tee -a "$out"
  done
  echo "record=$record: $(printf '%s\n' "${seen[@]}" | sort -u | wc -l) distinct loss sequences in $RUNS runs" |
    tee -a "$out"
done

# Recorded runs against run 1 (`troupe replay --compare`): the earliest step whose messages differ
# and each worker's first differing message of it.
[[ -d $WORK/record-true-1 ]] || exit 0
for i in $(seq 2 "$RUNS"); do
  echo "recorded run $i against run 1:" | tee -a "$out"
  "$BIN/troupe" replay "$WORK/record-true-1" --compare "$WORK/record-true-$i" 2>&1 | sed 's/^/  /' |
    tee -a "$out"
done
