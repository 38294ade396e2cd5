# Sourced by scripts/fuzz.sh and scripts/sanitize.sh: configures a clang build of troupe (CPU only)
# in a folder of its own.
#   clang_configure NAME BUILD_DIR CMAKE_ARGS...
# NAME prefixes the messages; BUILD_DIR/configure.log keeps cmake's output, shown on failure.
# Exits 2 when clang++ is missing (scripts/setup.sh installs it), 1 when cmake fails.
clang_configure() {
  local name=$1 dir=$2
  shift 2
  if ! command -v clang++ >/dev/null; then
    echo "$name: clang++ not found (scripts/setup.sh installs clang and libclang-rt-14-dev)" >&2
    exit 2
  fi
  mkdir -p "$dir"
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTROUPE_CUDA=OFF "$@" "${launcher[@]}" > "$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log"; exit 1; }
}
