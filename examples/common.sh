# Shared by the examples' run.sh scripts (sourced, not run): options, token shards, model sizes,
# bounded runs of troupe, and the bit-for-bit comparison of two runs. It changes to the repository
# root: config paths (data/..., configs/...) are relative to it.
#
# Options every run.sh takes:
#   --small        the reduced form ctest runs: examples/small.toml (configs/tiny.toml's layout
#                  with 2 layers of width 64 and 32-token sequences), 3 steps, on shards cut from
#                  the first 300 kB of Moby-Dick (seconds instead of minutes)
#   --steps N      optimizer steps (default 10, or as the example says; 3 with --small)
#   --build DIR    where troupe was built (default build/)
#   --work DIR     where the runs go (default runs/examples/<example>): a new or empty folder, or
#                  one an example made before, which is emptied first
#   -h, --help
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

example_name="$(basename "$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)")"
small=0
steps=""
build="$root/build"
work=""
extra_args=()  # options a run.sh handles itself

usage() {
  sed -n '/^# Usage/,/^[^#]/p' "${BASH_SOURCE[2]}" | sed '$d; s/^# \{0,1\}//'
  sed -n '/^# Options every/,/^#   -h/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

parse_options() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --small) small=1 ;;
      --steps) steps="$2"; shift ;;
      --build) build="$(cd "$2" && pwd)"; shift ;;
      --work) work="$2"; shift ;;
      -h|--help) usage; exit 0 ;;
      *) extra_args+=("$1") ;;
    esac
    shift
  done
  [ -n "$steps" ] || steps=$([ "$small" = 1 ] && echo 3 || echo "${default_steps:-10}")
  [ -n "$work" ] || work="runs/examples/$example_name"
  case "$work" in /*) ;; *) work="$root/$work" ;; esac
  troupe="$build/troupe"
  [ -x "$troupe" ] || die "$troupe does not exist" "build first: bash scripts/build.sh (or pass --build DIR)"
  # Every troupe command gets a time limit, so an example never hangs (ctest's is the outer one).
  limit=$([ "$small" = 1 ] && echo 100 || echo 3600)
  # Only a folder an example made (it holds the marker) is emptied.
  if [ -d "$work" ] && [ -n "$(ls -A "$work")" ] && [ ! -f "$work/.troupe-example" ]; then
    die "--work $work is not empty and was not made by an example" "pick a new or empty folder"
  fi
  rm -rf "$work"
  mkdir -p "$work"
  touch "$work/.troupe-example"
}

die() {
  echo "$example_name: error: $1" >&2
  [ $# -lt 2 ] || echo "  hint: $2" >&2
  exit 1
}

# Prints a command as a person would type it (paths shortened).
show() {
  local shown="$*"
  shown="${shown//$build\/troupe/troupe}"
  echo "\$ ${shown//$root\//}"
}

# Runs a command under the time limit.
bounded() { timeout --kill-after=10 "$limit" "$@"; }

# Both.
run() {
  show "$@"
  bounded "$@"
}

# The config of the chosen size in `config`, and in the array `sets` the --set options naming the
# token shards and the steps.
prepare() {
  local tokens
  if [ "$small" = 1 ]; then
    local text=data/raw/moby-dick/data/data.txt
    [ -f "$text" ] || die "$text is missing" "run bash scripts/setup.sh (it fetches the corpus)"
    tokens="$work/tokens"
    mkdir -p "$tokens/text"
    head -c 300000 "$text" > "$tokens/text/moby_dick_head.txt"
    timeout 100 "$troupe" data prepare --input "$tokens/text" --out "$tokens" --val-fraction 0.1 \
      > "$tokens/prepare.log" 2>&1 || { cat "$tokens/prepare.log" >&2; die "troupe data prepare failed"; }
    config=examples/small.toml
  else
    tokens=data/tokens
    if [ ! -f "$tokens/train.bin" ] || [ ! -f "$tokens/val.bin" ]; then
      [ -d data/raw ] || die "data/raw is missing" "run bash scripts/setup.sh (it fetches the corpus)"
      "$troupe" data prepare --input data/raw --out "$tokens"
    fi
    config=configs/tiny.toml
  fi
  sets=(--set "data.train=$tokens/train.bin" --set "data.val=$tokens/val.bin"
         --set "train.steps=$steps")
}

# A TCP port on this machine that no socket uses now (scripts/free_port.sh).
free_port() {
  bash "$root/scripts/free_port.sh" || die "no free port found on 127.0.0.1"
}

# "step loss" per line of a run's metrics.jsonl.
losses() {
  sed -n 's/.*"step":\([0-9]*\).*"loss":\([^,}]*\).*/\1 \2/p' "$1/metrics.jsonl"
}

last_checkpoint() {
  find "$1/checkpoints" -maxdepth 1 -name 'step_*' -type d | sort | tail -n 1
}

# same_result RUN_A RUN_B: the per-step losses and every byte of the final checkpoint's
# safetensors files (parameters and AdamW moments) are equal. Prints what it compared.
same_result() {
  local a="$1" b="$2" la lb ca cb files=0 bytes=0
  la="$(losses "$a")"; lb="$(losses "$b")"
  [ -n "$la" ] || die "$a/metrics.jsonl holds no losses"
  if [ "$la" != "$lb" ]; then
    echo "DIFFERENT: the losses of ${a#$root/} and ${b#$root/} differ (step loss):" >&2
    diff <(echo "$la") <(echo "$lb") >&2 || true
    return 1
  fi
  ca="$(last_checkpoint "$a")"; cb="$(last_checkpoint "$b")"
  [ -n "$ca" ] && [ -d "$cb" ] || die "no final checkpoint in $a or $b"
  if [ "$(basename "$ca")" != "$(basename "$cb")" ]; then
    echo "DIFFERENT: final checkpoints $(basename "$ca") and $(basename "$cb")" >&2
    return 1
  fi
  for f in "$ca"/*.safetensors; do
    if ! cmp -s "$f" "$cb/$(basename "$f")"; then
      echo "DIFFERENT: ${f#$root/} and ${cb#$root/}/$(basename "$f") differ" >&2
      return 1
    fi
    files=$((files + 1)); bytes=$((bytes + $(stat -c %s "$f")))
  done
  [ "$files" -gt 0 ] || die "$ca holds no safetensors files"
  echo "bit-identical: ${a#$root/} and ${b#$root/}: the losses of $(echo "$la" | wc -l) steps" \
       "(last: $(echo "$la" | tail -n 1 | cut -d' ' -f2)) and $files checkpoint files of" \
       "$(basename "$ca") ($bytes bytes)"
}
