#!/usr/bin/env bash
# The test command: setup (packages + data), build, every doctest suite through ctest, then the
# sanitizer and fuzzing pass (scripts/fuzz.sh: clang, AddressSanitizer + UBSan; TROUPE_FUZZ_SECONDS
# per fuzz target, default 10), and the ThreadSanitizer pass (scripts/sanitize.sh).
# The CUDA backend is built here only where a GPU is visible (`nvidia-smi -L`): without one its
# test cases skip, and on 2 cores the build takes 13 minutes with CUDA and 9 without.
# TROUPE_TEST_CUDA=1 builds it anyway; scripts/build.sh builds it wherever nvcc is found.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cuda=(-DTROUPE_CUDA=ON)
if [[ ${TROUPE_TEST_CUDA:-} != 1 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test: no GPU visible (nvidia-smi -L): building the CPU backend only, whose tests are all" \
       "that can run here (TROUPE_TEST_CUDA=1 builds the CUDA backend too)"
  cuda=(-DTROUPE_CUDA=OFF)
fi
bash "$root/scripts/build.sh" "${cuda[@]}"
cd "$root/build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
cd "$root"
bash "$root/scripts/fuzz.sh" "${TROUPE_FUZZ_SECONDS:-10}"
bash "$root/scripts/sanitize.sh"
