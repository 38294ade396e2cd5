"""What bench/gpu/hf_check.py and bench/gpu/peft_check.py share: the check log, running troupe,
the small GPT-2 both build with transformers' constructors, troupe's logits of a model and the
token shards a fine-tuning run reads."""
import os
import struct
import subprocess
import sys

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

results = []


def check(name, ok, detail):
    """Records one check and prints its line (PASS/FAIL, the name, the details)."""
    results.append({"check": name, "ok": bool(ok), **detail})
    print(f"{'PASS' if ok else 'FAIL'}  {name}  " + "  ".join(f"{k}={v}" for k, v in detail.items()),
          flush=True)


def run(cmd):
    """Runs a command; its output, or an exit naming the command with what it printed."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(" ".join(cmd), "\n", p.stdout, p.stderr, file=sys.stderr)
        raise SystemExit(f"command failed ({p.returncode}): {' '.join(cmd)}")
    return p.stdout


def jitter(model, seed):
    """Moves every parameter off its initial value (norm weights 1, biases 0) so that each one's
    loading is visible in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def gpt2_model():
    """A 2-layer GPT-2 of width 64 over 1,000 tokens, its weights jittered."""
    torch.manual_seed(1)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=1000,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = GPT2LMHeadModel(cfg)
    jitter(m, 11)
    return m


def troupe_logits(bin_dir, model_path, tokens, work, device, vocab):
    """`troupe logits` of a checkpoint or model directory on rows of token ids: [rows, T, vocab]."""
    tok_file = os.path.join(work, "tokens.txt")
    out = os.path.join(work, "logits.bin")
    with open(tok_file, "w") as f:
        for row in tokens:
            f.write(" ".join(str(t) for t in row) + "\n")
    run([os.path.join(bin_dir, "troupe"), "logits", model_path, "--tokens", tok_file, "--out", out,
         "--device", device])
    return np.fromfile(out, dtype="<f4").reshape(len(tokens), len(tokens[0]), vocab)


def write_shard(path, n, vocab, seed):
    """A token shard in troupe's format (256-int32 header, uint16 ids) of n random ids."""
    rnd = np.random.default_rng(seed)
    tokens = rnd.integers(0, vocab, size=n, dtype=np.uint16)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *([20240520, 1, n] + [0] * 253)))
        f.write(tokens.tobytes())
