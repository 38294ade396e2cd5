#!/bin/bash
# GPT-2 124M with the step as a CUDA graph: cuBLASLt's heuristic GEMMs against measured ones
# (--gemm-tune), interleaved, with torch.compile in the same call.
source "$(dirname "$0")/unpack.sh"
cd /tmp
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 2>&1 | tail -1 | tee $O/bench.log
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M-tuned --steps 20 --gemm-tune /tmp/tune.txt 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-again --steps 20 2>&1 | tail -1 | tee -a $O/bench.log
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M-tuned-again --steps 20 --gemm-tune /tmp/tune.txt 2>&1 | tail -1 | tee -a $O/bench.log
true
