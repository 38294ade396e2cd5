#!/bin/bash
# Session 5's closing device call: every CUDA test, the one-GPU launch over nccl against troupe
# train (launch_gpu.sh), GPT-2 124M (with --phases) against PyTorch eager and torch.compile, the
# 4-stage 1F1B pipeline (gpu_pipeline_bench), then GPT-2 1.5B against torch.compile and eager, all
# in one call. Expects pkg.tar.gz and torch_gpt2.py next to it (README.md, pack.sh); results in $OUT.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
R=$(pwd)
cd /tmp
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $O/tests.log
for t in test_kernels test_model test_runtime; do
  echo "== $t" | tee -a $O/tests.log
  timeout 200 $B/$t -tc='cuda*,gemm*' > $O/$t.log 2>&1; tail -n 3 $O/$t.log | tee -a $O/tests.log
done
if mkdir -p /work/main/build-cuda 2>/dev/null && cp $B/troupe /work/main/build-cuda/troupe 2>/dev/null; then
  timeout 90 $B/test_cli -tc='gpu*' 2>&1 | tail -2 | tee -a $O/tests.log
fi
OUT=/tmp/launch_out timeout 150 bash $S/launch_gpu.sh > /dev/null 2>&1
grep -v "^memory" /tmp/launch_out/summary.log | tail -24 > $O/launch.log
tail -4 $O/launch.log
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 --phases 2>&1 | tail -n 12 | tee $O/bench.log
timeout 90 python3 $S/torch_gpt2.py --tag eager-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-again --steps 20 2>&1 | tail -1 | tee -a $O/bench.log
(cd $R && timeout 200 $B/gpu_pipeline_bench --out $O/pipeline.json > $O/pipeline.log 2>&1); tail -n 6 $O/pipeline.log
M="--layers 48 --embd 1600 --heads 25"
timeout 90 $B/gpu_gpt2_bench --tag gpt2-1.5B $M --steps 8 --warmup 2 2>&1 | tail -1 | tee $O/bench_1p5b.log
timeout 240 python3 $S/torch_gpt2.py --compile --tag compile-1.5B $M --steps 10 2>&1 | tail -1 | tee -a $O/bench_1p5b.log
timeout 100 python3 $S/torch_gpt2.py --tag eager-1.5B $M --steps 10 2>&1 | tail -1 | tee -a $O/bench_1p5b.log
true
