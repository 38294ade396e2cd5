#!/usr/bin/env bash
# The GPU benchmarks of docs/PERFORMANCE.md, on one GPU beside the PyTorch baseline
# (bench/torch_gpt2.py), from the package bench/gpu/pack.sh staged. Parts (default: the first three):
#   gpt2-124m   GPT-2 124M (B 16, T 1024, bf16): troupe's training step (clip, CUDA graph) and
#               torch.compile interleaved twice, PyTorch eager, then troupe with --no-graph
#               (every op launched from the host) and --no-clip (the baseline's work)
#   pipeline    GPT-2 124M through the actor runtime as 4 pipeline stages (1F1B, 8 micro-batches)
#               and as one stage on the same global batch (bench/gpu_pipeline_bench)
#   schedules   GPT-2 124M as 4 pipeline stages, 8 micro-batches, under 1f1b, zb_h1, interleaved_1f1b
#               (2 chunks per rank, stage_layers [2,2,1,1,1,1,2,2]) and zb_v (two chunks per rank in
#               a V, stage_layers [2,1,2,1,2,1,2,1]): 3 layers per rank each; tokens/s, measured and
#               simulated bubble, peak memory per stage and the first and last loss, side by side
#   hash        the message hash recording runs per message tensor, and the optimizer shard's
#               AdamW with and without it (bench/gpu_message_hash_bench, --adamw 1500)
#   gpt2-1.5b   GPT-2 1.5B (48 layers, 1600 wide, 25 heads): troupe, troupe --no-graph,
#               torch.compile, PyTorch eager
#   profile     where a 124M step's time goes: troupe's per-op and per-phase tables, torch.compile's
#               kernels under torch.profiler, and attention alone (gpu_attention_bench, with the
#               Hopper kernels and with TROUPE_CUDA_ATTENTION=mma, beside PyTorch's flash and
#               cuDNN SDPA, bench/torch_attention_bench.py)
#   attention   the attention kernels alone at GPT-2 124M's and LLaMA-3 1B's shapes with each value
#               of TROUPE_CUDA_ATTENTION, beside cuDNN SDPA, then the Hopper forward's two tile
#               loaders (tma, cp-async) over seven shapes (docs/cuda.md, "The Hopper kernels")
#   kernels     the kernels of one 124M step under Nsight Compute at the GPU's own clocks, with the
#               bytes each moved, grouped by bench/ncu_kernels.py (needs ncu)
#   gemms       every GEMM of a step, cuBLASLt's first choice against its fastest candidate, at
#               124M's and 1.5B's widths (bench/gpu_gemm_bench), then the 1.5B step with the
#               heuristic's and with measured choices (--gemm-tune), interleaved twice
#   keep-gelu   the step with GELU outputs kept (recompute.keep_gelu, --keep-gelu N) against
#               recomputed, interleaved twice: 124M keeping 0, 6 and 12 layers, 1.5B 0, 32 and 48
# Usage, from the repository root: bash bench/gpu/bench.sh [PART...]   (PKG, RESULTS: common.sh)
# Needs python3 with PyTorch (CUDA) for the baseline. Every program's JSON line goes to
# $RESULTS/gpt2.jsonl; the summary table with ratios to $RESULTS/bench.md.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(gpt2-124m pipeline gpt2-1.5b)
jsonl=$RESULTS/gpt2.jsonl
: > "$jsonl"
describe_machine | tee "$RESULTS/machine.txt"
python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 |
  tee -a "$RESULTS/machine.txt"

# troupe TAG SECONDS ARGS...: gpu_gpt2_bench; its table row shown, its JSON line kept.
troupe() {
  local tag=$1 limit=$2; shift 2
  timeout "$limit" "$BIN/gpu_gpt2_bench" --tag "$tag" "$@" > "$RESULTS/$tag.log" 2>&1 ||
    echo "gpu_gpt2_bench $tag failed or timed out: $RESULTS/$tag.log"
  grep -v '^{' "$RESULTS/$tag.log" | tail -n 1
  grep '^{' "$RESULTS/$tag.log" >> "$jsonl"
}
# torch TAG SECONDS ARGS...: bench/torch_gpt2.py likewise.
torch() {
  local tag=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/torch_gpt2.py --tag "$tag" "$@" > "$RESULTS/$tag.log" 2>&1 ||
    echo "torch_gpt2.py $tag failed or timed out: $RESULTS/$tag.log"
  grep '^{' "$RESULTS/$tag.log" | tee -a "$jsonl"
}

