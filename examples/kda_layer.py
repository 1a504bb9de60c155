"""A Kimi-Delta-Attention-style layer written the naive way — a Python loop over tokens — trained
one step with ``torch.compile(..., backend="fuser")``.

    python examples/kda_layer.py              # GPU if there is one, else the CPU interpreter
    python examples/kda_layer.py --t 64

The layer (Kimi Linear, Moonshot AI 2025; the gated delta rule with a per-key-channel decay)
projects x to q, k, v, a log-space decay g and a write strength β, then runs the recurrence

    S ← S ∘ exp(g_t);  v̂ = kᵀ S;  S ← S + β k ⊗ (v − v̂);  o_t = qᵀ S

token by token, exactly as the reference code in papers and blogs writes it. ``torch.compile``
unrolls the loop into T copies of one step; fuser finds the chain, replaces it with one op
(``torch.ops.fuser.kda``) whose kernels keep the state on chip, and trains through it. The
script prints ``fuser.explain``'s view of the region and checks the loss and every gradient
against eager PyTorch.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser


class NaiveKDA(nn.Module):
    """KDA token mixer: ``x [B, T, D] -> [B, T, D]`` with ``H`` heads of key dim ``K`` and value
    dim ``V``; the state ``[B, H, K, V]`` is kept in float32 whatever the input dtype."""

    def __init__(self, d_model: int, heads: int, key_dim: int, value_dim: int):
        super().__init__()
        self.h, self.k, self.v = heads, key_dim, value_dim
        self.q_proj = nn.Linear(d_model, heads * key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, heads * key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, heads * value_dim, bias=False)
        self.g_proj = nn.Linear(d_model, heads * key_dim)
        self.b_proj = nn.Linear(d_model, heads)
        self.o_proj = nn.Linear(heads * value_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = F.normalize(self.q_proj(x).view(b, t, self.h, self.k), dim=-1) * self.k ** -0.5
        k = F.normalize(self.k_proj(x).view(b, t, self.h, self.k), dim=-1)
        v = self.v_proj(x).view(b, t, self.h, self.v)
        g = -F.softplus(self.g_proj(x).float()).view(b, t, self.h, self.k)   # log decay <= 0
        beta = self.b_proj(x).float().sigmoid()                                  # [B, T, H]
        s = x.new_zeros(b, self.h, self.k, self.v, dtype=torch.float32)
        o = torch.zeros(b, t, self.h, self.v, dtype=torch.float32, device=x.device)
        for i in range(t):
            q_i, k_i, v_i = q[:, i].float(), k[:, i].float(), v[:, i].float()
            s = s * g[:, i].exp()[..., None]
            v_hat = torch.einsum("bhk,bhkv->bhv", k_i, s)
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, i, :, None] * k_i, v_i - v_hat)
            o[:, i] = torch.einsum("bhk,bhkv->bhv", q_i, s)
        return self.o_proj(o.to(x.dtype).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, key_dim: int, value_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.mix = NaiveKDA(d_model, heads, key_dim, value_dim)

    def forward(self, x):
        return x + self.mix(self.norm(x))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=None, help="sequence length (default 64 on a GPU, 12 on the CPU)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device, dtype, t, d, heads, kd, vd, options = "cuda", torch.bfloat16, 64, 256, 4, 64, 64, None
    else:
        device, dtype, t, d, heads, kd, vd = "cpu", torch.float32, 12, 32, 2, 12, 20
        options = {"fuser.interpret": True}
    t = args.t or t
    model = Block(d, heads, kd, vd).to(device, dtype)
    x = torch.randn(2, t, d, device=device, dtype=dtype)
    target = torch.randn(2, t, d, device=device, dtype=dtype)

    def loss_fn(m, x):
        return F.mse_loss(m(x).float(), target.float())

    eager_loss = loss_fn(model, x)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))

    compiled = torch.compile(model, backend="fuser", options=options)
    with fuser.report.collecting() as report:
        loss = loss_fn(compiled, x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    print(report)

    fused = [m for m in report.matches if m.pattern == "kda" and m.fused]
    print(f"kda regions fused: {len(fused)}")
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    err = abs(loss.item() - eager_loss.item()) / max(abs(eager_loss.item()), 1e-12)
    worst = 0.0
    for (name, _), a, b in zip(model.named_parameters(), grads, eager_grads):
        e = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        worst = max(worst, e)
    print(f"loss {loss.item():.6f} (eager {eager_loss.item():.6f}, relative error {err:.2e}); "
          f"worst gradient relative error {worst:.2e}")
    ok = fused and err < tol and worst < tol * 10
    print("one training step through the fused KDA loop matches eager" if ok else "MISMATCH or not fused")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
