#!/usr/bin/env bash
# Usage: examples/finetune/run.sh [--small] [--steps N (default 150)] [--pretrain-steps N]
#                                 [--base RUN_DIR] [--build DIR] [--work DIR]
#
# Fine-tuning a pretrained model with LoRA on instruction data, end to end:
#   1. the pretrained model: a run of configs/tiny.toml (the README demo's; --base RUN_DIR takes an
#      existing one such as runs/tiny, otherwise it is trained here), exported with `troupe export`
#      as a Hugging Face directory;
#   2. a task with a measurable answer, made offline from the corpus (make_task.py): count the
#      words of a list of one to six ("Count: whale ship sea. Answer:" -> " 3"); held-out prompts
#      use word lists that no training record has;
#   3. `troupe data prepare` turns the JSONL records into instruction shards of 16-token rows
#      (prompt masked, answer and end-of-text trained);
#   4. the task metric before: greedy `troupe generate` on the held-out prompts, exact answers;
#   5. LoRA fine-tuning with `troupe train --init <export>` ([lora] rank 16 on c_attn, c_proj and
#      c_fc, and the tied token embedding trained in full beside them): the other base weights
#      stay frozen;
#   6. `troupe export --merge-lora` folds the adapters into the weights, and the metric after is
#      measured on the merged export.
# The script exits 1 unless every step works, the fine-tuning loss falls and (full form) the task
# metric after fine-tuning is above the metric before; it reports both.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
default_steps=150
ft_seq=16  # fine-tuning rows: the longest record is 13 tokens
parse_options "$@"
pretrain_steps=""
base=""
set -- "${extra_args[@]+"${extra_args[@]}"}"
while [ $# -gt 0 ]; do
  case "$1" in
    --pretrain-steps) pretrain_steps="$2"; shift ;;
    --base) base="$2"; shift ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done
if [ "$small" = 1 ]; then
  [ -n "$pretrain_steps" ] || pretrain_steps=3
  [ "$steps" != 3 ] || steps=12   # enough steps for the loss to fall
  records=400; heldout=16
else
  [ -n "$pretrain_steps" ] || pretrain_steps=60
  records=4000; heldout=100
fi
prepare
here="$root/examples/finetune"

echo "== 1. the pretrained model"
if [ -n "$base" ]; then
  base_run="$(cd "$base" && pwd)"
  echo "using $base"
else
  base_run="$work/pretrain"
  run "$troupe" train "$config" "${sets[@]}" --set "train.steps=$pretrain_steps" \
    --set "runtime.run_dir=$base_run" > "$work/pretrain.out" 2>&1 ||
    { tail -n 20 "$work/pretrain.out" >&2; die "pretraining failed"; }
  grep -E "^done" "$work/pretrain.out" || true
fi
run "$troupe" export "$base_run" --out "$work/base_hf" --tokenizer data/gpt2 > "$work/export_base.out" 2>&1 ||
  { cat "$work/export_base.out" >&2; die "troupe export of the base failed"; }
ls "$work/base_hf" | sed 's/^/  /'

echo
echo "== 2. the task"
run python3 "$here/make_task.py" data/raw "$work/task" --train "$records" --heldout "$heldout"

echo
echo "== 3. instruction shards"
ft_sets=(--set "data.train=$work/ft_tokens/train.bin" --set "data.val=$work/ft_tokens/val.bin"
         --set "model.seq_length=$ft_seq" --set parallel.micro_batch_num=2
         --set "train.steps=$steps" --set train.warmup_steps=5 --set train.eval_interval=0
         --set optimizer.lr=3e-3 --set optimizer.weight_decay=0
         --set lora.rank=16 --set lora.alpha=32 --set "lora.targets=c_attn,c_proj,c_fc"
         --set lora.trainable=wte)
run "$troupe" data prepare --input "$work/task/train.jsonl" --out "$work/ft_tokens" \
  --config "$config" --set "model.seq_length=$ft_seq" > "$work/prepare.out" 2>&1 ||
  { cat "$work/prepare.out" >&2; die "troupe data prepare failed"; }
tail -n 1 "$work/prepare.out"

# score MODEL NAME: greedy answers to the held-out prompts; prints and stores the exact-match count.
score() {
  local model="$1" name="$2"
  bounded "$troupe" generate "$model" --prompts "$work/task/heldout_prompts.jsonl" --temperature 0 \
    --max-new-tokens 4 --device cpu > "$work/$name.txt" 2> "$work/$name.err" ||
    { cat "$work/$name.err" >&2; die "troupe generate on $model failed"; }
  python3 "$here/score.py" "$work/task/heldout.jsonl" "$work/$name.txt" | tee "$work/$name.score"
}

echo
echo "== 4. the task metric before fine-tuning"
show "$troupe" generate "$work/base_hf" --prompts "$work/task/heldout_prompts.jsonl" --temperature 0 --max-new-tokens 4
score "$work/base_hf" before

echo
echo "== 5. LoRA fine-tuning from the export"
run "$troupe" train "$config" "${ft_sets[@]}" --init "$work/base_hf" \
  --set "runtime.run_dir=$work/lora" > "$work/lora.out" 2>&1 ||
  { tail -n 20 "$work/lora.out" >&2; die "LoRA fine-tuning failed"; }
grep -m 3 -E "trainable|^done" "$work/lora.out" || true
first="$(losses "$work/lora" | awk 'NR == 1 { print $2 }')"  # head would cut sed's pipe
last="$(losses "$work/lora" | tail -n 1 | cut -d' ' -f2)"
echo "loss: $first at the first step, $last at the last"
python3 -c "import sys; sys.exit(0 if float('$last') < float('$first') else 1)" ||
  die "the fine-tuning loss did not fall ($first -> $last)"

echo
echo "== 6. merge, export, and the task metric after"
run "$troupe" export "$work/lora" --out "$work/merged_hf" --merge-lora \
  --tokenizer data/gpt2 > "$work/export_merged.out" 2>&1 ||
  { cat "$work/export_merged.out" >&2; die "troupe export --merge-lora failed"; }
ls "$work/merged_hf" | sed 's/^/  /'
score "$work/merged_hf" after
echo
echo "== a sample"
run "$troupe" generate "$work/merged_hf" --prompt $'Count: the white whale. Answer:\n' --temperature 0 \
  --max-new-tokens 4 --device cpu 2>/dev/null

before="$(cut -d' ' -f1 "$work/before.score")"
after="$(cut -d' ' -f1 "$work/after.score")"
echo
echo "task metric (exact answers on $heldout held-out prompts): $before before, $after after fine-tuning"
if [ "$small" = 0 ] && [ "$after" -le "$before" ]; then
  die "fine-tuning did not improve the task metric ($before -> $after)"
fi
