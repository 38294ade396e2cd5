#!/bin/bash
# Session 6's first device call: the CUDA tests of the clip decided on the device (exact_sum_add,
# clip_factor, adamw's grad_factor), the cross-entropy cases, and every other CUDA test; then GPT-2
# 124M with the default step (clip on the device) and --no-clip against torch.compile in the same
# call. Expects pkg.tar.gz and torch_gpt2.py next to it (README.md, pack.sh); results in $OUT.
source "$(dirname "$0")/unpack.sh"
cd /tmp
cuda_tests test_kernels test_model test_runtime
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 --phases 2>&1 | tail -n 12 | tee $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-noclip --steps 20 --no-clip 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-again --steps 20 2>&1 | tail -1 | tee -a $O/bench.log
true
