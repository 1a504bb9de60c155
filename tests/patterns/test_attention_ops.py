"""``torch.library.opcheck`` on the fused attention ops, with contiguous and non-contiguous
(strided) samples: schema, fake (meta) implementation strides, autograd registration, AOT."""

from __future__ import annotations

import pytest
import torch

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.patterns import attention_ops  # noqa: F401

PLAN = "backward=two_kernel;autotune=0"


def _qkv(strided: bool, hq=4, hkv=2, n=24, d=16, requires_grad=True):
    g = torch.Generator().manual_seed(1)
    if strided:
        # views into one fused [B, N, (Hq + 2 Hkv), D] projection, transposed to [B, H, N, D]
        x = torch.randn(2, n, hq + 2 * hkv, d, generator=g)
        q, k, v = x.split([hq, hkv, hkv], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
    else:
        q = torch.randn(2, hq, n, d, generator=g)
        k = torch.randn(2, hkv, n, d, generator=g)
        v = torch.randn(2, hkv, n, d, generator=g)
    return [t.detach().requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("causal,mask_kind", [("none", "none"), ("top_left", "none"), ("none", "additive"), ("bottom_right", "bool_keep")])
def test_opcheck_forward(strided, causal, mask_kind):
    q, k, v = _qkv(strided)
    mask = None
    if mask_kind == "additive":
        mask = torch.randn(2, 1, 1, 24)
    elif mask_kind == "bool_keep":
        mask = torch.rand(2, 1, 1, 24) > 0.2
    torch.library.opcheck(torch.ops.fuser.attention.default, (q, k, v, mask, 0.25, causal, mask_kind, True, PLAN))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_opcheck_backward(strided):
    q, k, v = _qkv(strided, requires_grad=False)
    out, lse = torch.ops.fuser.attention(q, k, v, None, 0.25, "top_left", "none", True, PLAN)
    dout = torch.randn_like(out)
    if strided:
        dout = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
    torch.library.opcheck(
        torch.ops.fuser.attention_backward.default,
        (dout, q, k, v, out, lse, None, 0.25, "top_left", "none", PLAN, [True, True, True]),
    )


def test_inference_forward_returns_empty_lse():
    q, k, v = _qkv(False, requires_grad=False)
    out, lse = torch.ops.fuser.attention(q, k, v, None, 0.25, "none", "none", False, PLAN)
    assert lse.numel() == 0 and out.shape == (2, 4, 24, 16)
    # output laid out [B, N, H, D] in memory, so out.transpose(1, 2) is contiguous
    assert out.transpose(1, 2).is_contiguous()
