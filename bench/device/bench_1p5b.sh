#!/bin/bash
# One device call: GPT-2 1.5B (48 layers, 1600 hidden, 25 heads, B 16, T 1024, bf16), troupe with
# cuBLASLt's first choices and with measured ones (--gemm-tune), PyTorch eager and torch.compile on
# the same shapes. Expects pkg.tar.gz and torch_gpt2.py next to it; results in $OUT.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; cd /tmp
M="--layers 48 --embd 1600 --heads 25"
timeout 90 $B/gpu_gpt2_bench --tag gpt2-1.5B $M --steps 8 --warmup 2 2>&1 | tail -1 | tee $O/bench.log
rm -f /tmp/tune.txt
timeout 120 $B/gpu_gpt2_bench --tag gpt2-1.5B-tuned $M --steps 8 --warmup 2 --gemm-tune /tmp/tune.txt 2>&1 | tail -1 | tee -a $O/bench.log
timeout 100 python3 $S/torch_gpt2.py --tag eager-1.5B $M --steps 10 2>&1 | tail -1 | tee -a $O/bench.log
timeout 240 python3 $S/torch_gpt2.py --compile --tag compile-1.5B $M --steps 10 2>&1 | tail -1 | tee -a $O/bench.log
