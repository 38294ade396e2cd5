#!/bin/bash
# One device call: every CUDA test, the one-GPU launch over nccl against troupe train
# (launch_gpu.sh), GPT-2 124M with cuBLASLt's first choices and with measured ones (--gemm-tune),
# PyTorch eager and torch.compile on the same shapes, the SM clock and board power sampled during
# the benchmarks, and the 4-stage 1F1B pipeline (gpu_pipeline_bench). Expects pkg.tar.gz and
# torch_gpt2.py next to it (README.md); results in $OUT.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
R=$(pwd)  # the repository root (configs/ for the pipeline benchmark)
cd /tmp
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $O/tests.log
for t in test_kernels test_model test_runtime; do
  echo "== $t" | tee -a $O/tests.log
  timeout 150 $B/$t -tc='cuda*,gemm*' 2>&1 | tail -n 4 | tee -a $O/tests.log
done
if mkdir -p /work/main/build-cuda 2>/dev/null && cp $B/troupe /work/main/build-cuda/troupe 2>/dev/null; then
  timeout 90 $B/test_cli -tc='gpu*' 2>&1 | tail -3 | tee -a $O/tests.log
fi
OUT=/tmp/launch_out timeout 150 bash $S/launch_gpu.sh > /dev/null 2>&1
grep -v "^memory" /tmp/launch_out/summary.log | tail -24 > $O/launch.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 250 > $O/power.csv &
SAMPLER=$!
echo "bench start $(date +%T.%N)" >> $O/bench.log
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 --profile --phases 2>&1 | tail -n 34 | tee -a $O/bench.log
echo "tuned start $(date +%T.%N)" >> $O/bench.log
rm -f /tmp/tune.txt
timeout 120 $B/gpu_gpt2_bench --tag gpt2-124M-tuned --steps 20 --gemm-tune /tmp/tune.txt 2>&1 | tail -1 | tee -a $O/bench.log
echo "torch start $(date +%T.%N)" >> $O/bench.log
timeout 90 python3 $S/torch_gpt2.py --tag eager-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 180 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
echo "torch end $(date +%T.%N)" >> $O/bench.log
kill $SAMPLER
cd $R && timeout 200 $B/gpu_pipeline_bench --out $O/pipeline.json 2>&1 | tail -n 20 > $O/pipeline.log
tail -n 12 $O/pipeline.log
