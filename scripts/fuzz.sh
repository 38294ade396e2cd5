#!/usr/bin/env bash
# Fuzzing and sanitizers: builds troupe with clang, AddressSanitizer and UBSan in build-fuzz/, runs
# the CPU test suites under them (test_core, test_schedules, test_kernels, test_transport,
# test_actors, test_report; docs/testing.md), replays the inputs that once crashed a fuzz target (fuzz/regressions/<target>/),
# then runs each libFuzzer target of fuzz/ for SECONDS seconds from its committed seed corpus
# (fuzz/seeds/<target>/, written by fuzz/make_seeds.py; new inputs go to build-fuzz/corpus/).
# Prints the executions of each target and fails on the first crash, leak, undefined behaviour or
# test failure; a crashing input is kept in build-fuzz/crashes/ (replay it with
# build-fuzz/fuzz/fuzz_TARGET FILE). docs/fuzzing.md lists the targets.
# Usage: bash scripts/fuzz.sh [SECONDS]    (default 20; scripts/test.sh runs it when clang exists)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-20}
build=build-fuzz
source scripts/clang_build.sh
clang_configure fuzz $build -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only -DNDEBUG" \
  -DTROUPE_FUZZ=ON -DTROUPE_SANITIZE=address,undefined
targets=(config schedule instruct safetensors tokenizer_json shard checkpoint tcp_frame rendezvous tokenizer)
suites=(core schedules kernels transport actors report)
# Whole suites only: the chosen cases of test_plan, test_replay, test_runtime and test_model that
# also ran here made the test command pass 45 minutes on a 2-core machine (docs/testing.md).
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

# Inputs that once crashed a target (fuzz/regressions/<target>/), each run once before fuzzing.
for t in "${targets[@]}"; do
  [[ -d fuzz/regressions/$t ]] || continue
  mapfile -t inputs < <(find "fuzz/regressions/$t" -type f | sort)
  [[ ${#inputs[@]} -gt 0 ]] || continue
  log=$build/regressions_$t.log
  if ! "$build/fuzz/fuzz_$t" "${inputs[@]}" > "$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: fuzz_$t fails on a regression input of fuzz/regressions/$t/" >&2
    exit 1
  fi
  echo "fuzz: fuzz_$t: ${#inputs[@]} regression inputs pass"
done

mkdir -p $build/crashes
for t in "${targets[@]}"; do
  # New inputs go to the first folder, a scratch one; the committed seeds are only read.
  corpus=$build/corpus/$t
  mkdir -p "$corpus"
  log=$build/fuzz_$t.log
  if ! "$build/fuzz/fuzz_$t" -max_total_time="$secs" -seed=1 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$build/crashes/$t-" "$corpus" "fuzz/seeds/$t" > "$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: fuzz_$t failed; the input is in $build/crashes/" >&2
    exit 1
  fi
  runs=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' || echo "?")
  echo "fuzz: fuzz_$t: $runs executions in $secs s, corpus $(ls "$corpus" | wc -l) inputs, no failure"
done
