#!/bin/bash
# One device call: GPT-2 124M and 1.5B with the work of the PyTorch baseline (gpu_gpt2_bench
# --no-clip: no global-norm clip, as torch_gpt2.py) and, for 124M, with the clip troupe trains with,
# next to torch.compile on the same shapes. Expects pkg.tar.gz and torch_gpt2.py next to it
# (README.md, pack.sh); results in $OUT.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; cd /tmp
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-clip --steps 20 2>&1 | tail -1 | tee $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-noclip --steps 20 --no-clip --phases 2>&1 | tail -n 8 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 60 $B/gpu_gpt2_bench --tag gpt2-124M-noclip-again --steps 20 --no-clip 2>&1 | tail -1 | tee -a $O/bench.log
M="--layers 48 --embd 1600 --heads 25"
timeout 90 $B/gpu_gpt2_bench --tag gpt2-1.5B-noclip $M --steps 8 --warmup 2 --no-clip 2>&1 | tail -1 | tee -a $O/bench.log
timeout 240 python3 $S/torch_gpt2.py --compile --tag compile-1.5B $M --steps 10 2>&1 | tail -1 | tee -a $O/bench.log
true
