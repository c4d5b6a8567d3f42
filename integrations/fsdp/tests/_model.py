"""A small decoder LM for the tests: RoPE + GQA causal attention through magi-attention's calc_attn.

With `key=None` attention is torch SDPA over the whole input (one document): the single-process reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from magi_attention.api import calc_attn


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64, device=x.device) / half))
    ang = pos.to(torch.float64)[:, None] * freqs[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, hq: int, hkv: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, dim // hq
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (hq + 2 * hkv) * self.d, bias=False)
        self.proj = nn.Linear(hq * self.d, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, pos, key):
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = rope(q.view(t, self.hq, self.d), pos)
        k = rope(k.view(t, self.hkv, self.d), pos)
        v = v.view(t, self.hkv, self.d)
        if key is None:
            rep = self.hq // self.hkv
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
            ).transpose(0, 1)  # fmt: skip
        else:
            out, _ = calc_attn(q.contiguous(), k.contiguous(), v.contiguous(), key)
        x = x + self.proj(out.reshape(t, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=97, dim=32, layers=2, hq=4, hkv=2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hq, hkv) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, pos, key=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, pos, key)
        return self.head(self.norm(x))
