#!/bin/bash
# Stages what bench/device/product_bench.sh needs into one folder for the device tool's `carry`:
# pkg.tar.gz (troupe, test_kernels, gpu_gpt2_bench of a CUDA build and the shared libraries the
# GPU machine lacks), the bench scripts, the PyTorch baseline and the configs.
# Usage: bash bench/device/product_pack.sh BUILD_DIR OUT_DIR   (OUT_DIR ignored by git)
set -euo pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "$1" && pwd)
DEV=$2
ST=$(mktemp -d)
trap 'rm -rf "$ST"' EXIT
# The message-hash GPU test: test_kernels, or a test_message_hash built from its one file.
TEST=${TEST:-$BUILD/tests/test_kernels}
cp "$BUILD/troupe" "$TEST" "$BUILD/bench/gpu_gpt2_bench" "$ST/"
# The actor runtime's GPU tests, when built.
[ -x "$BUILD/tests/test_runtime" ] && cp "$BUILD/tests/test_runtime" "$ST/"
for lib in $(ldd "$BUILD/troupe" "$TEST" | awk '/=>/ {print $3}' |
             grep -E 'libcaf|libtoml|libfmt|libpcre2|libxxhash|libopenblas|libgfortran|libquadmath' | sort -u); do
  cp -L "$lib" "$ST/"
done
mkdir -p "$DEV"
tar czf "$DEV/pkg.tar.gz" -C "$ST" .
cp "$R/bench/device/product_bench.sh" "$R/bench/train_bench.py" "$R/bench/torch_gpt2.py" \
   "$R/bench/configs/gpt2_124m_1gpu.toml" "$R/configs/tiny.toml" "$DEV/"
du -sh "$DEV"
