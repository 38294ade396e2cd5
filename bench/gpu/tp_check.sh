#!/usr/bin/env bash
# Tensor parallel on one GPU at full size: a 1.5B GPT-2 and a LLaMA-3-style 1B, each trained by
#  - `troupe train` at model_parallel 1 (one process),
#  - `troupe launch` at model_parallel 2 (two worker processes on the one GPU over nccl), with
#    sequence parallel off and on,
#  - `troupe train` at model_parallel 2 (both ranks in one process, the local transport),
# in fp32 for 8 steps of 2 micro-batches of 1 sequence. Prints every run's losses side by side,
# the largest relative difference from model_parallel 1 (fails above 1e-4: the split GEMMs and the
# vocabulary-parallel loss sum in another order), and whether the one-process and two-process runs
# at model_parallel 2 agree bit for bit (they must: the group sums in rank order on the GPU,
# actors/tp_group.cpp). Also each run's tokens/s and peak device bytes per rank from its
# metrics.jsonl. Throughput over several GPUs is for a machine that has them.
#
# The 1.5B GPT-2 has GPT-2 XL's 48 layers of 1600 with 32 heads of 50 (GPT-2 XL's 25 heads do not
# split over 2 ranks). The LLaMA is bench/configs/llama3_1b_1gpu.toml (16 layers of 2048, 32 / 8
# heads, vocabulary 128,256, T 2048) in fp32.
#
#   bash bench/gpu/pack.sh build-cuda     # where troupe was built with CUDA: stages build-gpu/
#   bash bench/gpu/tp_check.sh [PKG]      # on the GPU machine, from the repository root
#
# PKG (default build-gpu; RESULTS and WORK as in bench/gpu/common.sh); TP_CHECK_ONLY=gpt2 or llama
# runs one model. Results: $RESULTS/tp_check.md (appended to).
only=${TP_CHECK_ONLY:-all}
if [[ $# -ge 1 ]]; then PKG=$1; fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
OUTMD=$RESULTS/tp_check.md
describe_machine | tee -a $OUTMD
mkdir -p $WORK/data && synthetic_shards $WORK/data
failed=0
port=29811

COMMON="--set precision.compute=fp32 --set parallel.micro_batch_size=1 --set parallel.micro_batch_num=2
        --set train.steps=8 --set train.warmup_steps=2 --set train.eval_interval=0
        --set data.train=$WORK/data/train.bin --set data.val=$WORK/data/val.bin --no-plan-check"

# run NAME CONFIG MODE TP SP ARGS...: one run in $WORK/NAME (its checkpoints deleted afterwards).
run() {
  local name=$1 cfg=$2 mode=$3 tp=$4 sp=$5; shift 5
  local dir=$WORK/$name start=$SECONDS
  local sets="--set parallel.model_parallel=$tp --set parallel.sequence_parallel=$sp --set runtime.run_dir=$dir"
  if [[ $mode == launch ]]; then
    port=$((port + 1))
    TROUPE_NCCL_HOST_PER_RANK=1 $BIN/troupe launch --worker_num $tp --master_port $port $cfg \
      $COMMON $sets "$@" > $RESULTS/tp_$name.log 2>&1
  else
    $BIN/troupe train $cfg $COMMON $sets "$@" > $RESULTS/tp_$name.log 2>&1
  fi
  local code=$?
  echo "$name: exit $code in $((SECONDS - start)) s" | tee -a $OUTMD
  if [[ $code -ne 0 ]]; then tail -20 $RESULTS/tp_$name.log; failed=1; fi
  rm -rf $dir/checkpoints
}

# compare MODEL NAMES...: the losses side by side and the checks (the first name is tp 1, the
# last two must be the same bits).
compare() {
  python3 - "$WORK" "$@" <<'PY' | tee -a $OUTMD
import json, sys
work, model, names = sys.argv[1], sys.argv[2], sys.argv[3:]
def metrics(n):
    try:
        return [json.loads(l) for l in open(f"{work}/{n}/metrics.jsonl") if l.strip()]
    except OSError:
        return []
runs = {n: metrics(n) for n in names}
print(f"\n### {model}\n")
print("| step | " + " | ".join(names) + " |")
print("|---|" + "---:|" * len(names))
steps = min(len(r) for r in runs.values())
for i in range(steps):
    print(f"| {i + 1} | " + " | ".join(repr(runs[n][i]["loss"]) for n in names) + " |")
def med(xs):
    xs = sorted(xs); return xs[len(xs) // 2] if xs else float("nan")
print("\n| run | median tokens/s (steps 3+) | largest peak device GiB of a rank |")
print("|---|---:|---:|")
for n in names:
    tps = med([m.get("tokens_per_s", 0) for m in runs[n][2:]])
    peak = max((s.get("peak_device_bytes", 0) for m in runs[n] for s in m.get("stages", [])), default=0)
    print(f"| {n} | {tps:,.0f} | {peak / 2**30:.2f} |")
ok = steps == 8
ref = runs[names[0]]
for n in names[1:]:
    w = max((abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(runs[n], ref)), default=float("nan"))
    good = w <= 1e-4
    ok &= good
    print(f"\n{n}: largest relative loss difference from {names[0]}: {w:.3g} ({'ok' if good else 'ABOVE 1e-4'})")
a, b = names[-2], names[-1]
same = [x["loss"] for x in runs[a]] == [x["loss"] for x in runs[b]] and steps == 8
ok &= same
print(f"{a} and {b}: losses {'bit-identical' if same else 'DIFFERENT'}")
print(f"{model}: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
  [[ ${PIPESTATUS[0]} -eq 0 ]] || failed=1
}

if [[ $only != llama ]]; then
GPT2=bench/configs/gpt2_124m_1gpu.toml
XL="--set model.num_layers=48 --set model.hidden_size=1600 --set model.num_heads=32 --set model.num_kv_heads=32"
run xl_tp1 $GPT2 train 1 false $XL
run xl_tp2 $GPT2 launch 2 false $XL
run xl_tp2_sp $GPT2 launch 2 true $XL
run xl_tp2_sp_1proc $GPT2 train 2 true $XL
compare "GPT-2 1.5B (48 x 1600, 32 heads), fp32" xl_tp1 xl_tp2 xl_tp2_sp xl_tp2_sp_1proc
fi

if [[ $only != gpt2 ]]; then
LLAMA=bench/configs/llama3_1b_1gpu.toml
run llama_tp1 $LLAMA train 1 false
run llama_tp2 $LLAMA launch 2 false
run llama_tp2_sp $LLAMA launch 2 true
run llama_tp2_sp_1proc $LLAMA train 2 true
compare "LLaMA-3-style 1B (16 x 2048, 32 / 8 heads, vocabulary 128,256, T 2048), fp32" \
  llama_tp1 llama_tp2 llama_tp2_sp llama_tp2_sp_1proc
fi

echo "tp_check: $([[ $failed -eq 0 ]] && echo PASS || echo FAIL)" | tee -a $OUTMD
exit $failed
