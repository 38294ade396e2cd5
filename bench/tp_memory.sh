#!/usr/bin/env bash
# Memory per rank under tensor (and sequence) parallel, measured by `troupe train` on the CPU:
# configs/tiny.toml widened to hidden 256, 8 heads, 256 tokens (activations well above noise),
# micro_batch_size 2 × micro_batch_num 2, data_parallel 1, 2 steps, no evaluation; at
# model_parallel 1, 2, 4 (sequence parallel off and on) and pipeline_stage 1 and 2. For each
# pipeline stage it prints, from the last line of each run's metrics.jsonl, the largest over the
# stage's tensor-parallel ranks of `param_bytes` (the fp32 parameter buffer), `peak_activation_bytes`
# (saved activations), `peak_device_bytes` (every live tensor of the stage's backend) and
# `optimizer_peak_device_bytes` (its optimizer shard's: master slices and AdamW moments), each
# with its ratio to model_parallel 1 at the same pipeline stage. docs/model.md records a run.
#
#   bash bench/tp_memory.sh [--troupe build/troupe] [--out DIR]
#
# Needs python3 and the token shards data/tokens/train.bin (`troupe data prepare`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

troupe=build/troupe out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --troupe) troupe=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "tp_memory.sh: unknown argument $1 (see the header of bench/tp_memory.sh)" >&2; exit 2 ;;
  esac
done
[ -x "$troupe" ] || { echo "tp_memory.sh: no troupe executable at $troupe (--troupe PATH)" >&2; exit 2; }
[ -n "$out" ] || out="$(mktemp -d)"
mkdir -p "$out"

runs=()
for pp in 1 2; do
  for layout in "1 false" "2 false" "2 true" "4 false" "4 true"; do
    set -- $layout
    tp=$1 sp=$2 dir="$out/tp${1}_sp${2}_pp${pp}"
    "$troupe" train configs/tiny.toml \
      --set model.hidden_size=256 --set model.num_heads=8 --set model.seq_length=256 \
      --set parallel.data_parallel=1 --set parallel.pipeline_stage="$pp" \
      --set parallel.micro_batch_size=2 --set parallel.micro_batch_num=2 \
      --set parallel.model_parallel="$tp" --set parallel.sequence_parallel="$sp" \
      --set train.steps=2 --set train.warmup_steps=0 --set train.eval_interval=0 --set data.val= \
      --set runtime.run_dir="$dir" >"$dir.log" 2>&1 ||
      { echo "tp_memory.sh: troupe train failed at tp $tp sp $sp pp $pp (log: $dir.log)" >&2; exit 1; }
    runs+=("$tp $sp $pp $dir")
  done
done

python3 - "${runs[@]}" <<'EOF'
import json, sys
rows = []
for arg in sys.argv[1:]:
    tp, sp, pp, d = arg.split(" ", 3)
    last = open(d + "/metrics.jsonl").read().strip().splitlines()[-1]
    for st in json.loads(last)["stages"]:
        rows.append(dict(tp=int(tp), sp=sp == "true", pp=int(pp), stage=st["pp"],
                         params=st.get("param_bytes", 0), acts=st["peak_activation_bytes"],
                         dev=st.get("peak_device_bytes", 0),
                         opt=st.get("optimizer_peak_device_bytes", 0)))
def worst(pp, stage, tp, sp, key):
    return max(r[key] for r in rows if (r["pp"], r["stage"], r["tp"], r["sp"]) == (pp, stage, tp, sp))
mib = lambda b: b / 2**20
print("| pipeline_stage | stage | model_parallel | sequence_parallel | param_bytes (MiB) | ratio | "
      "peak_activation_bytes (MiB) | ratio | peak_device_bytes (MiB) | ratio | "
      "optimizer_peak_device_bytes (MiB) | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for pp, stage, tp, sp in sorted({(r["pp"], r["stage"], r["tp"], r["sp"]) for r in rows}):
    cells = []
    for key in ("params", "acts", "dev", "opt"):
        v, one = worst(pp, stage, tp, sp, key), worst(pp, stage, 1, False, key)
        cells += [f"{mib(v):.2f}", f"{v / one:.3f}" if one else "-"]
    print(f"| {pp} | {stage} | {tp} | {'on' if sp else 'off'} | " + " | ".join(cells) + " |")
EOF
