#!/bin/bash
# Device call on a 2-GPU machine (nvidia-h200-x2): troupe launch with one process per GPU over
# NCCL (NVLink/P2P, no TROUPE_NCCL_HOST_PER_RANK) against troupe train in one process, bit for bit:
# pp2, dp2, dp2 with ZeRO-1; then GPT-2 124M throughput as pp2 and dp2 on two GPUs next to the same
# configs in one process on one GPU.
S=$(cd "$(dirname "$0")" && pwd); R=$(pwd)
B=/tmp/tl; rm -rf $B; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
W=/tmp/tmw; rm -rf $W; mkdir -p $W/res; cd $W
# Everything goes to /tmp/tmw/res; run as
#   timeout 480 bash multi_gpu.sh; tar czf $OUT/res.tgz -C /tmp/tmw res; cat /tmp/tmw/res/summary.log
# (the device tool returns at most 8 files).
O=$W/res
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee $O/info.log
nvidia-smi topo -m | tee -a $O/info.log
python3 - <<'PY'
import struct, random
def shard(path, n, seed, vocab, pattern):
    random.seed(seed)
    toks = [random.randrange(vocab) if (not pattern or random.random() < 0.25) else (i % 8) * 5 for i in range(n)]
    hdr = [0] * 256; hdr[0] = 20240520; hdr[1] = 1; hdr[2] = n
    open(path, 'wb').write(struct.pack('<256i', *hdr) + struct.pack('<%dH' % n, *toks))
shard('train64.bin', 40000, 1, 64, True); shard('val64.bin', 8000, 2, 64, True)
shard('train.bin', 2000000, 3, 50257, False); shard('val.bin', 200000, 4, 50257, False)
PY
cat > pp2.toml <<'T'
[model]
arch = "gpt2"
vocab_size = 64
num_layers = 2
hidden_size = 32
num_heads = 4
seq_length = 16
[parallel]
pipeline_stage = 2
data_parallel = 1
micro_batch_size = 2
micro_batch_num = 2
[optimizer]
lr = 1e-2
[train]
steps = 4
warmup_steps = 1
eval_interval = 2
eval_batches = 1
[data]
train = "train64.bin"
val = "val64.bin"
[runtime]
device = "cuda"
threads = 2
T
sed -e 's/pipeline_stage = 2/pipeline_stage = 1/' -e 's/data_parallel = 1/data_parallel = 2/' pp2.toml > dp2.toml
sed -e 's/^lr = 1e-2/lr = 1e-2\nzero_stage = 1/' dp2.toml > dp2z.toml
run() {  # name config
  local n=$1 c=$2
  echo "=== $n: troupe train (one process, one GPU)" | tee -a $O/summary.log
  timeout 60 $B/troupe train $c --set runtime.run_dir=$W/$n-in > $O/$n-train.log 2>&1; echo "rc=$?" | tee -a $O/summary.log
  echo "=== $n: troupe launch (2 processes, GPUs 0 and 1, nccl)" | tee -a $O/summary.log
  NCCL_DEBUG=INFO timeout 90 $B/troupe launch --worker_num 2 --master_port 29602 --grace 5 $c --set runtime.run_dir=$W/$n-l > $O/$n-launch.log 2>&1; echo "rc=$?" | tee -a $O/summary.log
  tail -n 4 $O/$n-launch.log | tee -a $O/summary.log
  cp -r $W/$n-l/logs $O/$n-logs 2>/dev/null
  grep -h -E "NCCL INFO (Channel|.*via P2P|.*NVLS|comm .* rank)" $W/$n-l/logs/*.log 2>/dev/null | head -6 | tee -a $O/summary.log
  for f in $W/$n-in/checkpoints/step_*/*.safetensors; do
    g=$W/$n-l/checkpoints/$(basename $(dirname $f))/$(basename $f)
    if cmp -s $f $g; then echo "identical $(basename $(dirname $f))/$(basename $f)"; else echo "DIFFERENT $(basename $f)"; fi
  done | tee -a $O/summary.log
  grep -o '"step":[0-9]*,"loss":[0-9.e+-]*' $W/$n-in/metrics.jsonl > $O/$n-in.loss
  grep -o '"step":[0-9]*,"loss":[0-9.e+-]*' $W/$n-l/metrics.jsonl > $O/$n-l.loss
  cmp -s $O/$n-in.loss $O/$n-l.loss && echo "losses identical: $(tr '\n' ' ' < $O/$n-in.loss)" | tee -a $O/summary.log || echo "losses DIFFER" | tee -a $O/summary.log
}
run pp2 pp2.toml
run dp2 dp2.toml
run dp2z dp2z.toml
# GPT-2 124M (B = 8 per micro-batch, m = 8, T = 1024, bf16), 8 steps, throughput of the last 4.
for mode in pp2 dp2; do
  if [ $mode = pp2 ]; then p="--set parallel.pipeline_stage=2 --set parallel.data_parallel=1"; else p="--set parallel.pipeline_stage=1 --set parallel.data_parallel=2"; fi
  common="--set data.train=train.bin --set data.val=val.bin --set train.steps=8 --set train.warmup_steps=2 --set train.eval_interval=100 --set train.gradient_accumulation_steps=1 --set optimizer.zero_stage=0 --set recompute.mode=none --set checkpoint.interval=1000"
  echo "=== 124M $mode: troupe train (one process, one GPU)" | tee -a $O/summary.log
  timeout 120 $B/troupe train $R/configs/gpt2_124m.toml $p $common --set runtime.run_dir=$W/g$mode-in > $O/g$mode-train.log 2>&1; echo "rc=$?" | tee -a $O/summary.log
  tail -n 3 $O/g$mode-train.log | tee -a $O/summary.log
  echo "=== 124M $mode: troupe launch (2 processes, 2 GPUs)" | tee -a $O/summary.log
  timeout 120 $B/troupe launch --worker_num 2 --master_port 29603 --grace 5 $R/configs/gpt2_124m.toml $p $common --set runtime.run_dir=$W/g$mode-l > $O/g$mode-launch.log 2>&1; echo "rc=$?" | tee -a $O/summary.log
  tail -n 3 $O/g$mode-launch.log | tee -a $O/summary.log
  for r in in l; do
    echo "$mode $r tok/s steps 5-8: $(grep -o '"step":[0-9]*,.*"tokens_per_s":[0-9.e+]*' $W/g$mode-$r/metrics.jsonl | tail -4 | grep -o '"tokens_per_s":[0-9.e+]*' | tr '\n' ' ')" | tee -a $O/summary.log
  done
  cp $W/g$mode-l/metrics.jsonl $O/g$mode-l.metrics.jsonl 2>/dev/null
done
