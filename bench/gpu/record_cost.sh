#!/usr/bin/env bash
# Recording's cost on the GPU, through `troupe train` as users run it: the LLaMA-3-style 1B
# (bench/configs/llama3_1b_1gpu.toml) or GPT-2 124M (bench/configs/gpt2_124m_1gpu.toml) with
# runtime.record off and on (the default), alternating for ROUNDS rounds, each run measured by
# bench/train_bench.py from its own metrics.jsonl (median step after the first three); then
# bench/torch_gpt2.py --compile at the same shape in the same call. With several executables
# (--troupe A --troupe B) the rounds alternate between them too, so one call compares builds.
#
#   bash bench/gpu/record_cost.sh [--model llama|gpt2] [--rounds 2] [--steps 12]
#                                 [--troupe PATH]... [--no-torch]
#
# From the repository root, with the package of bench/gpu/pack.sh staged (common.sh); --troupe
# defaults to the package's. Results: $RESULTS/record_cost.jsonl (one JSON line per run) and, on
# stdout, each run and per executable the medians off and on with recording's cost. docs/
# PERFORMANCE.md ("A LLaMA-3-style 1B") records a run.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
model=llama rounds=2 steps=12 torch=1 troupes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --troupe) troupes+=("$2"); shift 2 ;;
    --no-torch) torch=0; shift ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "record_cost.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#troupes[@]} -gt 0 ] || troupes=("$BIN/troupe")
for t in "${troupes[@]}"; do
  [ -x "$t" ] || { echo "record_cost.sh: no troupe executable at $t (--troupe PATH)" >&2; exit 2; }
done
case "$model" in
  llama)
    config=bench/configs/llama3_1b_1gpu.toml vocab=128256
    shape=(--arch llama --layers 16 --embd 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256
           --seq 2048 --batch 4) ;;
  gpt2)
    config=bench/configs/gpt2_124m_1gpu.toml vocab=50257 shape=() ;;
  *) echo "record_cost.sh: --model is llama or gpt2, not $model" >&2; exit 2 ;;
esac
out=$RESULTS/record_cost.jsonl
: > "$out"
python3 bench/train_bench.py data "$WORK/data" --tokens 3000000 --vocab $vocab >/dev/null
for r in $(seq 1 "$rounds"); do
  for i in "${!troupes[@]}"; do
    for rec in false true; do
      timeout 300 python3 bench/train_bench.py run --troupe "${troupes[$i]}" $config --steps "$steps" \
        --out "$out" --mode train --label "troupe $i record $rec round $r" \
        --set data.train="$WORK/data/train.bin" --set data.val="$WORK/data/val.bin" \
        --set runtime.record=$rec 2>&1 | tail -n 1
    done
  done
done
if [ $torch = 1 ]; then
  timeout 300 python3 bench/torch_gpt2.py --compile --clip 1.0 --tag torch.compile "${shape[@]}" 2>&1 |
    tail -n 1 | tee -a "$out"
fi
echo "executables:"
for i in "${!troupes[@]}"; do echo "  troupe $i: ${troupes[$i]}"; done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
torch = [r for r in rows if r.get("tag") == "torch.compile"]
by = {}
for r in rows:
    if "label" not in r:
        continue
    exe, _, rec = r["label"].split()[1:4]
    by.setdefault(exe, {}).setdefault(rec, []).append(r["step_ms"])
for exe, d in sorted(by.items()):
    off, on = d.get("false", []), d.get("true", [])
    if not off or not on:
        continue
    moff, mon = statistics.median(off), statistics.median(on)
    line = (f"troupe {exe}: record off {', '.join(map(str, off))} ms, on {', '.join(map(str, on))} ms;"
            f" medians {moff:.2f} / {mon:.2f} ms: recording costs {mon - moff:.2f} ms"
            f" ({(mon - moff) / moff * 100:.1f} %)")
    if torch:
        line += f"; recording on at {torch[-1]['step_ms'] / mon:.3f}x torch.compile ({torch[-1]['step_ms']} ms)"
    print(line)
PY
