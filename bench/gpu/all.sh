#!/usr/bin/env bash
# Every measurement docs/PERFORMANCE.md reports from a GPU machine, in one run: each section's
# script in turn, with the arguments that section names, each into a folder of its own under
# $RESULTS, then a summary of each section's exit status, time and results. It needs PyTorch with
# CUDA for the baselines.
#
#   bash bench/gpu/all.sh [--list] [SECTION...]     (default: every section, in this order)
#
# Sections:
#   product   `troupe train` / `troupe launch` against torch.compile: GPT-2 124M and 1.5B, the
#             LLaMA-3-style 1B, and the CPU recording pair (bench/gpu/product.sh 25)
#   steps     the training step alone and where its time goes: gpu_gpt2_bench against PyTorch at
#             124M and 1.5B, the per-op profile, the message hash, the pipeline by schedule, the
#             attention kernels by loader and shape, the step's kernels under Nsight Compute, the
#             GEMM survey (bench/gpu/bench.sh gpt2-124m gpt2-1.5b profile hash pipeline schedules
#             attention kernels gemms)
#   bubbles   pp 4 bubbles from the host, the device and the simulator (bench/gpu/bubbles.sh)
#   record    recording off and on through `troupe train`, LLaMA then GPT-2 124M, two rounds each
#             (bench/gpu/record_cost.sh)
#   cpu       configs/tiny.toml on two pinned cores of the GPU machine's host against PyTorch
#             (bench/cpu_tiny.sh --cores 0,1 --reps 1 --steps 8 --torch-seconds 35)
#
# From the repository root, with the package of bench/gpu/pack.sh staged (bench/README.md); PKG
# and RESULTS as in bench/gpu/common.sh. Each section's output: $RESULTS/SECTION/ and
# $RESULTS/SECTION.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
all=(product steps bubbles record cpu)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
if [[ ${1:-} == --list ]]; then printf '%s\n' "${all[@]}"; exit 0; fi
sections=("$@")
[[ ${#sections[@]} -gt 0 ]] || sections=("${all[@]}")
for s in "${sections[@]}"; do
  [[ " ${all[*]} " == *" $s "* ]] ||
    { echo "all.sh: no section $s (sections: ${all[*]})" >&2; exit 2; }
done
PKG=${PKG:-build-gpu}
RESULTS=${RESULTS:-$PKG/results}
mkdir -p "$RESULTS"
run_section() {
  local s=$1
  local dir=$RESULTS/$s
  mkdir -p "$dir"
  local start=$SECONDS rc=0
  echo "== $s ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  case "$s" in
    product) PARTS="gpt2 gpt2-1.5b llama cpu" RESULTS=$dir bash bench/gpu/product.sh 25 || rc=$? ;;
    steps) RESULTS=$dir bash bench/gpu/bench.sh gpt2-124m gpt2-1.5b profile hash pipeline schedules \
             attention kernels gemms || rc=$? ;;
    bubbles) RESULTS=$dir bash bench/gpu/bubbles.sh || rc=$? ;;
    record)
      RESULTS=$dir/llama bash bench/gpu/record_cost.sh --model llama --rounds 2 || rc=$?
      RESULTS=$dir/gpt2 bash bench/gpu/record_cost.sh --model gpt2 --rounds 2 --steps 25 || rc=$? ;;
    cpu)
      # common.sh unpacks the package when no section before this one did.
      (RESULTS=$dir source bench/gpu/common.sh &&
         bash bench/cpu_tiny.sh --troupe "$BIN/troupe" --cores 0,1 --reps 1 --steps 8 \
           --torch-seconds 35) || rc=$? ;;
  esac
  echo "== $s: exit $rc after $((SECONDS - start)) s"
}
for s in "${sections[@]}"; do run_section "$s" 2>&1 | tee "$RESULTS/$s.log"; done
echo "== summary"
for s in "${sections[@]}"; do
  echo "$(grep "^== $s: exit" "$RESULTS/$s.log" | tail -n 1 | sed 's/^== //'); output in" \
       "$RESULTS/$s.log, results in $RESULTS/$s/"
done
