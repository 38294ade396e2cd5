#!/bin/bash
# Session 6: every CUDA test (the recorded-step cases among them), troupe train on the GPU through
# the CLI test, then GPT-2 124M as the trainer runs it (the step recorded as a CUDA graph), with
# --no-graph, and torch.compile, in one call. Expects pkg.tar.gz and torch_gpt2.py next to it.
source "$(dirname "$0")/unpack.sh"
cd /tmp
cuda_tests test_kernels test_model test_runtime
timeout 90 $B/test_cli -tc='gpu*' 2>&1 | tail -2 | tee -a $O/tests.log
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --steps 20 --phases 2>&1 | tail -n 9 | tee $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-nograph --steps 20 --no-graph 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-again --steps 20 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-noclip --steps 20 --no-clip 2>&1 | tail -1 | tee -a $O/bench.log
true
