#!/bin/bash
# Experiment: GPT-2 124M with the step captured as one CUDA graph (gpu_gpt2_bench --graph) against
# the plain step and torch.compile, in one call. Expects pkg.tar.gz and torch_gpt2.py next to it.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
cd /tmp
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M-graph --steps 20 --graph 2>&1 | tail -n 8 | tee $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-graph-again --steps 20 --graph 2>&1 | tail -1 | tee -a $O/bench.log
true
