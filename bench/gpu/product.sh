#!/usr/bin/env bash
# The product's own numbers on one GPU, beside the PyTorch baseline in the same run: GPT-2 124M
# (bench/configs/gpt2_124m_1gpu.toml: one micro-batch of 16 x 1024, bf16, pp 1) through
# `troupe train --single-rank`, `troupe train` (actors) with recording on and off, and
# `troupe launch` (one worker process), each measured by bench/train_bench.py from its
# metrics.jsonl, then the step alone (gpu_gpt2_bench) and bench/torch_gpt2.py with torch.compile
# (clipping at 1.0 as the configs' train.grad_clip does; at 124M also once without the clip);
# the message-hash and actor-runtime GPU tests first; and the recording's cost on the CPU
# (configs/tiny.toml pinned to two cores, on and off); a LLaMA-3-style 1B
# (bench/configs/llama3_1b_1gpu.toml) through `troupe train` beside torch.compile of the same model;
# and, as part gpt2-1.5b (not in the default parts), GPT-2 1.5B (bench/configs/gpt2_1.5b_1gpu.toml)
# through `troupe train` beside torch.compile, the two alternating twice (BIG_STEPS steps, 16).
#
#   bash bench/gpu/pack.sh build-cuda     # where troupe was built with CUDA
#   bash bench/gpu/product.sh [steps]     # on the GPU machine, from the repository root
#   PARTS="gpt2 llama" bash bench/gpu/product.sh 25   # only some parts (default: gpt2 llama cpu)
#
# GPT2_SETS="--set KEY=VALUE ..." adds settings to every troupe run of the gpt2 and gpt2-1.5b parts
# (e.g. GPT2_SETS="--set recompute.keep_gelu=6"); TESTS=0 leaves out the GPU tests at the top.
# Results: $RESULTS/results.jsonl, llama.jsonl, big.jsonl, cpu.jsonl and the tables in
# $RESULTS/product.md.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
S=bench
STEPS=${1:-30}
B=$BIN
O=$RESULTS
W=$WORK
PARTS=${PARTS:-gpt2 llama cpu}
part() { [[ " $PARTS " == *" $1 "* ]]; }
date -u | tee $O/date.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee -a $O/date.txt

if [[ ${TESTS:-1} != 0 ]]; then
echo "== message hash on the GPU against its CPU twin"
for t in test_kernels test_message_hash; do
  [ -x $B/$t ] && timeout 120 $B/$t -tc='*message hash*' 2>&1 | tail -3 | tee -a $O/tests.log
done
if [ -x $B/test_runtime ]; then
  echo "== the actor runtime on the GPU (recording on) against the single-rank loop, bit for bit"
  timeout 300 $B/test_runtime -tc='cuda*' > $O/test_runtime.log 2>&1; tail -3 $O/test_runtime.log | tee -a $O/tests.log
  grep -B3 -A14 "ERROR\|FAILED" $O/test_runtime.log | head -40
fi
fi

if part gpt2; then
python3 $S/train_bench.py data $W/data --tokens 3000000 --vocab 50257 >/dev/null
RUN="python3 $S/train_bench.py run --troupe $B/troupe $S/configs/gpt2_124m_1gpu.toml --steps $STEPS --out $O/results.jsonl
     --set data.train=$W/data/train.bin --set data.val=$W/data/val.bin ${GPT2_SETS:-}"
echo "== GPT-2 124M, B 16, T 1024, bf16, one GPU ($STEPS steps, median of steps 3..)"
$RUN --mode single-rank --label "train --single-rank"
$RUN --mode train --label "train (record on)" --keep --run-dir $W/rec
$RUN --mode train --label "train (record off)" --set runtime.record=false
$RUN --mode launch --workers 1 --label "launch (1 worker)"
timeout 100 $B/gpu_gpt2_bench --tag gpu_gpt2_bench --steps 20 2>&1 | tail -1 | tee -a $O/results.jsonl
timeout 200 python3 $S/torch_gpt2.py --compile --clip 1.0 --tag torch.compile 2>&1 | tail -1 |
  tee -a $O/results.jsonl
timeout 200 python3 $S/torch_gpt2.py --compile --tag "torch.compile, no clip" 2>&1 | tail -1 |
  tee -a $O/results.jsonl
fi

if part gpt2-1.5b; then
# A 1.5B step draws the GPU's full power, and its clocks follow its temperature: the two engines
# alternate, twice, so that neither runs only on a cooler or a hotter GPU.
echo "== GPT-2 1.5B (48 x 1600, 25 heads), B 16, T 1024, bf16, one GPU, BIG_STEPS=${BIG_STEPS:=16}"
python3 $S/train_bench.py data $W/data --tokens 3000000 --vocab 50257 >/dev/null
for round in 1 2; do
  python3 $S/train_bench.py run --troupe $B/troupe $S/configs/gpt2_1.5b_1gpu.toml \
    --steps $BIG_STEPS --out $O/big.jsonl --set data.train=$W/data/train.bin \
    --set data.val=$W/data/val.bin ${GPT2_SETS:-} --mode train --label "1.5B train ${GPT2_SETS:-(defaults)} $round"
  timeout 400 python3 $S/torch_gpt2.py --compile --clip 1.0 --tag "torch.compile $round" \
    --layers 48 --embd 1600 --heads 25 --steps $BIG_STEPS 2>&1 | tail -1 | tee -a $O/big.jsonl
done
fi

if part llama; then
echo "== LLaMA-3-style 1B (16 x 2048, 32/8 heads, vocabulary 128,256), B 4, T 2048, bf16, one GPU"
python3 $S/train_bench.py data $W/llama --tokens 3000000 --vocab 128256 >/dev/null
LRUN="python3 $S/train_bench.py run --troupe $B/troupe $S/configs/llama3_1b_1gpu.toml --steps $STEPS
      --out $O/llama.jsonl --set data.train=$W/llama/train.bin --set data.val=$W/llama/val.bin"
$LRUN --mode single-rank --label "llama train --single-rank"
$LRUN --mode train --label "llama train (record off)" --set runtime.record=false
$LRUN --mode train --label "llama train (defaults)"
timeout 300 python3 $S/torch_gpt2.py --compile --clip 1.0 --tag torch.compile --arch llama \
  --layers 16 --embd 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --seq 2048 \
  --batch 4 2>&1 | tail -1 | tee -a $O/llama.jsonl
fi

if part cpu; then
echo "== CPU: configs/tiny.toml pinned to 2 cores, recording on and off"
mkdir -p $W/tiny && python3 $S/train_bench.py data $W/tiny --tokens 400000 --vocab 50257 >/dev/null
CPU="python3 $S/train_bench.py run --troupe $B/troupe configs/tiny.toml --steps 7 --skip 2 --out $O/cpu.jsonl
     --set data.train=$W/tiny/train.bin --set data.val=$W/tiny/val.bin --set data.tokenizer_dir=\"\""
for i in 1 2; do
  taskset -c 0,1 $CPU --label "tiny cpu record on ($i)"
  taskset -c 0,1 $CPU --label "tiny cpu record off ($i)" --set runtime.record=false
done
fi

: > $O/product.md
part gpt2 && python3 $S/train_bench.py table $O/results.jsonl --baseline torch.compile | tee -a $O/product.md
part gpt2-1.5b && python3 $S/train_bench.py table $O/big.jsonl --baseline "torch.compile 1" |
  tee -a $O/product.md
part llama && python3 $S/train_bench.py table $O/llama.jsonl --baseline torch.compile | tee -a $O/product.md
part cpu && python3 $S/train_bench.py table $O/cpu.jsonl | tee -a $O/product.md
