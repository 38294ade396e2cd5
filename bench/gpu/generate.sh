#!/usr/bin/env bash
# `troupe generate` (KV cache) against transformers' `generate` on the same GPT-2 124M weights, in
# one run: bench/gpu/generate_bench.py with the package's troupe (docs/generation.md).
# Usage, from the repository root: bash bench/gpu/generate.sh [generate_bench.py flags]
#   (PKG, RESULTS, WORK: bench/gpu/common.sh; TOKENIZER: the GPT-2 vocabulary, default data/gpt2)
# Results: $RESULTS/generate.jsonl (one JSON line per measurement) and $RESULTS/generate.txt.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set -uo pipefail
describe_machine | tee "$RESULTS/generate.txt"
python3 bench/gpu/generate_bench.py --troupe "$BIN/troupe" --tokenizer "${TOKENIZER:-data/gpt2}" \
  --work "$WORK/generate" --out "$RESULTS/generate.jsonl" "$@" 2>&1 | tee -a "$RESULTS/generate.txt"
exit "${PIPESTATUS[0]}"
