#!/bin/bash
# One device call for a session's end: every CUDA test of the tree, the GPT-2 124M benchmark with
# its per-op profile next to PyTorch eager and torch.compile, the 1.5B benchmark, and the one-GPU
# launch over nccl against troupe train (launch_gpu.sh). Results in $OUT (8 files at most).
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv | tee $O/tests.log
for t in "test_kernels cuda*" "test_model cuda*" "test_actors cuda*"; do
  set -- $t
  echo "== $1 -tc=$2" | tee -a $O/tests.log
  timeout 200 $B/$1 -tc="$2" 2>&1 | tail -n 25 | tee -a $O/tests.log
done
timeout 120 $B/gpu_gpt2_bench --tag gpt2-124M --profile 2>&1 | tail -n 40 | tee $O/bench.log
timeout 90 python3 $S/torch_gpt2.py --tag eager-124M 2>&1 | tail -2 | tee -a $O/bench.log
timeout 200 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -2 | tee -a $O/bench.log
timeout 150 $B/gpu_gpt2_bench --tag gpt2-1.5B --layers 48 --embd 1600 --heads 25 --steps 6 --warmup 2 2>&1 | tail -3 | tee -a $O/bench.log
# test_cli's GPU case runs TROUPE_BINARY_DIR/troupe (this build's path on the build machine).
if mkdir -p /work/main/build-cuda 2>/dev/null && cp $B/troupe /work/main/build-cuda/troupe 2>/dev/null; then
  timeout 120 $B/test_cli -tc='gpu*' 2>&1 | tail -4 | tee -a $O/tests.log
fi
OUT=/tmp/launch_out timeout 240 bash $S/launch_gpu.sh > /dev/null 2>&1
grep -v "^memory" /tmp/launch_out/summary.log | tail -30 | tee $O/launch.log
