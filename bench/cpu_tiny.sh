#!/usr/bin/env bash
# The CPU backend against PyTorch on configs/tiny.toml (the README demo's model and global batch:
# 32 sequences of 64 tokens per step), every run pinned to the same cores with taskset, in one go:
#   - `troupe launch` as shipped (4 worker processes, recording on) and with runtime.record=false,
#   - `troupe train` (the actors in one process), recording on and off,
#   - `troupe train --single-rank`,
#   - bench/torch_cpu_tiny.py (PyTorch, same model, batch 32 x 64, as many threads as cores).
# Each troupe run is measured by bench/train_bench.py from its own metrics.jsonl (median step
# after the first two); the runs alternate, REPS rounds, and the table shows each one's median.
# Recording's cost is the on/off ratio of the median step times of the same mode.
#
#   bash bench/cpu_tiny.sh [--troupe build/troupe] [--cores 0,1] [--steps 12] [--reps 3]
#                          [--torch-seconds 120] [--no-torch] [--data DIR] [--out DIR]
#   bash bench/cpu_tiny.sh --troupe build-gpu/bin/troupe ...   # from a bench/gpu/pack.sh package
#
# Needs python3 (PyTorch only for the baseline). Token shards: DIR/train.bin and DIR/val.bin
# (default data/tokens from `troupe data prepare`, else random tokens written to the output folder;
# the speed does not depend on the text). Results: OUT/cpu_tiny.jsonl (one JSON line per run) and
# the table on stdout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

troupe=build/troupe cores=0,1 steps=12 reps=3 torch_seconds=120 torch=1 data="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --troupe) troupe=$2; shift 2 ;;
    --cores) cores=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --torch-seconds) torch_seconds=$2; shift 2 ;;
    --no-torch) torch=0; shift ;;
    --data) data=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "cpu_tiny.sh: unknown argument $1 (see the header of bench/cpu_tiny.sh)" >&2; exit 2 ;;
  esac
done
[ -x "$troupe" ] || { echo "cpu_tiny.sh: no troupe executable at $troupe (--troupe PATH)" >&2; exit 2; }
# A package of bench/gpu/pack.sh keeps its shared libraries beside bin/: put them on the loader path.
libdir="$(cd "$(dirname "$troupe")/.." && pwd)/lib"
[ -d "$libdir" ] && export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${out:-$(mktemp -d /tmp/troupe_cpu_tiny.XXXXXX)}
mkdir -p "$out"
results=$out/cpu_tiny.jsonl
: > "$results"
ncores=$(taskset -c "$cores" nproc)

if [ -z "$data" ]; then
  if [ -f data/tokens/train.bin ] && [ -f data/tokens/val.bin ]; then
    data=data/tokens
  else
    data=$out/tokens
    python3 bench/train_bench.py data "$data" --tokens 2000000 --vocab 50257 >/dev/null
  fi
fi

echo "cpu_tiny: $(date -u '+%Y-%m-%d %H:%M UTC'), cores $cores ($ncores), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "cpu_tiny: troupe $troupe, commit $(git rev-parse --short HEAD 2>/dev/null || echo "?")"
echo "cpu_tiny: OpenBLAS kernels: $(OPENBLAS_VERBOSE=2 taskset -c "$cores" "$troupe" --help 2>&1 | grep '^Core:' | tr '\n' ' ')"

extra=()
[ -d data/gpt2 ] || extra=(--set 'data.tokenizer_dir=""')
run() {  # label mode [--set k=v]...
  local label=$1 mode=$2
  shift 2
  taskset -c "$cores" python3 bench/train_bench.py run --troupe "$troupe" configs/tiny.toml \
    --mode "$mode" --steps "$steps" --skip 2 --label "$label" --out "$results" \
    --set "data.train=$data/train.bin" --set "data.val=$data/val.bin" "${extra[@]}" "$@" >/dev/null
}

for r in $(seq 1 "$reps"); do
  echo "== round $r of $reps"
  run "launch" launch
  run "launch, record off" launch --set runtime.record=false
  run "train" train
  run "train, record off" train --set runtime.record=false
  run "train --single-rank" single-rank
done

if [ "$torch" = 1 ]; then
  echo "== PyTorch on $ncores threads, ${torch_seconds}s"
  taskset -c "$cores" python3 bench/torch_cpu_tiny.py "$data/train.bin" "$torch_seconds" 4 128 4 64 32 0.003 \
    --threads "$ncores" | tee "$out/torch.log" | tail -1 >> "$results"
fi

python3 - "$results" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault(r["label"], []).append(r)
med = {k: statistics.median(x["step_ms"] for x in v) for k, v in by.items()}
tok_med = {k: statistics.median(x["tok_s"] for x in v) for k, v in by.items()}
base = tok_med.get("pytorch")
print()
print("| run | runs | step (median, ms) | tokens/s (median) | / PyTorch (tokens/s) |")
print("|---|---:|---:|---:|---:|")
for k, v in by.items():
    tok = tok_med[k]
    ratio = "%.2f" % (tok / base) if base else "-"
    print("| %s | %d | %.1f | %.0f | %s |" % (k, len(v), med[k], tok, ratio))
for mode in ("launch", "train"):
    on, off = med.get(mode), med.get(mode + ", record off")
    if on and off:
        print("recording on %s: %+.1f%% of the step (%.1f against %.1f ms)" % (mode, 100 * (on / off - 1), on, off))
EOF
echo "cpu_tiny: results in $results"
