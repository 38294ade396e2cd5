"""The GPT-2 model of the PyTorch baselines (bench/torch_gpt2.py on the GPU, bench/torch_cpu_tiny.py
on the CPU), the same model troupe trains: pre-LayerNorm blocks, causal attention through
scaled_dot_product_attention, a tanh-GELU MLP of width 4C, learned positions, the head tied to the
token embedding, N(0, 0.02) weights and zero biases.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


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
    """forward(tokens, targets) is the mean cross-entropy in fp32; with recompute every block is
    checkpointed (its activations recomputed in the backward)."""

    def __init__(self, vocab, layers, width, heads, seq, recompute=False):
        super().__init__()
        self.recompute = recompute
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
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


class LlamaBlock(nn.Module):
    def __init__(self, width, heads, kv_heads, ffn, theta, seq):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.norm1 = nn.RMSNorm(width, eps=1e-5)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.norm2 = nn.RMSNorm(width, eps=1e-5)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)
        inv = 1.0 / theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, z):  # z [b, h, t, d]; rotates pairs (i, i + d/2) as Hugging Face's LLaMA does
        t = z.shape[2]
        cos, sin = self.cos[:t].to(z.dtype), self.sin[:t].to(z.dtype)
        a, b = z.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def attention(self, x):
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """The LLaMA model troupe trains: RMSNorm pre-norm blocks, RoPE, grouped-query attention
    through scaled_dot_product_attention, a SwiGLU MLP, an untied head, no biases. forward(tokens,
    targets) is the mean cross-entropy in fp32."""

    def __init__(self, vocab, layers, width, heads, kv_heads, ffn, seq, theta=500000.0,
                 recompute=False):
        super().__init__()
        self.recompute = recompute
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, kv_heads, ffn, theta, seq)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, tokens, targets):
        x = self.wte(tokens)
        for block in self.blocks:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
