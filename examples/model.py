"""A small GPT-style decoder, written the way model code usually is (no fused kernels).

Its attention uses a registered causal buffer with ``masked_fill``, grouped-query attention
through ``repeat_kv`` (expand + reshape), an explicit ``1/sqrt(d)`` scale and dropout on the
attention weights — exactly what ``torch.compile(model, backend="fuser")`` finds and fuses.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv·n_rep, T, D]``, each kv head repeated n_rep times."""
    b, h, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_seq: int, dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor, return_qk: bool = False):
        """``[B, T, dim]`` -> ``[B, T, dim]``; with ``return_qk`` also ``(q, k)``, q
        ``[B, H, T, hd]`` and k ``[B, Hkv, T, hd]`` (before the GQA repeat)."""
        b, t, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, hd).transpose(1, 2)
        qk = (q, k)
        k = repeat_kv(k, self.n_heads // self.n_kv_heads)
        v = repeat_kv(v, self.n_heads // self.n_kv_heads)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.causal[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).reshape(b, t, -1)
        return (self.proj(y), qk) if return_qk else self.proj(y)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_seq: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, n_kv_heads, max_seq, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, return_qk: bool = False):
        a, qk = self.attn(self.ln1(x), return_qk=True)
        x = x + a
        x = x + self.mlp(self.ln2(x))
        return (x, qk) if return_qk else x


class TinyGPT(nn.Module):
    """Token embedding, ``n_layers`` pre-norm blocks, tied LM head. Input ``[B, T]`` token ids,
    output ``[B, T, vocab]`` logits."""

    def __init__(self, vocab: int = 256, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int = 2, max_seq: int = 256, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv_heads, max_seq, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(dim)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, return_qk: bool = False):
        """Logits ``[B, T, vocab]``; with ``return_qk`` also the last layer's ``(q, k)``
        (for attention distillation, see ``examples/distill.py``)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        qk = None
        for blk in self.blocks:
            x, qk = blk(x, return_qk=True)
        logits = self.ln(x) @ self.tok.weight.t()
        return (logits, qk) if return_qk else logits
