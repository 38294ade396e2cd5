#!/bin/bash
# Stages a CUDA build for the device machine: binaries, test executables and plugins, and the
# shared libraries the GPU machine lacks, as build-dev/pkg.tar.gz, with the device scripts and the
# PyTorch baseline next to it (README.md). Usage: bash bench/device/pack.sh [build dir, build-cuda]
set -euo pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$R/build-cuda}
DEV=$R/build-dev
ST=$(mktemp -d)
trap 'rm -rf "$ST"' EXIT
cp "$BUILD/troupe" "$BUILD"/kernels/gpu_*_bench "$BUILD"/bench/gpu_pipeline_bench "$BUILD"/tests/test_* "$BUILD"/tests/*.so "$ST/"
for lib in $(ldd "$BUILD/troupe" "$BUILD/tests/test_kernels" "$BUILD/tests/test_runtime" | awk '/=>/ {print $3}' |
             grep -E 'libcaf|libtoml|libfmt|libpcre2|libxxhash|libopenblas|libgfortran|libquadmath' | sort -u); do
  cp -L "$lib" "$ST/"
done
mkdir -p "$DEV"
tar czf "$DEV/pkg.tar.gz" -C "$ST" .
cp "$R"/bench/device/*.sh "$R"/bench/device/*.py "$R/../shared/bench/torch_gpt2.py" "$DEV/"
du -sh "$DEV/pkg.tar.gz"
