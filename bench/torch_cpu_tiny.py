"""The PyTorch CPU baseline for configs/tiny.toml's model: train a small GPT-2 on N threads for a
wall-clock budget and print train loss, validation loss and tokens/s; the last line is JSON with
the median step time over the steps after the first three and its tokens/s (what
bench/cpu_tiny.sh compares troupe with).

The model is troupe's GPT-2 (bench/torch_models.py) with the 50257-token vocabulary; AdamW with
weight decay 0.1, fp32. Batches are B random windows of T + 1 tokens. The token file is either a
troupe / llm.c shard (`troupe data prepare` writes them: a 1024-byte header, then uint16 tokens)
or raw uint16 tokens; its first twentieth is the validation split.

    python3 bench/torch_cpu_tiny.py TOKENS SECONDS LAYERS HIDDEN HEADS SEQ BATCH LR [--threads 2]
    taskset -c 0,1 python3 bench/torch_cpu_tiny.py data/tokens/train.bin 300 4 128 4 64 16 0.003
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

from torch_models import GPT2

VOCAB = 50257
SHARD_MAGIC = 20240520
SHARD_HEADER_BYTES = 1024


def load_tokens(path):
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size >= SHARD_HEADER_BYTES and raw[:4].view(np.int32)[0] == SHARD_MAGIC:
        raw = raw[SHARD_HEADER_BYTES:]
    return torch.from_numpy(raw.view(np.uint16).astype(np.int64))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokens")
    ap.add_argument("seconds", type=float)
    ap.add_argument("layers", type=int)
    ap.add_argument("hidden", type=int)
    ap.add_argument("heads", type=int)
    ap.add_argument("seq", type=int)
    ap.add_argument("batch", type=int)
    ap.add_argument("lr", type=float)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    tokens = load_tokens(a.tokens)
    n_val = len(tokens) // 20
    val, train = tokens[:n_val], tokens[n_val:]
    model = GPT2(VOCAB, a.layers, a.hidden, a.heads, a.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)

    def batch(source):
        starts = torch.randint(len(source) - a.seq - 1, (a.batch,), generator=gen)
        x = torch.stack([source[i:i + a.seq] for i in starts])
        y = torch.stack([source[i + 1:i + a.seq + 1] for i in starts])
        return x, y

    def loss_of(x, y):
        return model(x, y)

    def evaluate(batches=8):
        model.eval()
        with torch.no_grad():
            total = sum(loss_of(*batch(val)).item() for _ in range(batches))
        model.train()
        return total / batches

    params = sum(p.numel() for p in model.parameters())
    print(f"params {params / 1e6:.2f}M tokens {len(tokens)} threads {a.threads}", flush=True)
    print(f"t=0 val {evaluate():.3f}", flush=True)
    start = time.time()
    step = 0
    step_s = []
    while time.time() - start < a.seconds:
        t0 = time.perf_counter()
        loss = loss_of(*batch(train))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
        step += 1
        if step % 50 == 0:
            elapsed = time.time() - start
            print(f"t={elapsed:.0f}s step {step} train {loss.item():.3f} val {evaluate():.3f} "
                  f"tok/s {step * a.batch * a.seq / elapsed:.0f}", flush=True)
    print(f"final step {step} val {evaluate():.3f}")
    timed = step_s[3:] or step_s
    med = statistics.median(timed)
    print(json.dumps({"label": "pytorch", "threads": a.threads, "batch": a.batch, "seq": a.seq,
                      "steps_measured": len(timed), "step_ms": round(med * 1e3, 2),
                      "tok_s": round(a.batch * a.seq / med), "loss": round(loss.item(), 4)}),
          flush=True)


if __name__ == "__main__":
    main()
