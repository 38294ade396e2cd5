#!/usr/bin/env bash
# ThreadSanitizer pass: builds troupe with clang and -fsanitize=thread in build-tsan/ and runs the
# suites whose code runs on several threads: test_transport (tcp's IO thread, the local hub,
# rendezvous), test_actors, and the cases of test_runtime listed below, which train through real
# CAF actors on the scheduler's threads and move tensors over the local transport. CAF is
# Debian's uninstrumented build: scripts/tsan.supp suppresses the reports that lie inside it,
# each with its reason; a race in troupe's own code fails the pass. Prints each suite's count.
# Usage: bash scripts/sanitize.sh    (scripts/test.sh runs it after scripts/fuzz.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=build-tsan
source scripts/clang_build.sh
clang_configure sanitize $build -DTROUPE_SANITIZE=thread
cmake --build $build -j"$(nproc)" --target test_transport test_actors test_runtime

# suite and doctest filter ("" for every case)
runs=(
  "transport|"
  "actors|"
  "runtime|-tc=pipeline_stage 1*,data_parallel 1*,a failing stage*"
)
export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp:halt_on_error=1:second_deadlock_stack=1:history_size=4"
for r in "${runs[@]}"; do
  s=${r%%|*} filter=${r#*|}
  log=$build/test_$s.log
  args=()
  [[ -n $filter ]] && args=("$filter")
  if ! (cd $build && "tests/test_$s" "${args[@]}") > "$log" 2>&1; then
    grep -n -A40 'WARNING: ThreadSanitizer' "$log" | head -80 || tail -60 "$log"
    echo "sanitize: test_$s failed under ThreadSanitizer (log: $log)" >&2
    exit 1
  fi
  echo "tsan: test_$s: $(grep -E 'test cases:' "$log" | tail -1 | sed 's/\[doctest\] //')"
done
