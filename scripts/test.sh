#!/usr/bin/env bash
# The test command: setup (packages + data), build, every doctest suite through ctest, then the
# sanitizer and fuzzing pass (scripts/fuzz.sh: clang, AddressSanitizer + UBSan; TROUPE_FUZZ_SECONDS
# per fuzz target, default 10), and the ThreadSanitizer pass (scripts/sanitize.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
cd "$root"
bash "$root/scripts/fuzz.sh" "${TROUPE_FUZZ_SECONDS:-10}"
bash "$root/scripts/sanitize.sh"
