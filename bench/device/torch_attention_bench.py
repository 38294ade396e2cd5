# PyTorch's causal SDPA (flash backend) at the shape of bench/gpu_attention_bench, timed the
# same way: `reps` back-to-back calls between two events, best of `rounds`. Prints one JSON line.
# Usage: python3 torch_attention_bench.py [--batch 16 --seq 1024 --heads 12 --dim 64]
import argparse, json
import torch, torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument('--batch', type=int, default=16); p.add_argument('--seq', type=int, default=1024)
p.add_argument('--heads', type=int, default=12); p.add_argument('--dim', type=int, default=64)
p.add_argument('--reps', type=int, default=50); p.add_argument('--rounds', type=int, default=5)
a = p.parse_args()
B, T, H, D = a.batch, a.seq, a.heads, a.dim
q, k, v = (torch.randn(B, H, T, D, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, T, D, device='cuda', dtype=torch.bfloat16)

def best(fn):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(a.rounds):
        t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(a.reps): fn()
        t1.record(); torch.cuda.synchronize(); out.append(t0.elapsed_time(t1) / a.reps)
    return min(out)

with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
    fwd = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    both = best(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout))
mm = B * H * T * T * D  # FLOP of one causal T×T×D matmul: 2·T·T·D per head, half of it kept
res = dict(engine='torch-sdpa-flash', B=B, T=T, H=H, D=D, fwd_ms=round(fwd, 4), bwd_ms=round(both - fwd, 4),
           fwd_tflops=round(2 * mm / fwd / 1e9, 1), bwd_tflops=round(5 * mm / (both - fwd) / 1e9, 1))
print(json.dumps(res))
