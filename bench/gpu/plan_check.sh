#!/usr/bin/env bash
# Planned (`troupe plan --json`) against measured (`troupe train`'s metrics.jsonl) on one GPU: the
# peak device bytes of every stage's allocator and of its optimizer shard's, and the step time,
# for GPT-2 124M, GPT-2 1.5B and a LLaMA-style 1.1B over pipeline stages, recompute modes, ZeRO
# stages and optimizer offload (every worker in one process on GPU 0, bf16). Prints one table row
# per run and writes $O/plan_check.jsonl; the ratios are planned / measured.
#
#   bash bench/gpu/pack.sh build-cuda        # where troupe was built with CUDA: stage build-gpu/
#   bash bench/gpu/plan_check.sh [124m|1.5b|llama|all|tp|oom] [--calibrate]   # on the GPU machine
#
# ONLY=REGEX runs only the runs whose "model-tag" matches (e.g. ONLY='pp1-none|dp2-zero1').
# --calibrate first measures the GPU on each model's config (`troupe plan CONFIG --calibrate`) and
# plans that model with those rates. `tp` runs GPT-2 124M and the LLaMA shape at model_parallel 2
# (sequence parallel off and on, pipeline_stage 1 and 2) in fp32, the precision tensor parallel
# sums in (calibrated in fp32 with --calibrate). Each run's folder is removed once its metrics are read.
# `oom` instead checks the two refusals: `troupe train` of GPT-2 1.5B at micro-batch size 64
# refused by the plan check before allocation (exit 3), and the same with --no-plan-check running
# out of device memory and stopping with rank, stage, step, instruction and the plan (exit 1).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
B=$BIN
O=$RESULTS
which=${1:-124m}
cal_flag=""
mkdir -p $O/runs $O/cfg
# Token shard in llm.c's format: 256 int32 header (magic, version, count), then uint16 tokens.
python3 - "$O/tokens.bin" <<'PY'
import random, struct, sys
n = 4_000_000
random.seed(1)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack("<%dH" % n, *(random.randrange(32000) for _ in range(n))))
PY

write_cfg() {  # name arch layers hidden heads kv ffn seq vocab mbs
  cat > $O/cfg/$1.toml <<TOML
[model]
arch = "$2"
num_layers = $3
hidden_size = $4
num_heads = $5
num_kv_heads = $6
ffn_hidden_size = $7
seq_length = $8
vocab_size = $9
[parallel]
micro_batch_size = ${10}
micro_batch_num = 8
[precision]
compute = "bf16"
[train]
steps = 4
eval_interval = 0
[data]
train = "$O/tokens.bin"
[runtime]
device = "cuda"
record = false
run_dir = "$O/runs/latest"
cuda_graph = false
TOML
}
write_cfg 124m gpt2 12 768 12 0 0 1024 50257 4
write_cfg 1.5b gpt2 48 1600 25 0 0 1024 50257 2
write_cfg llama llama 16 2048 16 8 5632 2048 32000 2

calibrate=0; [ "${2:-}" = "--calibrate" ] && calibrate=1

run() {  # model tag --set ...
  local model=$1 tag=$2; shift 2
  [[ -n "${ONLY:-}" && ! "$model-$tag" =~ $ONLY ]] && return 0
  local sets=("$@") args=()
  for s in "${sets[@]}"; do args+=(--set "$s"); done
  local dir=$O/runs/$model-$tag
  $B/troupe plan $O/cfg/$model.toml "${args[@]}" --set runtime.run_dir=\"$dir\" --json $cal_flag > $dir.plan.json 2> $dir.plan.err
  timeout 500 $B/troupe train $O/cfg/$model.toml "${args[@]}" --set runtime.run_dir=\"$dir\" --no-plan-check \
    > $dir.train.log 2>&1 || { echo "$model $tag: train failed"; tail -5 $dir.train.log; }
  python3 - "$model" "$tag" "$dir" <<'PY' | tee -a $O/plan_check.jsonl
import json, sys, statistics
model, tag, d = sys.argv[1:]
try:
    plan = json.load(open(d + ".plan.json"))
    lines = [json.loads(l) for l in open(d + "/metrics.jsonl") if l.strip()]
except Exception as e:
    print(json.dumps({"model": model, "run": tag, "error": str(e)})); sys.exit()
last = lines[-1]
meas = {(s["dp"], s["pp"], s.get("tp", 0)): (s.get("peak_device_bytes", 0), s.get("optimizer_peak_device_bytes", 0)) for s in last["stages"]}
rows = []
for r in plan["ranks"]:
    ms, mo = meas[(r["dp"], r["pp"], r.get("tp", 0))]
    rows.append({"dp": r["dp"], "tp": r.get("tp", 0), "pp": r["pp"], "stage_planned": r["stage_peak_bytes"], "stage_measured": ms,
                 "shard_planned": r["optimizer_peak_bytes"], "shard_measured": mo,
                 "stage_ratio": r["stage_peak_bytes"] / ms if ms else None,
                 "shard_ratio": r["optimizer_peak_bytes"] / mo if mo else None})
tps = [l["tokens_per_s"] for l in lines[1:]] or [lines[-1]["tokens_per_s"]]
step_meas = plan["tokens_per_step"] / statistics.median(tps)
# The device's own view (CUDA events): the span of the step's compute and the stages' summed busy
# time; a sum above the span is stages' kernels running at the same time on the one GPU.
med = lambda xs: statistics.median(xs) if xs else None
timed = [l for l in lines[1:] if "device_span_s" in l]
dev = {"device_span_s": med([l["device_span_s"] for l in timed]),
       "device_busy_sum_s": med([sum(s.get("device_busy_s", 0) for s in l["stages"])
                                 for l in timed])}
print(json.dumps({"model": model, "run": tag, "ranks": rows, "step_planned_s": plan["step_s"],
                  "step_measured_s": step_meas, "step_ratio": plan["step_s"] / step_meas,
                  "pipeline_planned_s": plan["pipeline_s"],
                  "optimizer_planned_s": plan["optimizer_s"],
                  **dev}))
PY
  rm -rf "$dir"  # the measurements are read; its checkpoints would fill the disk
}

