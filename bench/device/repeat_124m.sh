#!/bin/bash
# One device call: GPT-2 124M, troupe three times and torch.compile twice, interleaved, to see how
# far the step moves between runs on the same machine. Expects pkg.tar.gz (gpu_gpt2_bench and its
# libraries) and torch_gpt2.py next to it; one JSON line per run.
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tr; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
cd /tmp
for i in 1 2 3; do
  timeout 60 $B/gpu_gpt2_bench --tag troupe-124M-$i --steps 20 2>&1 | tail -1
  [ $i -lt 3 ] && timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M-$i 2>&1 | tail -1
done
true
