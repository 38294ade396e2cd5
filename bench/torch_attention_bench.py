"""PyTorch's causal attention (scaled_dot_product_attention, bf16) at the shape of
bench/gpu_attention_bench, timed the same way: `--reps` back-to-back calls between two CUDA events,
best of `--rounds`. Prints one JSON line with forward and backward milliseconds and TFLOP/s
(forward 2 causal matmuls, backward 5).

    python3 bench/torch_attention_bench.py [--batch 16 --seq 1024 --heads 12 --dim 64]
                                           [--kv-heads 12] [--backend flash|cudnn|efficient]

`--backend` picks SDPA's kernel: `flash` (FlashAttention-2, the default) or `cudnn` (cuDNN's
fused attention, Hopper wgmma kernels on an H100/H200). `--kv-heads` below `--heads` is
grouped-query attention.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=0, help="key/value heads (0: --heads)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="flash")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    kv_heads = a.kv_heads or a.heads
    if a.heads % kv_heads:
        ap.error(f"--heads {a.heads} is not a multiple of --kv-heads {kv_heads}")
    shape = (a.batch, a.heads, a.seq, a.dim)
    kv_shape = (a.batch, kv_heads, a.seq, a.dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    gqa = kv_heads != a.heads

    def best_ms(fn):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.rounds):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / a.reps)
        return min(times)

    attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    with sdpa_kernel(BACKENDS[a.backend]):
        forward = best_ms(attend)
        both = best_ms(lambda: torch.autograd.grad(attend(), (q, k, v), dout))
    backward = both - forward
    # One causal T x T x D matmul per head: 2·T·T·D FLOP, half of it kept.
    matmul = a.batch * a.heads * a.seq * a.seq * a.dim
    print(json.dumps({
        "engine": "torch-sdpa-" + a.backend, "B": a.batch, "T": a.seq, "H": a.heads,
        "Hkv": kv_heads, "D": a.dim,
        "fwd_ms": round(forward, 4), "bwd_ms": round(backward, 4),
        "fwd_tflops": round(2 * matmul / forward / 1e9, 1),
        "bwd_tflops": round(5 * matmul / backward / 1e9, 1),
    }))


if __name__ == "__main__":
    main()
