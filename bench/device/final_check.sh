#!/bin/bash
# One device call for a session's end: every CUDA test of the tree, the GPT-2 124M benchmark with
# its per-op profile next to PyTorch eager and torch.compile, the one-GPU launch over nccl against
# troupe train (launch_gpu.sh) and test_cli's GPU case, then GPT-2 1.5B against eager and
# torch.compile. Results in $OUT (the device tool returns 8 files at most).
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; cd /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/tests.log
for t in test_kernels test_model test_runtime; do
  echo "== $t -tc=cuda*" | tee -a $O/tests.log
  timeout 150 $B/$t -tc='cuda*' 2>&1 | tail -n 25 >> $O/tests.log
  tail -n 3 $O/tests.log
done
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --profile 2>&1 | tail -n 26 | tee $O/bench.log
timeout 90 python3 $S/torch_gpt2.py --tag eager-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
# test_cli's GPU case runs TROUPE_BINARY_DIR/troupe (this build's path on the build machine).
if mkdir -p /work/main/build-cuda 2>/dev/null && cp $B/troupe /work/main/build-cuda/troupe 2>/dev/null; then
  timeout 90 $B/test_cli -tc='gpu*' 2>&1 | tail -3 | tee -a $O/tests.log
fi
OUT=/tmp/launch_out timeout 120 bash $S/launch_gpu.sh > /dev/null 2>&1
grep -v "^memory" /tmp/launch_out/summary.log | tail -24 | tee $O/launch.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-1.5B --layers 48 --embd 1600 --heads 25 --steps 6 --warmup 2 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 python3 $S/torch_gpt2.py --tag eager-1.5B --layers 48 --embd 1600 --heads 25 --steps 10 2>&1 | tail -1 | tee -a $O/bench.log
timeout 120 python3 $S/torch_gpt2.py --compile --tag compile-1.5B --layers 48 --embd 1600 --heads 25 --steps 10 2>&1 | tail -1 | tee -a $O/bench.log
