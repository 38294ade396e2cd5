#!/bin/bash
# Device call: where the GPU time of a GPT-2 124M step goes, troupe and torch.compile side by side.
# troupe: gpu_gpt2_bench under nsys (kernel summary) when nsys is there, else its --profile table;
# PyTorch: torch_profile.py (torch.profiler) around torch_gpt2.py --compile; then the plain
# benchmark of each for the ratio. Expects pkg.tar.gz and torch_gpt2.py next to it (README.md).
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tp; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; cd /tmp
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee $O/bench.log
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}; ncu: $(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)" | tee -a $O/bench.log
timeout 90 $B/gpu_gpt2_bench --tag gpt2-124M --profile 2>&1 | tail -n 26 | tee -a $O/bench.log
timeout 90 python3 $S/torch_gpt2.py --tag eager-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 150 python3 $S/torch_gpt2.py --compile --tag compile-124M 2>&1 | tail -1 | tee -a $O/bench.log
timeout 200 python3 $S/torch_profile.py $S/torch_gpt2.py --compile --steps 10 > $O/torch_kernels.log 2>&1
if [ -n "$NSYS" ]; then
  timeout 120 $NSYS profile -t cuda -o /tmp/troupe_prof --force-overwrite true $B/gpu_gpt2_bench --steps 10 --warmup 3 > /tmp/nsys_run.log 2>&1
  timeout 120 $NSYS stats -r cuda_gpu_kern_sum --format csv -o /tmp/troupe_kern /tmp/troupe_prof.nsys-rep > /dev/null 2>&1
  cp /tmp/troupe_kern*.csv $O/troupe_kernels.csv 2>/dev/null || tail -20 /tmp/nsys_run.log > $O/troupe_kernels.csv
fi
[ -n "$EXTRA" ] && eval "$EXTRA"
true
