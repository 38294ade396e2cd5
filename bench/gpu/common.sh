# Sourced by bench/gpu/tests.sh and bench/gpu/bench.sh (not run on its own). From the repository
# root, with the package bench/gpu/pack.sh staged:
#   PKG      the package folder (default build-gpu): package.tar.xz, unpacked there on first use
#            into bin/ (programs), lib/ (shared libraries the GPU machine may lack) and
#            manifest.txt (the commit and build it came from)
#   RESULTS  where logs and JSON go (default $PKG/results)
#   WORK     scratch space for runs (default $PKG/work, emptied first)
# and puts lib/ on the loader path. Every path is relative to the repository root.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PKG=${PKG:-build-gpu}
BIN=$PKG/bin
RESULTS=${RESULTS:-$PKG/results}
WORK=${WORK:-$PKG/work}
if [[ -f $PKG/package.tar.xz && ( ! -x $BIN/troupe || $PKG/package.tar.xz -nt $BIN/troupe ) ]]; then
  rm -rf "$PKG/bin" "$PKG/lib" && tar xJf "$PKG/package.tar.xz" -C "$PKG"
fi
if [[ ! -x $BIN/troupe ]]; then
  echo "bench/gpu: no package at $PKG (expected $PKG/package.tar.xz); run bash bench/gpu/pack.sh on the" \
       "machine that built troupe with CUDA, then copy the repository with $PKG here" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$PWD/$PKG/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
rm -rf "$WORK" && mkdir -p "$WORK"

# The GPU, driver and package, at the top of every summary.
describe_machine() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,power.limit,clocks.max.sm \
      --format=csv,noheader
  else
    echo "no nvidia-smi on this machine"
  fi
  cat "$PKG/manifest.txt"
  if ldd "$BIN/troupe" | grep -q 'not found'; then
    echo "missing libraries:"; ldd "$BIN/troupe" | grep 'not found'
  fi
}

# synthetic_shards DIR: token shards in troupe's format (a 256-int32 header, then uint16 tokens)
# for the launch checks: train64/val64 over a 64-token vocabulary (a repeating pattern with noise,
# so the loss falls) and train/val over GPT-2's 50257.
synthetic_shards() {
  python3 - "$1" <<'PY'
import random, struct, sys
def shard(path, n, seed, vocab):
    rnd = random.Random(seed)
    tokens = [rnd.randrange(vocab) if rnd.random() < 0.25 else (i % 8) * 5 for i in range(n)]
    header = [20240520, 1, n] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header) + struct.pack("<%dH" % n, *tokens))
folder = sys.argv[1]
shard(folder + "/train.bin", 40000, 1, 50257); shard(folder + "/val.bin", 8000, 2, 50257)
shard(folder + "/train64.bin", 40000, 1, 64); shard(folder + "/val64.bin", 8000, 2, 64)
PY
}
