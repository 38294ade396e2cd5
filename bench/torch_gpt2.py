"""The PyTorch baseline for bench/gpu_gpt2_bench: one GPT-2 training step on one GPU, timed.

The model is the one gpu_gpt2_bench trains: pre-LayerNorm blocks, causal attention through
scaled_dot_product_attention, tanh-GELU MLP of width 4C, learned positions, the head tied to the
token embedding, vocabulary padded to 50304, N(0, 0.02) weights and zero biases. One step is the
forward under bf16 autocast with an fp32 cross-entropy, the backward and a fused AdamW (lr 6e-4),
on one fixed batch of random tokens; there is no gradient clipping (gpu_gpt2_bench --no-clip does
the same work). TF32 is allowed for fp32 matmuls. With --compile the model goes through
torch.compile first.

After --warmup untimed steps, each of --steps steps is timed with CUDA events; the script prints
one JSON line: the median step time, tokens/s, model TFLOP/s counted as 6N + 12·L·C·T FLOP per
token (N = parameters, the tied matrix once; attention counted as if it were not causal, as
gpu_gpt2_bench counts it), the peak of torch.cuda.max_memory_allocated over the timed steps and
the last loss.

    python3 bench/torch_gpt2.py [--compile] [--layers 12 --embd 768 --heads 12] [--seq 1024]
                                [--batch 16] [--steps 20] [--warmup 5] [--recompute] [--tag NAME]
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--compile", action="store_true", help="run the model through torch.compile")
    ap.add_argument("--recompute", action="store_true", help="checkpoint every block (recompute)")
    ap.add_argument("--tag", default="", help="a label copied into the JSON line")
    return ap.parse_args()


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def attention(self, x):
        b, t, c = x.shape
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        q, k, v = (split(z) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.recompute = args.recompute
        self.wte = nn.Embedding(args.vocab, args.embd)
        self.wpe = nn.Embedding(args.seq, args.embd)
        self.blocks = nn.ModuleList(Block(args.embd, args.heads) for _ in range(args.layers))
        self.lnf = nn.LayerNorm(args.embd)
        self.head = nn.Linear(args.embd, args.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens, targets):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def main():
    args = parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = "cuda"

    model = GPT2(args).to(device)
    params = sum(p.numel() for p in model.parameters())  # the tied matrix once
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    forward = torch.compile(model) if args.compile else model
    shape = (args.batch, args.seq)
    tokens = torch.randint(0, args.vocab, shape, device=device)
    targets = torch.randint(0, args.vocab, shape, device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    seconds = []
    loss = None
    for _ in range(args.steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    seconds.sort()
    median = seconds[len(seconds) // 2]

    tokens_per_step = args.batch * args.seq
    flop_per_token = 6 * params + 12 * args.layers * args.embd * args.seq
    flops = flop_per_token * tokens_per_step / median
    print(json.dumps({
        "tag": args.tag, "engine": "torch.compile" if args.compile else "torch eager",
        "compile": args.compile, "recompute": args.recompute, "params": params,
        "B": args.batch, "T": args.seq, "L": args.layers, "C": args.embd,
        "step_ms": round(median * 1e3, 2), "tok_s": round(tokens_per_step / median),
        "tflops": round(flops / 1e12, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "loss": float(loss),
    }))


if __name__ == "__main__":
    main()
