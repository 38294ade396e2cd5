#!/usr/bin/env bash
# troupe's LoRA adapters loaded by Hugging Face PEFT (bench/gpu/peft_check.py): small GPT-2 and
# LLaMA bases written by transformers, LoRA fine-tuned by troupe (on the CPU backend), exported
# with `troupe export --peft` and `--merge-lora`; PeftModel.from_pretrained must load the adapter
# with no missing or unexpected keys, give logits within 1e-4 (fp32) of troupe's and of the merged
# export, and merge_and_unload() must match the merged weights within 1e-5. Needs PyTorch,
# transformers and peft; the package bench/gpu/pack.sh staged.
# Usage, from the repository root: bash bench/gpu/peft_check.sh   (PKG, RESULTS, WORK: bench/gpu/common.sh)
# Prints one line per check and a JSON summary (also in $RESULTS/peft_check.txt); exit status 0
# when every check passed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
describe_machine
python3 bench/gpu/peft_check.py --bin "$BIN" --work "$WORK/peft_check" 2>&1 | tee "$RESULTS/peft_check.txt"
exit "${PIPESTATUS[0]}"
