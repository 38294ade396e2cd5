#!/usr/bin/env bash
# troupe against Hugging Face transformers (bench/gpu/hf_check.py): directories transformers
# writes, imported by troupe, and troupe's exports loaded by transformers, logits within 1e-4 in
# fp32 on the GPU. Needs PyTorch and transformers; the package bench/gpu/pack.sh staged.
# Usage, from the repository root: bash bench/gpu/hf_check.sh   (PKG, RESULTS, WORK: bench/gpu/common.sh)
# Prints one line per check and a JSON summary (also in $RESULTS/hf_check.txt); exit status 0 when
# every check passed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
describe_machine
python3 bench/gpu/hf_check.py --bin "$BIN" --work "$WORK/hf_check" 2>&1 | tee "$RESULTS/hf_check.txt"
exit "${PIPESTATUS[0]}"
