#!/bin/bash
# Session 6's last call: every CUDA test (the trainer-graph case now over GPT-2 and LLaMA, bf16
# with full and selective recompute), then GPT-2 124M (with --phases, run launched after the
# graph's memory is returned) against torch.compile.
source "$(dirname "$0")/unpack.sh"
cd /tmp
cuda_tests test_kernels test_model test_runtime
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 --phases 2>&1 | tail -n 9 | tee $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-again --steps 20 2>&1 | tail -1 | tee -a $O/bench.log
true
