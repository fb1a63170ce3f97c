"""Small models shared by the pass tests (real modules, real layer names)."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class LlamaBlock(nn.Module):
    """One pre-norm Llama block (torchtitan names): attention wq/wk/wv/wo, SwiGLU w1/w2/w3."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class GPTAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)  # fused q, k, v
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(d, dim=-1))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(attn.transpose(1, 2).reshape(b, s, d))


class GPTMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """One GPT-2 block (Hugging Face names): LayerNorms with bias, a fused qkv projection
    ``attn.c_attn`` (dim -> 3 dim) and ``attn.c_proj``, GELU MLP ``mlp.c_fc``/``mlp.c_proj``,
    every Linear with a bias."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = GPTAttention(dim, heads), GPTMLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))



class MLPBlock(nn.Module):
    """A residual two-layer MLP block, ``fc1`` (dim -> hidden) and ``fc2`` (hidden -> dim)."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    """Blocks as ``layers.0``, ``layers.1``, ... (torchtitan's block names)."""

    def __init__(self, block=MLPBlock, blocks=2):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
