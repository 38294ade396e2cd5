#!/bin/bash
# Final device call of the session: every CUDA test of the committed tree, then the launch check.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
O=${OUT:-/tmp/out}; mkdir -p $O
cd /tmp
timeout 200 $B/test_kernels -tc='cuda*' 2>&1 | tail -4 | tee $O/kernels.log
timeout 120 $B/test_model -tc='cuda*' 2>&1 | tail -4 | tee $O/model.log
timeout 200 $B/test_runtime -tc='cuda*' 2>&1 | tail -4 | tee $O/actors.log
# test_cli's GPU case runs TROUPE_BINARY_DIR/troupe (this build's path on the build machine).
if mkdir -p /work/main/build-cuda 2>/dev/null && cp $B/troupe /work/main/build-cuda/troupe 2>/dev/null; then
  timeout 120 $B/test_cli -tc='gpu*' 2>&1 | tail -4 | tee $O/cli.log
else
  echo "cannot place troupe at /work/main/build-cuda: test_cli gpu case not run" | tee $O/cli.log
fi
bash $S/launch_gpu.sh > /dev/null 2>&1; cat ${OUT:-/tmp/out}/summary.log | grep -v "^memory" | tail -30