big="--layers 48 --embd 1600 --heads 25"
for part in "${parts[@]}"; do
  echo "== $part"
  case $part in
    gpt2-124m)
      troupe troupe-124M 120 --steps 20
      torch compile-124M 300 --compile
      troupe troupe-124M-again 120 --steps 20
      torch compile-124M-again 300 --compile
      torch eager-124M 120
      troupe troupe-124M-no-graph 120 --steps 20 --no-graph
      troupe troupe-124M-no-clip 120 --steps 20 --no-clip
      ;;
    pipeline)
      timeout 400 "$BIN/gpu_pipeline_bench" --out "$RESULTS/pipeline.json" > "$RESULTS/pipeline.log" 2>&1 ||
        echo "gpu_pipeline_bench failed or timed out: $RESULTS/pipeline.log"
      tail -n 6 "$RESULTS/pipeline.log"
      ;;
    schedules)
      for s in 1f1b zb_h1 interleaved_1f1b zb_v; do
        extra=()
        [[ $s == zb_v ]] && extra=(--stage-layers "[2,1,2,1,2,1,2,1]")
        [[ $s == interleaved_1f1b ]] && extra=(--virtual 2 --stage-layers "[2,2,1,1,1,1,2,2]")
        timeout 400 "$BIN/gpu_pipeline_bench" --schedule "$s" --no-single "${extra[@]}" \
          --out "$RESULTS/schedule-$s.json" > "$RESULTS/schedule-$s.log" 2>&1 ||
          echo "gpu_pipeline_bench --schedule $s failed or timed out: $RESULTS/schedule-$s.log"
        echo "$s: $(tail -n 3 "$RESULTS/schedule-$s.log" | head -n 2 | tail -n 1)"
        # The first and last loss: every schedule should end on the same bits.
        python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))["runs"][0]; print("  losses", r["first_loss"], r["last_loss"])' \
          "$RESULTS/schedule-$s.json" 2>/dev/null
      done
      ;;
    hash)
      timeout 200 "$BIN/gpu_message_hash_bench" --mib 4096 --reps 10 --json "$RESULTS/message_hash.json" ||
        echo "gpu_message_hash_bench failed or timed out"
      timeout 200 "$BIN/gpu_message_hash_bench" --adamw 1500 --reps 7 --json "$RESULTS/adamw_hash.json" ||
        echo "gpu_message_hash_bench --adamw failed or timed out"
      ;;
    gpt2-1.5b)
      troupe troupe-1.5B 300 $big --steps 8 --warmup 2
      troupe troupe-1.5B-no-graph 300 $big --steps 8 --warmup 2 --no-graph
      torch compile-1.5B 400 --compile $big --steps 10
      torch eager-1.5B 200 $big --steps 10
      ;;
    profile)
      timeout 200 "$BIN/gpu_gpt2_bench" --tag troupe-124M-profile --steps 10 --profile --phases \
        > "$RESULTS/profile-troupe.log" 2>&1
      grep -v '^{' "$RESULTS/profile-troupe.log" | tail -n 40
      timeout 400 python3 bench/torch_profile.py --compile --steps 10 > "$RESULTS/profile-torch.log" 2>&1
      head -n 25 "$RESULTS/profile-torch.log"
      timeout 120 "$BIN/gpu_attention_bench" > "$RESULTS/attention-troupe.log" 2>&1
      tail -n 8 "$RESULTS/attention-troupe.log"
      TROUPE_CUDA_ATTENTION=mma timeout 120 "$BIN/gpu_attention_bench" 2>&1 | tail -n 1 |
        tee "$RESULTS/attention-troupe-mma.log"
      for backend in flash cudnn; do
        timeout 120 python3 bench/torch_attention_bench.py --backend $backend |
          tee -a "$RESULTS/attention-torch.log"
      done
      ;;
    attention)
      for shape in "" "--batch 4 --seq 2048 --heads 32 --kv-heads 8"; do
        for mode in auto tma cp-async mma; do
          echo "TROUPE_CUDA_ATTENTION=$mode $shape"
          TROUPE_CUDA_ATTENTION=$mode timeout 60 "$BIN/gpu_attention_bench" $shape 2>&1 |
            grep -E 'forward|backward' | tee -a "$RESULTS/attention-modes.log"
        done
        timeout 120 python3 bench/torch_attention_bench.py --backend cudnn $shape |
          tee -a "$RESULTS/attention-torch.log"
      done
      for shape in "32 512 12 12" "16 1024 12 12" "8 2048 12 12" "4 4096 12 12" \
                   "8 1024 32 8" "4 2048 32 8" "2 4096 32 8"; do
        read -r b t h kv <<< "$shape"
        for mode in cp-async tma; do
          printf 'B %s T %s heads %s/%s %-9s ' "$b" "$t" "$h" "$kv" "$mode"
          TROUPE_CUDA_ATTENTION=$mode timeout 60 "$BIN/gpu_attention_bench" --batch "$b" \
            --seq "$t" --heads "$h" --kv-heads "$kv" 2>&1 | grep -E '^ +forward'
        done
      done | tee "$RESULTS/attention-shapes.log"
      ;;
    kernels)
      if ! command -v ncu > /dev/null; then
        echo "kernels: no ncu (Nsight Compute) on this machine; part skipped"
        continue
      fi
      timeout 400 ncu --clock-control none --cache-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        "$BIN/gpu_gpt2_bench" --no-graph --warmup 1 --steps 1 > "$RESULTS/kernels-124M.csv" \
        2> "$RESULTS/kernels-124M.err" || echo "ncu failed or timed out: $RESULTS/kernels-124M.err"
      python3 bench/ncu_kernels.py "$RESULTS/kernels-124M.csv" | tee "$RESULTS/kernels-124M.md"
      ;;
    gemms)
      for embd in 768 1600; do
        timeout 200 "$BIN/gpu_gemm_bench" --embd $embd --algos 12 --reps 10 --rounds 2 \
          > "$RESULTS/gemms-$embd.log" 2>&1 || echo "gpu_gemm_bench --embd $embd failed or timed out"
        grep -v '^{' "$RESULTS/gemms-$embd.log"
      done
      rm -f "$RESULTS/gemm-tune-1.5B.txt"
      for round in 1 2; do
        troupe "troupe-1.5B-heuristic-$round" 300 $big --steps 6 --warmup 2
        troupe "troupe-1.5B-tuned-$round" 300 $big --steps 6 --warmup 2 \
          --gemm-tune "$RESULTS/gemm-tune-1.5B.txt"
      done
      ;;
    keep-gelu)
      for round in 1 2; do
        for keep in 0 6 12; do troupe "troupe-124M-keep-gelu-$keep-$round" 100 --keep-gelu $keep; done
        for keep in 0 32 48; do
          troupe "troupe-1.5B-keep-gelu-$keep-$round" 300 $big --steps 6 --warmup 2 --keep-gelu $keep
        done
      done
      ;;
    *) echo "bench.sh: unknown part '$part' (gpt2-124m, pipeline, schedules, hash, gpt2-1.5b, profile, attention, kernels, gemms, keep-gelu)" >&2; exit 2 ;;
  esac
done

# The summary: one row per run, each model's torch rows with troupe's default step over theirs
# (tokens/s; the first troupe run of that model).
python3 - "$jsonl" <<'PY' | tee "$RESULTS/bench.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| model | run | step (median) | tokens/s | model TFLOP/s | peak memory | troupe / this |")
print("|---|---|---:|---:|---:|---:|---:|")
first = {}
for r in rows:
    model = f"{r['L']}x{r['C']}"
    if r.get("engine") == "troupe":
        first.setdefault(model, r["tok_s"])
for r in rows:
    model = f"{r['L']}x{r['C']}"
    ratio = ""
    if r.get("engine") != "troupe" and model in first:
        ratio = f"{first[model] / r['tok_s']:.3f}"
    print(f"| {r['params'] / 1e6:.0f}M | {r['tag']} | {r['step_ms']:.2f} ms | {int(r['tok_s']):,} | "
          f"{r['tflops']} | {r['peak_gib']:.2f} GiB | {ratio} |")
PY
