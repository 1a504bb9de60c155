"""``torch.library.opcheck`` on the attention-KL ops with contiguous and strided samples,
training (statistics stored) and inference."""

from __future__ import annotations

import math

import pytest
import torch

import fuser  # noqa: F401  (registers torch.ops.fuser.*)

PLAN = "split_k=1;backward=two_kernel"
INF = -math.inf
NO_FILLS = (INF, INF, INF, INF, "replace", False)  # the fills and zero_hidden
MIN32 = torch.finfo(torch.float32).min


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


FWD_CASES = [
    # strided, causal, mask_kind, fills
    *[(strided, causal, kind, NO_FILLS) for strided in (False, True)
      for causal, kind in (("none", "none"), ("top_left", "none"), ("none", "bool_drop"))],
    # two-part statistics ([2, B, H, Nq] per side): finite fills, an additive mask
    (True, "bottom_right", "bool_drop", (-1e4, MIN32, -2.0, -3.0, "add", False)),
    (True, "none", "additive", NO_FILLS),
    # zero_hidden: side 1's statistics [4, B, H, Nq]
    (True, "bottom_right", "bool_drop", (-1e4, MIN32, -2.0, -3.0, "add", True)),
    (False, "top_left", "none", (INF, INF, MIN32, MIN32, "replace", True)),
]


@pytest.mark.parametrize("need_stats", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("strided,causal,mask_kind,fills", FWD_CASES,
                         ids=[f"{'strided' if c[0] else 'contiguous'}-{c[1]}-{c[2]}{'-fills' if c[3] != NO_FILLS else ''}"
                              f"{'-zero_hidden' if c[3][-1] else ''}" for c in FWD_CASES])
def test_opcheck_forward(strided, need_stats, causal, mask_kind, fills):
    q1, k1, q2, k2 = _inputs(strided, requires_grad=need_stats)
    mask = torch.rand(2, 1, 1, 21) > 0.7 if mask_kind == "bool_drop" else None
    if mask_kind == "additive":
        mask = torch.where(torch.rand(2, 1, 21, 21) > 0.7, MIN32, 0.0)
    torch.library.opcheck(torch.ops.fuser.attention_kl.default,
                          (q1, k1, q2, k2, mask, 0.25, 0.2, causal, mask_kind, need_stats, PLAN, *fills))


BWD_CASES = [
    # strided, needs, fills
    *[(strided, needs, NO_FILLS) for strided in (False, True) for needs in ([False, False, True, True], [True] * 4)],
    (True, [True] * 4, (INF, INF, -1.0, -2.0, "add", False)),  # two-part statistics, causal fill added
    (True, [True] * 4, (INF, INF, -1.0, -2.0, "add", True)),  # zero_hidden: side 1 [4, B, H, Nq]
    (False, [False, False, True, True], (INF, INF, -1.0, -2.0, "replace", True)),  # frozen teacher reads w1
]


@pytest.mark.parametrize("strided,needs,fills", BWD_CASES,
                         ids=[f"{'strided' if c[0] else 'contiguous'}-{'both' if c[1][0] else 'student'}"
                              f"{'-' + c[2][4] if c[2] != NO_FILLS else ''}{'-zero_hidden' if c[2][-1] else ''}"
                              for c in BWD_CASES])
def test_opcheck_backward(strided, needs, fills):
    q1, k1, q2, k2 = _inputs(strided, requires_grad=False)
    rows, lse1, lse2, delta = torch.ops.fuser.attention_kl(q1, k1, q2, k2, None, 0.25, 0.2, "top_left", "none", True,
                                                           PLAN, *fills)
    assert lse1.dim() == (3 if fills == NO_FILLS else 4)
    assert fills == NO_FILLS or lse1.shape[0] == (4 if fills[-1] else 2)
    g = torch.randn(rows.shape[0], rows.shape[2], rows.shape[1]).transpose(1, 2) if strided else torch.randn_like(rows)
    torch.library.opcheck(
        torch.ops.fuser.attention_kl_backward.default,
        (g, q1, k1, q2, k2, lse1, lse2, delta, None, 0.25, 0.2, "top_left", "none", PLAN, needs, *fills),
    )


def test_autograd_through_the_op_with_fills():
    # the op's autograd passes the fills to its backward: gradients equal the float64 reference
    from fuser.patterns.attention_kl_reference import reference

    q1, k1, q2, k2 = _inputs(False)
    keep = torch.rand(2, 1, 1, 21, generator=torch.Generator().manual_seed(3)) > 0.3
    fills = (-3.0, -2.0, -1.0, -1.5, "add", False)
    rows = torch.ops.fuser.attention_kl(q1, k1, q2, k2, keep, 0.25, 0.2, "bottom_right", "bool_keep", True, PLAN,
                                        *fills)[0]
    got = torch.autograd.grad(rows.sum(), (q1, k1, q2, k2))
    leaves = [t.detach().double().requires_grad_() for t in (q1, k1, q2, k2)]
    ref = reference(*leaves, scale1=0.25, scale2=0.2, causal="bottom_right", mask=keep, mask_kind="bool_keep",
                    mask_fill1=-3.0, mask_fill2=-2.0, causal_fill1=-1.0, causal_fill2=-1.5, causal_fill_mode="add")
    assert (rows.double() - ref["rows"]).abs().max() < 1e-4
    for a, b in zip(got, torch.autograd.grad(ref["rows"].sum(), leaves)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4


def test_autograd_through_the_op_zero_hidden():
    # zero_hidden reaches the kernels through the op and its autograd: finfo.min fills on a key
    # padding mask and an added causal fill, the hidden KL terms zeroed (forward and gradients
    # equal the float64 reference; they differ from the full KL)
    from fuser.patterns.attention_kl_reference import reference

    q1, k1, q2, k2 = _inputs(False)
    keep = torch.rand(2, 1, 1, 21, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[1, ..., 15:] = False
    fills = dict(mask_fill1=MIN32 * 0.25, mask_fill2=MIN32 * 0.2, causal_fill1=-1.0, causal_fill2=-1.5,
                 causal_fill_mode="add")
    rows, lse1, _, _ = torch.ops.fuser.attention_kl(q1, k1, q2, k2, keep, 0.25, 0.2, "bottom_right", "bool_keep", True,
                                                    PLAN, *fills.values(), True)
    assert lse1.shape == (4, 2, 4, 21)
    got = torch.autograd.grad(rows.sum(), (q1, k1, q2, k2))
    leaves = [t.detach().double().requires_grad_() for t in (q1, k1, q2, k2)]
    kw = dict(scale1=0.25, scale2=0.2, causal="bottom_right", mask=keep, mask_kind="bool_keep", **fills)
    ref = reference(*leaves, zero_hidden=True, **kw)["rows"]
    assert (rows.double() - ref).abs().max() < 1e-4
    assert (reference(*leaves, **kw)["rows"] - ref).abs().max() > 0.1  # zeroing changes the KL here
    for a, b in zip(got, torch.autograd.grad(ref.sum(), leaves)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4
