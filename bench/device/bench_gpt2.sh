#!/bin/bash
# Device call: GPT-2 124M and 1.5B, troupe vs PyTorch eager and torch.compile, same call.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tb; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv | tee $O/bench.log
timeout 120 $B/gpu_gpt2_bench --tag gpt2-124M 2>&1 | tail -4 | tee -a $O/bench.log
timeout 90 python3 $S/torch_gpt2.py --tag eager-124M 2>&1 | tail -2 | tee -a $O/bench.log
timeout 200 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -2 | tee -a $O/bench.log
timeout 150 $B/gpu_gpt2_bench --tag gpt2-1.5B --layers 48 --embd 1600 --heads 25 --steps 6 --warmup 2 2>&1 | tail -4 | tee -a $O/bench.log
timeout 120 python3 $S/torch_gpt2.py --tag eager-1.5B --layers 48 --embd 1600 --heads 25 --steps 10 2>&1 | tail -2 | tee -a $O/bench.log
timeout 300 python3 $S/torch_gpt2.py --compile --tag compile-1.5B --layers 48 --embd 1600 --heads 25 --steps 10 2>&1 | tail -2 | tee -a $O/bench.log