if [ "$which" = oom ]; then
  big="--set parallel.micro_batch_size=64 --set runtime.run_dir=\"$O/runs/oom\""
  $B/troupe train $O/cfg/1.5b.toml $big > $O/oom_refused.log 2>&1; echo "plan check: exit $? (want 3)"
  head -20 $O/oom_refused.log
  timeout 500 $B/troupe train $O/cfg/1.5b.toml $big --no-plan-check > $O/oom_run.log 2>&1; echo "no plan check: exit $? (want 1)"
  grep -m3 -E "out of device memory|error" $O/oom_run.log; grep -A12 "the plan of this layout" $O/oom_run.log
  exit 0
fi
if [ "$which" = tp ]; then
  for m in 124m llama; do
    fp32=precision.compute=\"fp32\"
    cal_flag=""
    if [ $calibrate = 1 ]; then
      $B/troupe plan $O/cfg/$m.toml --set $fp32 --calibrate $O/calibration-$m-fp32.json &&
        cal_flag="--calibration $O/calibration-$m-fp32.json"
    fi
    for pp in 1 2; do
      for sp in false true; do
        run $m tp2-pp$pp-sp$sp $fp32 parallel.model_parallel=2 parallel.sequence_parallel=$sp parallel.pipeline_stage=$pp
      done
    done
  done
  which=none
fi
models=$which; [ "$which" = all ] && models="124m llama 1.5b"; [ "$which" = none ] && models=""
for m in $models; do
  cal_flag=""
  if [ $calibrate = 1 ]; then  # the device's rates measured on this model's own shapes
    $B/troupe plan $O/cfg/$m.toml --calibrate $O/calibration-$m.json && cal_flag="--calibration $O/calibration-$m.json"
  fi
  for pp in 1 2 4; do
    for rc in none selective full; do
      run $m pp$pp-$rc parallel.pipeline_stage=$pp recompute.mode=$rc
    done
  done
  for z in 0 1 2; do
    run $m dp2-zero$z parallel.data_parallel=2 parallel.pipeline_stage=2 optimizer.zero_stage=$z parallel.micro_batch_num=4
  done
  for pp in 1 2; do
    run $m pp$pp-offload parallel.pipeline_stage=$pp optimizer.offload=true
  done
done
python3 - $O/plan_check.jsonl <<'PY'
import json, sys
print("%-6s %-18s %8s %12s %12s %6s %10s %10s %6s %9s %9s %6s" % ("model", "run", "dp/tp/pp", "stage plan", "stage real", "ratio",
      "shard plan", "shard real", "ratio", "step plan", "step real", "ratio"))
for l in open(sys.argv[1]):
    j = json.loads(l)
    if "error" in j: print(j["model"], j["run"], "error:", j["error"]); continue
    for r in j["ranks"]:
        g = lambda b: "%.2fG" % (b / 2**30)
        print("%-6s %-18s %2d/%d/%-2d %12s %12s %6.3f %10s %10s %6.3f %9.4f %9.4f %6.3f" % (j["model"], j["run"], r["dp"], r.get("tp", 0), r["pp"],
              g(r["stage_planned"]), g(r["stage_measured"]), r["stage_ratio"] or 0, g(r["shard_planned"]), g(r["shard_measured"]),
              r["shard_ratio"] or 0, j["step_planned_s"], j["step_measured_s"], j["step_ratio"]))
PY
