#!/usr/bin/env bash
# Recording's cost on the CPU in CPU time: `troupe train CONFIG` (the actors in one process) with
# runtime.record on and off, CPU seconds per step = (user + system time of an N-step run - that of a
# 2-step run) / (N - 2), N = 8 unless --steps says, so start-up, the final checkpoint and the first
# steps cancel out. The runs alternate (each troupe given, recording on, then off) for ROUNDS
# rounds; the table shows every round and the medians. CPU time rather than wall time: on a loaded
# machine the wall clock measures the load. With two executables (--troupe A --troupe B) one run
# compares builds.
#
#   bash bench/record_cost_cpu.sh [--troupe build/troupe]... [--config configs/tiny.toml]
#                                 [--rounds 3] [--steps 8] [--out DIR]
#
# The config's token shards must exist (configs/tiny.toml: `troupe data prepare --input data/raw
# --out data/tokens`, as scripts/demo.sh does). Results: OUT/record_cost_cpu.jsonl (one JSON line
# per run) and the table on stdout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

troupes=() config=configs/tiny.toml rounds=3 steps=8 out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --troupe) troupes+=("$2"); shift 2 ;;
    --config) config=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "record_cost_cpu.sh: unknown argument $1 (see the header of bench/record_cost_cpu.sh)" >&2; exit 2 ;;
  esac
done
[ ${#troupes[@]} -gt 0 ] || troupes=(build/troupe)
for t in "${troupes[@]}"; do
  [ -x "$t" ] || { echo "record_cost_cpu.sh: no troupe executable at $t (--troupe PATH)" >&2; exit 2; }
done
[ "$steps" -gt 2 ] 2>/dev/null || { echo "record_cost_cpu.sh: --steps must be more than 2" >&2; exit 2; }
[ -f "$config" ] || { echo "record_cost_cpu.sh: no config $config (--config FILE)" >&2; exit 2; }
[ -n "$out" ] || out="$(mktemp -d "${TMPDIR:-/tmp}/record_cost_cpu.XXXXXX")"
mkdir -p "$out"
results="$out/record_cost_cpu.jsonl"
: >"$results"

# CPU seconds (user + system) of one `troupe train` run of $3 steps, recording $2.
cpu_of() {
  local troupe=$1 record=$2 steps=$3 run="$out/run"
  rm -rf "$run"
  if ! /usr/bin/time -f "%U %S" -o "$out/time.txt" "$troupe" train "$config" --steps "$steps" \
       --no-plan-check --set runtime.record="$record" --set runtime.run_dir="$run" \
       >"$out/train.log" 2>&1; then
    echo "record_cost_cpu.sh: $troupe train failed (record=$record, $steps steps):" >&2
    tail -5 "$out/train.log" >&2
    exit 1
  fi
  rm -rf "$run"
  awk '{ printf "%.3f", $1 + $2 }' "$out/time.txt"
}

for ((r = 1; r <= rounds; r++)); do
  for t in "${troupes[@]}"; do
    for record in true false; do
      long=$(cpu_of "$t" "$record" "$steps") || exit 1
      short=$(cpu_of "$t" "$record" 2) || exit 1
      per=$(awk -v a="$long" -v b="$short" -v n="$steps" 'BEGIN { printf "%.4f", (a - b) / (n - 2) }')
      printf '{"round":%d,"troupe":"%s","record":%s,"steps":%d,"cpu_long":%s,"cpu_2":%s,"cpu_per_step":%s}\n' \
        "$r" "$t" "$record" "$steps" "$long" "$short" "$per" | tee -a "$results"
    done
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = []
for r in rows:
    k = (r["troupe"], r["record"])
    if k not in keys: keys.append(k)
print()
print("| troupe | recording | CPU s per step (rounds) | median |")
print("|---|---|---|---:|")
med = {}
for k in keys:
    v = [r["cpu_per_step"] for r in rows if (r["troupe"], r["record"]) == k]
    med[k] = statistics.median(v)
    print(f"| {k[0]} | {'on' if k[1] else 'off'} | {', '.join(f'{x:.3f}' for x in v)} | {med[k]:.3f} |")
for t in dict.fromkeys(k[0] for k in keys):
    on, off = med.get((t, True)), med.get((t, False))
    if on and off:
        per_round = []
        for r in sorted({x["round"] for x in rows}):
            a = [x["cpu_per_step"] for x in rows if (x["troupe"], x["record"], x["round"]) == (t, True, r)]
            b = [x["cpu_per_step"] for x in rows if (x["troupe"], x["record"], x["round"]) == (t, False, r)]
            if a and b: per_round.append(100 * (a[0] - b[0]) / b[0])
        print(f"{t}: recording costs {100 * (on - off) / off:+.1f} % of the CPU time per step "
              f"(medians); round by round {', '.join(f'{x:+.1f}' for x in per_round)} %")
PY
