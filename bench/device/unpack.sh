# Sourced by the device scripts (not run on its own): unpacks pkg.tar.gz from the script's folder
# into $B, puts its libraries on the loader path, and makes the results folder $O ($OUT when the
# device tool runs it). Sets S (the scripts' folder), B, O, and R (the directory it was called from).
S=$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
R=$(pwd)
# The CLI tests look for troupe in the build folder they were built in.
for d in build build-cuda; do mkdir -p /work/main/$d 2>/dev/null && cp $B/troupe /work/main/$d/troupe 2>/dev/null; done
# Every CUDA test case of the test programs named, a summary line each in $O/tests.log and failures
# printed.
cuda_tests() {
  for t in "$@"; do
    echo "== $t" | tee -a $O/tests.log
    timeout 200 $B/$t -tc='cuda*,gemm*' > $O/$t.log 2>&1; tail -n 3 $O/$t.log | tee -a $O/tests.log
    grep -B3 -A14 "ERROR\|FAILED" $O/$t.log | head -40
  done
}
