#!/bin/bash
# Device call: troupe launch on one GPU over nccl (each rank its own NCCL host id) vs troupe train in
# one process, fp32, bit for bit; pp2 (2 processes) and pp2 x dp2 (4 processes).
S=$(cd "$(dirname "$0")" && pwd)
B=/tmp/tl; mkdir -p $B && tar xzf $S/pkg.tar.gz -C $B
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
O=${OUT:-/tmp/out}; mkdir -p $O
W=/tmp/tlw; rm -rf $W; mkdir -p $W; cd $W
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $O/info.log
ldd $B/troupe | grep "not found" | tee -a $O/info.log
python3 - <<'PY'
import struct, random
def shard(path, n, seed, vocab):
    random.seed(seed)
    toks = [random.randrange(vocab) if random.random() < 0.25 else (i % 8) * 5 for i in range(n)]
    hdr = [0] * 256; hdr[0] = 20240520; hdr[1] = 1; hdr[2] = n
    open(path, 'wb').write(struct.pack('<256i', *hdr) + struct.pack('<%dH' % n, *toks))
shard('train.bin', 40000, 1, 50257); shard('val.bin', 8000, 2, 50257)
shard('train64.bin', 40000, 1, 64); shard('val64.bin', 8000, 2, 64)
PY
cat > small.toml <<'T'
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
train = "train.bin"
val = "val.bin"
[runtime]
device = "cuda"
threads = 2
T
sed -e 's/vocab_size = 64/vocab_size = 50257/' -e 's/num_layers = 2/num_layers = 4/' -e 's/hidden_size = 32/hidden_size = 128/' \
    -e 's/seq_length = 16/seq_length = 64/' -e 's/data_parallel = 1/data_parallel = 2/' -e 's/micro_batch_size = 2/micro_batch_size = 4/' \
    -e 's/micro_batch_num = 2/micro_batch_num = 4/' small.toml > tiny4.toml
run() {  # name config workers
  local n=$1 c=$2 w=$3
  echo "=== $n: troupe train (one process)" | tee -a $O/summary.log
  timeout 150 $B/troupe train $c --set runtime.run_dir=$W/$n-in > $O/$n-train.log 2>&1; echo "rc=$?" | tee -a $O/summary.log
  tail -n 3 $O/$n-train.log | tee -a $O/summary.log
  echo "=== $n: troupe launch ($w processes, nccl)" | tee -a $O/summary.log
  TROUPE_NCCL_HOST_PER_RANK=1 timeout 200 $B/troupe launch --worker_num $w --master_port 2960$w --grace 5 $c --set runtime.run_dir=$W/$n-l > $O/$n-launch.log 2>&1; echo "rc=$?" | tee -a $O/summary.log
  tail -n 6 $O/$n-launch.log | tee -a $O/summary.log
  cp -r $W/$n-l/logs $O/$n-logs 2>/dev/null
  for f in $W/$n-in/checkpoints/step_*/*.safetensors; do
    g=$W/$n-l/checkpoints/$(basename $(dirname $f))/$(basename $f)
    if cmp -s $f $g; then echo "identical $(basename $f)"; else echo "DIFFERENT $(basename $f)"; fi
  done | tee -a $O/summary.log
  grep -o '"step":[0-9]*,"loss":[0-9.e+-]*' $W/$n-in/metrics.jsonl > $O/$n-in.loss
  grep -o '"step":[0-9]*,"loss":[0-9.e+-]*' $W/$n-l/metrics.jsonl > $O/$n-l.loss
  cmp -s $O/$n-in.loss $O/$n-l.loss && echo "losses identical: $(tr '\n' ' ' < $O/$n-in.loss)" | tee -a $O/summary.log || echo "losses DIFFER" | tee -a $O/summary.log
}
echo "=== small with 50257-vocab data (ids beyond vocab 64): expect a clear refusal" | tee -a $O/summary.log
timeout 60 $B/troupe train small.toml --set runtime.run_dir=$W/bad > $O/bad.log 2>&1; echo "rc=$?" | tee -a $O/summary.log; tail -n 4 $O/bad.log | tee -a $O/summary.log
sed -e 's/train.bin/train64.bin/' -e 's/val.bin/val64.bin/' small.toml > small64.toml
run small small64.toml 2
run tiny4 tiny4.toml 4
