#!/usr/bin/env bash
# Every CUDA test case of the tree, on a GPU machine, from the package bench/gpu/pack.sh staged:
#   test_kernels  cuda* and gemm* cases (every CUDA op against the CPU backend, graphs, tuning)
#   test_model    cuda* cases (training on the GPU against the CPU, the recorded CUDA graph step)
#   test_runtime  cuda* cases (the actor runtime on the GPU against the single-rank CUDA loop)
#   test_transport  the nccl transport's cases
#   test_cli      gpu* cases (a launched pipeline over nccl against troupe train)
# then launch checks: `troupe launch` over nccl against `troupe train` in one process, fp32,
# comparing every checkpoint file and every step's loss: pipeline_stage 2 (2 processes) and
# pipeline_stage 2 x data_parallel 2 (4 processes) on GPU 0 (each rank its own NCCL host id), and
# where two or more GPUs are visible, data_parallel 2, the same with ZeRO-1, and pipeline_stage 2
# with one process per GPU.
# Usage, from the repository root: bash bench/gpu/tests.sh   (PKG, RESULTS, WORK: bench/gpu/common.sh)
# Prints a summary (also in $RESULTS/tests.txt); exit status 0 when everything passed, else 1.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
summary=$RESULTS/tests.txt
failed=0
say() { echo "$*" | tee -a "$summary"; }
: > "$summary"
describe_machine | tee -a "$summary"

# run_cases PROGRAM FILTER...: one doctest program with its filters; the last lines of its report.
run_cases() {
  local program=$1; shift
  local log=$RESULTS/$program.log
  timeout 600 "$BIN/$program" "$@" > "$log" 2>&1
  local rc=$?
  say "== $program $* (exit $rc)"
  grep -E '^\[doctest\] (test cases|assertions|Status)' "$log" | tee -a "$summary"
  if [[ $rc -ne 0 ]]; then
    failed=1
    grep -B3 -A12 -E 'ERROR|FAILED' "$log" | head -60
  fi
}

run_cases test_kernels -tc='cuda*,gemm*'
run_cases test_model -tc='cuda*'
run_cases test_runtime -tc='cuda*'
run_cases test_transport -sf='*nccl_test.cpp'
# The CLI test runs the troupe binary of its build folder unless told where the package's is.
TROUPE_TEST_BINARY="$PWD/$BIN/troupe" run_cases test_cli -tc='gpu*'

# launch_check NAME CONFIG WORKERS [VAR=VALUE...]: troupe train and troupe launch of CONFIG.
launch_check() {
  local name=$1 config=$2 workers=$3; shift 3
  local dir=$WORK/$name
  say "== launch check $name: $workers processes over nccl against one process${*:+ ($*)}"
  timeout 300 "$BIN/troupe" train "$config" --set runtime.run_dir="$dir/train" \
    > "$RESULTS/$name-train.log" 2>&1 || { say "troupe train failed: $RESULTS/$name-train.log"; failed=1; return; }
  port=$((port + 1))
  env "$@" timeout 300 "$BIN/troupe" launch --worker_num "$workers" --master_port "$port" \
    --grace 5 "$config" --set runtime.run_dir="$dir/launch" > "$RESULTS/$name-launch.log" 2>&1
  local rc=$?
  cp -r "$dir/launch/logs" "$RESULTS/$name-logs" 2>/dev/null
  if [[ $rc -ne 0 ]]; then say "troupe launch exited $rc: $RESULTS/$name-launch.log"; failed=1; return; fi
  local files=0 differ=0 f
  for f in "$dir"/train/checkpoints/step_*/*.safetensors; do
    files=$((files + 1))
    cmp -s "$f" "$dir/launch/checkpoints/${f#"$dir"/train/checkpoints/}" || { differ=$((differ + 1)); say "differs: ${f##*/}"; }
  done
  local losses_train losses_launch
  losses_train=$(grep -o '"step":[0-9]*,"loss":[^,]*' "$dir/train/metrics.jsonl")
  losses_launch=$(grep -o '"step":[0-9]*,"loss":[^,]*' "$dir/launch/metrics.jsonl")
  if [[ $files -gt 0 && $differ -eq 0 && -n $losses_train && $losses_train == "$losses_launch" ]]; then
    say "identical: $files checkpoint files, losses $(echo "$losses_train" | sed 's/.*"loss"://' | tr '\n' ' ')"
  else
    say "DIFFERENT: $differ of $files checkpoint files, losses $( [[ $losses_train == "$losses_launch" ]] && echo equal || echo differ)"
    failed=1
  fi
}

synthetic_shards "$WORK"
port=29610
cat > "$WORK/pp2.toml" <<T
[model]
arch = "gpt2"
vocab_size = 64
num_layers = 2
hidden_size = 32
num_heads = 4
seq_length = 16
[parallel]
pipeline_stage = 2
data_parallel = 1
micro_batch_size = 2
micro_batch_num = 2
[optimizer]
lr = 1e-2
[train]
steps = 4
warmup_steps = 1
eval_interval = 2
eval_batches = 1
[data]
train = "$WORK/train64.bin"
val = "$WORK/val64.bin"
[runtime]
device = "cuda"
T
# configs/tiny.toml's model (GPT-2 vocabulary, 4 layers of 128) as pipeline 2 x data 2.
sed -e 's/vocab_size = 64/vocab_size = 50257/' -e 's/num_layers = 2/num_layers = 4/' \
    -e 's/hidden_size = 32/hidden_size = 128/' -e 's/seq_length = 16/seq_length = 64/' \
    -e 's/data_parallel = 1/data_parallel = 2/' -e 's/micro_batch_size = 2/micro_batch_size = 4/' \
    -e 's/micro_batch_num = 2/micro_batch_num = 4/' -e 's/train64/train/' -e 's/val64/val/' \
    "$WORK/pp2.toml" > "$WORK/tiny_pp2_dp2.toml"
launch_check pp2 "$WORK/pp2.toml" 2 TROUPE_NCCL_HOST_PER_RANK=1
launch_check tiny_pp2_dp2 "$WORK/tiny_pp2_dp2.toml" 4 TROUPE_NCCL_HOST_PER_RANK=1

gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
if [[ $gpus -ge 2 ]]; then
  sed -e 's/pipeline_stage = 2/pipeline_stage = 1/' -e 's/data_parallel = 1/data_parallel = 2/' \
    "$WORK/pp2.toml" > "$WORK/dp2.toml"
  sed -e 's/^lr = 1e-2$/lr = 1e-2\nzero_stage = 1/' "$WORK/dp2.toml" > "$WORK/dp2_zero1.toml"
  launch_check gpus_dp2 "$WORK/dp2.toml" 2
  launch_check gpus_dp2_zero1 "$WORK/dp2_zero1.toml" 2
  launch_check gpus_pp2 "$WORK/pp2.toml" 2
else
  say "== fewer than two GPUs visible: the checks with one process per GPU are left out"
fi

if [[ $failed -eq 0 ]]; then say "tests.sh: everything passed"; else say "tests.sh: FAILURES above"; fi
exit $failed
