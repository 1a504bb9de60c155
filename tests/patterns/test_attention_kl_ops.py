"""``torch.library.opcheck`` on the attention-KL ops with contiguous and strided samples,
training (statistics stored) and inference."""

from __future__ import annotations

import pytest
import torch

import fuser  # noqa: F401  (registers torch.ops.fuser.*)

PLAN = "split_k=1;backward=two_kernel"


def _inputs(strided: bool, requires_grad=True):
    g = torch.Generator().manual_seed(2)
    if strided:
        x1 = torch.randn(2, 21, 4 + 1, 16, generator=g)  # q1 (4 heads) and k1 (1 kv head) fused
        x2 = torch.randn(2, 21, 4 + 2, 24, generator=g)
        q1, k1 = (t.transpose(1, 2) for t in x1.split([4, 1], dim=2))
        q2, k2 = (t.transpose(1, 2) for t in x2.split([4, 2], dim=2))
    else:
        q1, k1 = torch.randn(2, 4, 21, 16, generator=g), torch.randn(2, 1, 21, 16, generator=g)
        q2, k2 = torch.randn(2, 4, 21, 24, generator=g), torch.randn(2, 2, 21, 24, generator=g)
    return [t.detach().requires_grad_(requires_grad) for t in (q1, k1, q2, k2)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("need_stats", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("causal,mask_kind", [("none", "none"), ("top_left", "none"), ("none", "bool_drop")])
def test_opcheck_forward(strided, need_stats, causal, mask_kind):
    q1, k1, q2, k2 = _inputs(strided, requires_grad=need_stats)
    mask = torch.rand(2, 1, 1, 21) > 0.7 if mask_kind == "bool_drop" else None
    torch.library.opcheck(torch.ops.fuser.attention_kl.default,
                          (q1, k1, q2, k2, mask, 0.25, 0.2, causal, mask_kind, need_stats, PLAN))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("needs", [[False, False, True, True], [True, True, True, True]], ids=["student", "both"])
def test_opcheck_backward(strided, needs):
    q1, k1, q2, k2 = _inputs(strided, requires_grad=False)
    rows, lse1, lse2, delta = torch.ops.fuser.attention_kl(q1, k1, q2, k2, None, 0.25, 0.2, "top_left", "none", True, PLAN)
    g = torch.randn(rows.shape[0], rows.shape[2], rows.shape[1]).transpose(1, 2) if strided else torch.randn_like(rows)
    torch.library.opcheck(
        torch.ops.fuser.attention_kl_backward.default,
        (g, q1, k1, q2, k2, lse1, lse2, delta, None, 0.25, 0.2, "top_left", "none", PLAN, needs),
    )
