#!/bin/bash
# One device call: the tensor-core attention backward's variants (TROUPE_ATTENTION_BACKWARD=fused,
# fused_smem, split) side by side: the CUDA attention tests under each, gpu_attention_bench at
# GPT-2 124M's and 1.5B's shapes, and the 124M step, with torch.compile in the same call. Expects
# pkg.tar.gz and torch_gpt2.py next to it (README.md, pack.sh).
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tr; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
cd /tmp
V=${VARIANTS:-fused fused_smem split}
for v in $V; do
  echo "== tests, $v"
  TROUPE_ATTENTION_BACKWARD=$v timeout 120 $B/test_kernels -tc="*attention*" 2>&1 | tail -4
done
for v in $V; do
  echo "== attention bench, $v"
  TROUPE_ATTENTION_BACKWARD=$v timeout 60 $B/gpu_attention_bench 2>&1 | tail -3
  TROUPE_ATTENTION_BACKWARD=$v timeout 60 $B/gpu_attention_bench --batch 8 --heads 25 --kv-heads 25 2>&1 | tail -1
done
for v in $V; do
  TROUPE_ATTENTION_BACKWARD=$v timeout 60 $B/gpu_gpt2_bench --tag troupe-124M-$v --steps 20 2>&1 | tail -1
done
[ -n "$NO_TORCH" ] || timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1
true
