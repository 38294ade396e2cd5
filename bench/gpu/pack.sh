#!/usr/bin/env bash
# Stage a CUDA build of troupe for a GPU machine as build-gpu/package.tar.xz (git ignores every
# build*/ folder), which bench/gpu/common.sh unpacks there on first use:
#   bin/   troupe, the GPU benchmarks, every test program and the schedule plugins the tests load
#   lib/   the shared libraries those programs use that a GPU machine may lack (CAF, toml++, fmt,
#          PCRE2, xxHash, OpenBLAS and its Fortran runtime)
#   manifest.txt  the commit (and whether the tree had changes) and the build folder
# (xz, because every program carries its own copy of the CUDA kernels, which compress well: five
# programs take 34 MB, where gzip took 61). Then copy the repository, build-gpu/ included, to the
# GPU machine and run bench/gpu/tests.sh and bench/gpu/bench.sh there from the repository root
# (bench/README.md).
# Usage, from the repository root: bash bench/gpu/pack.sh [BUILD_DIR [PROGRAM...]]
#   (default build-cuda; with PROGRAMs, e.g. `gpu_gpt2_bench test_kernels`, only troupe and those
#   are packed: every test program together makes the package several times larger)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build=${1:-build-cuda}
shift || true
only=("$@")
pkg=build-gpu
if [[ ! -x $build/troupe ]]; then
  echo "pack: $build/troupe not found; build first, e.g." >&2
  echo "  cmake -S . -B $build -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build $build -j" >&2
  exit 2
fi
if [[ ! -x $build/bench/gpu_gpt2_bench ]]; then
  echo "pack: warning: $build has no bench/gpu_gpt2_bench: not a CUDA build, so the CUDA test" \
       "cases will skip and bench.sh has nothing to run" >&2
fi
rm -rf "$pkg"
stage=$pkg/stage
mkdir -p "$stage/bin" "$stage/lib"
programs=("$build/troupe")
for f in "$build"/bench/gpu_*_bench "$build"/tests/test_* "$build"/tests/*.so; do
  [[ -f $f && ( -x $f || $f == *.so ) ]] || continue
  if [[ ${#only[@]} -gt 0 ]]; then
    name=$(basename "$f")
    [[ " ${only[*]} " == *" ${name%.so} "* || $f == *.so ]] || continue
  fi
  programs+=("$f")
done
cp "${programs[@]}" "$stage/bin/"
# The libraries the programs resolve here that are not part of a base system with the CUDA driver.
ldd "${programs[@]}" 2>/dev/null | awk '/=> \// {print $3}' |
  grep -E 'libcaf_|libtomlplusplus|libfmt|libpcre2|libxxhash|libopenblas|libblas|liblapack|libgfortran|libquadmath' |
  sort -u | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
# Debug information and symbol tables are much of a binary's size; the GPU machine needs neither.
strip "$stage"/bin/* "$stage"/lib/* 2>/dev/null || true
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built in $build, packed $(date -u +%Y-%m-%d)"
} > "$stage/manifest.txt"
tar cf - -C "$stage" bin lib manifest.txt | xz -T0 -6 > "$pkg/package.tar.xz"
cp "$stage/manifest.txt" "$pkg/manifest.txt"
echo "pack: $(ls "$stage/bin" | wc -l) programs, $(ls "$stage/lib" | wc -l) libraries:" \
     "$pkg/package.tar.xz, $(du -h "$pkg/package.tar.xz" | cut -f1)"
rm -rf "$stage"
