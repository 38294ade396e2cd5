#!/usr/bin/env bash
# Peak device memory of LoRA against full fine-tuning on one GPU: GPT-2 124M
# (bench/configs/gpt2_124m_1gpu.toml: one micro-batch of 16 x 1024, bf16) trained a few steps by
# `troupe train --single-rank` and by `troupe train` (actors), with every weight training and with
# LoRA adapters (rank 8 on c_attn, PEFT's default; rank 16 on every linear module). Each run's
# peak comes from its own metrics.jsonl (bench/train_bench.py: peak_device_bytes, the stage's and
# its optimizer shard's allocators); the loss at step 0 is printed beside it (LoRA starts from the
# base model's loss).
#
#   bash bench/gpu/pack.sh build-cuda       # where troupe was built with CUDA
#   bash bench/gpu/lora_memory.sh [steps]   # on the GPU machine, from the repository root
#
# Results: $RESULTS/lora.jsonl and the table in $RESULTS/lora.md (also on stdout).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
STEPS=${1:-8}
describe_machine | tee $RESULTS/lora_machine.txt
python3 bench/train_bench.py data $WORK/data --tokens 2000000 --vocab 50257 >/dev/null
rm -f $RESULTS/lora.jsonl
for mode in single-rank train; do
  RUN="python3 bench/train_bench.py run --troupe $BIN/troupe bench/configs/gpt2_124m_1gpu.toml
       --mode $mode --steps $STEPS --skip 3 --out $RESULTS/lora.jsonl
       --set data.train=$WORK/data/train.bin --set data.val=$WORK/data/val.bin --set train.steps=$STEPS"
  $RUN --label "full fine-tuning ($mode)" --keep --run-dir $WORK/full_$mode
  $RUN --label "LoRA r8 c_attn ($mode)" --set lora.rank=8 --keep --run-dir $WORK/lora8_$mode
  $RUN --label "LoRA r16 all linears ($mode)" --set lora.rank=16 \
       --set lora.targets=c_attn,c_proj,c_fc --keep --run-dir $WORK/lora16_$mode
done
python3 bench/train_bench.py table $RESULTS/lora.jsonl --baseline "full fine-tuning (single-rank)" \
  | tee $RESULTS/lora.md
echo "step-0 loss of each run (LoRA runs start from the same weights as the full run):" | tee -a $RESULTS/lora.md
for d in $WORK/full_* $WORK/lora*; do
  printf '%s: %s\n' "$(basename $d)" "$(head -1 $d/metrics.jsonl | python3 -c 'import json,sys; print(json.load(sys.stdin)["loss"])')"
done | tee -a $RESULTS/lora.md
