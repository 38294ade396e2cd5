#!/usr/bin/env bash
# Pipeline bubbles measured on the device beside the simulator's: `troupe train` of GPT-2 124M (bf16,
# pipeline_stage 4, 8 micro-batches of 16 × 1024, recording off, random-token shards) with 1f1b,
# zb_h1, interleaved_1f1b and zb_v (two chunks per rank, three layers per rank), each twice: the
# stages sharing the GPU's SMs (the default) and each stage on its own quarter of them
# (runtime.split_gpu = true: a GPU per stage, in small). For each run, the medians over steps 3 on
# of metrics.jsonl's `bubble` (the host's view), `device_bubble` (CUDA events: docs/runtime.md,
# "Busy and idle time on the device"), the device span and tokens/s, each stage's device bubble,
# and two predictions of `troupe schedule simulate` for the same schedule: with F = 1, B = 2 on
# every chunk, and with the chunks' F, B, I and W this run measured (`--costs-from`), with the ratio
# of the measured device bubble to the latter. First the same batch on one stage, for tokens/s.
#
#   bash bench/gpu/bubbles.sh [--set key=value ...]
#
# From the repository root, with the package of bench/gpu/pack.sh staged (common.sh). Results:
# $RESULTS/bubbles.txt, and each run's trace.json as $RESULTS/trace-SCHEDULE[-split].json.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
out=$RESULTS/bubbles.txt
: > "$out"
python3 bench/train_bench.py data "$WORK/data" --tokens 3000000 --vocab 50257 >/dev/null
base=(bench/configs/gpt2_124m_1gpu.toml --set parallel.pipeline_stage=4 --set parallel.micro_batch_num=8
      --set train.steps=8 --set train.eval_interval=0 --set checkpoint.interval=0 --set runtime.record=false
      --set data.train="$WORK/data/train.bin" --set data.val="$WORK/data/val.bin")
simulated() {  # schedule args... -> the simulator's bubble, 3 decimals
  "$BIN/troupe" schedule simulate "$@" --json |
    python3 -c 'import json, sys; print(round(json.load(sys.stdin)["bubble"], 3))'
}
# The same global batch on one stage, for the pipelines' tokens/s.
one=$WORK/bubbles-one-stage
if timeout 300 "$BIN/troupe" train "${base[@]}" --set parallel.pipeline_stage=1 "$@" \
     --set runtime.run_dir="$one" > "$one.log" 2>&1; then
  python3 - "$one/metrics.jsonl" <<'PY' | tee -a "$out"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][2:]
print(f"one stage, same batch: {statistics.median(r['tokens_per_s'] for r in rows):,.0f} tokens/s")
PY
else
  echo "one stage: troupe train failed ($one.log)" | tee -a "$out"
fi
# run NAME SCHEDULE SPLIT [--set key=value ...]: one run and its lines in bubbles.txt.
run() {
  local name=$1 s=$2 split=$3
  shift 3
  local sim=(-s "$s" -p 4 -m 8)
  [[ $s == interleaved_1f1b || $s == zb_v ]] && sim+=(-v 2)
  local dir=$WORK/bubbles-$name
  if ! timeout 300 "$BIN/troupe" train "${base[@]}" --set schedule.name=$s "$@" \
         --set runtime.split_gpu=$split --set runtime.run_dir="$dir" > "$dir.log" 2>&1; then
    echo "$name: troupe train failed ($dir.log):" | tee -a "$out"
    tail -n 5 "$dir.log" | tee -a "$out"
    return
  fi
  local uniform measured
  uniform=$(simulated "${sim[@]}")
  measured=$(simulated "${sim[@]}" --costs-from "$dir/metrics.jsonl")
  python3 - "$dir/metrics.jsonl" "$name" "$uniform" "$measured" <<'PY' | tee -a "$out"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "device_bubble" in r][2:]
med = lambda k: statistics.median(r[k] for r in rows)
dev, measured = med('device_bubble'), float(sys.argv[4])
print(f"{sys.argv[2]}: host bubble {med('bubble'):.3f}, device bubble {dev:.3f}, "
      f"simulated {sys.argv[3]} (F = 1, B = 2) / {measured:.3f} (measured costs), "
      f"device / simulated {dev / measured:.2f}, device span {med('device_span_s') * 1e3:.1f} ms, "
      f"{med('tokens_per_s'):,.0f} tokens/s")
stages = [statistics.median(r["stages"][i]["device_bubble"] for r in rows) for i in range(len(rows[0]["stages"]))]
print("  each stage's device bubble:", ", ".join(f"{b:.3f}" for b in stages))
costs = rows[-1]["device_costs"]
print("  last step's ms per chunk:", "; ".join(
    f"{k.upper()} " + " ".join("-" if v is None else f"{v:.2f}" for v in costs[k]) for k in costs))
PY
  cp "$dir/trace.json" "$RESULTS/trace-$name.json" 2>/dev/null
}
for s in 1f1b zb_h1 interleaved_1f1b zb_v; do
  extra=()
  [[ $s == interleaved_1f1b ]] &&
    extra=(--set parallel.virtual_pipeline=2 --set "parallel.stage_layers=[2,2,1,1,1,1,2,2]")
  [[ $s == zb_v ]] &&
    extra=(--set parallel.virtual_pipeline=2 --set "parallel.stage_layers=[2,1,2,1,2,1,2,1]")
  run "$s" "$s" false "${extra[@]}" "$@"
  run "$s-split" "$s" true "${extra[@]}" "$@"
done
# The split 1f1b's costs put the head's stage at 2.8 times another's: two layers fewer there and
# one more on each of the first two stages even them out.
run 1f1b-split-4431 1f1b true --set "parallel.stage_layers=[4,4,3,1]" "$@"
