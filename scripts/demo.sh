#!/usr/bin/env bash
# The README's main job on a fresh machine: install and fetch what is needed, build, tokenize the
# corpus (skipped when the shards are newer than every text file), train configs/tiny.toml as 4
# worker processes (pipeline_stage 2 × data_parallel 2, `troupe launch`: one process per rank, as
# on GPUs) with a progress line per step, then sample text from the final checkpoint.
# Usage: scripts/demo.sh [launch options, e.g. --set train.steps=50]; TROUPE_DEMO_PORT picks the
# rendezvous port (default 29500).
# The sample is taken from runs/tiny, the run directory configs/tiny.toml names.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/setup.sh --no-browser
bash scripts/build.sh

tokens=data/tokens
if [ -f "$tokens/train.bin" ] && [ -f "$tokens/val.bin" ] &&
   [ -z "$(find data/raw -name '*.txt' -newer "$tokens/train.bin" -print -quit)" ]; then
  echo "demo: $tokens is up to date"
else
  ./build/troupe data prepare --input data/raw --out "$tokens"
fi

./build/troupe launch --master_port "${TROUPE_DEMO_PORT:-29500}" configs/tiny.toml "$@"

echo
echo "demo: a sample from the trained model (troupe generate runs/tiny ...):"
./build/troupe generate runs/tiny --prompt "Call me Ishmael. Some years ago" --max-new-tokens 50 \
  --temperature 0.8 --top-k 40 --seed 1
