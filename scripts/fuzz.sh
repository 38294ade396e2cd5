#!/usr/bin/env bash
# Fuzzing and sanitizers: builds troupe with clang, AddressSanitizer and UBSan in build-fuzz/, runs
# the CPU test suites that need no model training under them (test_core, test_schedules,
# test_kernels), then each libFuzzer target of fuzz/ for SECONDS seconds from a seed corpus made
# of the repository's own examples. Prints the executions of each target and fails on the first
# crash, leak, undefined behaviour or test failure; a crashing input is kept in
# build-fuzz/crashes/ (replay it with build-fuzz/fuzz/fuzz_TARGET FILE).
# Usage: bash scripts/fuzz.sh [SECONDS]    (default 20; scripts/test.sh runs it when clang exists)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-20}
build=build-fuzz
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ not found (scripts/setup.sh installs clang and libclang-rt-14-dev)" >&2
  exit 2
fi
mkdir -p $build
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B $build -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTROUPE_CUDA=OFF -DTROUPE_FUZZ=ON -DTROUPE_SANITIZE=address,undefined "${launcher[@]}" \
  > "$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
targets=(config schedule instruct safetensors tokenizer_json shard)
suites=(core schedules kernels)
cmake --build $build -j"$(nproc)" --target "${targets[@]/#/fuzz_}" "${suites[@]/#/test_}"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for s in "${suites[@]}"; do
  log=$build/test_$s.log
  if ! (cd $build && "tests/test_$s") > "$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz: test_$s failed under AddressSanitizer/UBSan (log: $log)" >&2
    exit 1
  fi
  echo "sanitizers: test_$s: $(grep -E 'test cases:' "$log" | tail -1 | sed 's/\[doctest\] //')"
done

# Seeds: the repository's configs and schedule files, and small valid files of each other kind.
seeds=$build/seeds
rm -rf "$seeds" && mkdir -p "$seeds"/{config,schedule,instruct,safetensors,tokenizer_json,shard}
cp configs/*.toml "$seeds/config/"
for f in configs/schedules/* examples/custom_schedule/*.txt; do
  case $f in *.csv) flag='\x01' ;; *) flag='\x00' ;; esac
  { printf "$flag"; cat "$f"; } > "$seeds/schedule/$(basename "$f")"
done
python3 - "$seeds" <<'PY'
import json, struct, sys
d = sys.argv[1]
lines = ['{"prompt": "Say hi.", "response": "Hi!"}',
         '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},'
         ' {"role": "assistant", "content": "4"}]}']
for i, l in enumerate(lines):
    open(f"{d}/instruct/{i}.jsonl", "w").write(l)
def safetensors(tensors):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data
open(f"{d}/safetensors/two.safetensors", "wb").write(safetensors([
    ("w", "F32", [2, 3], struct.pack("<6f", *range(6))), ("b", "BF16", [2], b"\x80\x3f\x00\x40")]))
# A byte-level BPE tokenizer: GPT-2's byte alphabet, two merges and one added token.
vocab, extra = {}, 0
for b in range(256):
    printable = 33 <= b <= 126 or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
    vocab[chr(b) if printable else chr(256 + extra)] = b
    extra += not printable
vocab.update({"ab": 256, "abc": 257})
tok = {"added_tokens": [{"id": 258, "content": "<|endoftext|>", "special": True, "single_word": False,
                         "lstrip": False, "rstrip": False, "normalized": False}],
       "normalizer": None, "post_processor": None,
       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
       "decoder": {"type": "ByteLevel"},
       "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]}}
open(f"{d}/tokenizer_json/small.json", "w").write(json.dumps(tok))
for magic, version, fmt in ((20240520, 1, "H"), (20240801, 7, "I")):
    header = struct.pack("<256i", magic, version, 8, *([0] * 253))
    open(f"{d}/shard/{magic}.bin", "wb").write(header + struct.pack("<8" + fmt, *range(8)))
PY

mkdir -p $build/crashes
for t in "${targets[@]}"; do
  corpus=$build/corpus/$t
  mkdir -p "$corpus"
  log=$build/fuzz_$t.log
  if ! "$build/fuzz/fuzz_$t" -max_total_time="$secs" -seed=1 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$build/crashes/$t-" "$corpus" "$seeds/$t" > "$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: fuzz_$t failed; the input is in $build/crashes/" >&2
    exit 1
  fi
  runs=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' || echo "?")
  echo "fuzz: fuzz_$t: $runs executions in $secs s, corpus $(ls "$corpus" | wc -l) inputs, no failure"
done
