"""``torch.library.opcheck`` on the fused attention ops, with contiguous and non-contiguous
(strided) samples: schema, fake (meta) implementation strides, autograd registration, AOT."""

from __future__ import annotations

import pytest
import torch

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.patterns import attention_ops  # noqa: F401

PLAN = "backward=two_kernel;autotune=0"
NEG_INF = float("-inf")
NO_PRED = ("", [], NEG_INF, "replace")  # pred, pred_consts, pred_fill, pred_fill_mode: no predicate
# mask_fill, causal_fill, causal_fill_mode, then the predicate's arguments: today's kernels
HIDE = (NEG_INF, NEG_INF, "replace") + NO_PRED
F32_MIN = torch.finfo(torch.float32).min
WINDOW = "and(ge(1,-1,0),ge(-1,1,1))"  # i - C1 <= j <= i + C0


def _fills(mask_fill=NEG_INF, causal_fill=NEG_INF, causal_fill_mode="replace", pred=NO_PRED):
    return (mask_fill, causal_fill, causal_fill_mode) + tuple(pred)


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


def _mask(mask_kind):
    g = torch.Generator().manual_seed(2)
    if mask_kind == "additive":
        return torch.randn(2, 1, 1, 24, generator=g)
    if mask_kind in ("bool_keep", "bool_drop"):
        return torch.rand(2, 1, 1, 24, generator=g) > 0.2
    return None


# (causal, mask_kind, (mask_fill, causal_fill, causal_fill_mode)): today's variants, then the
# fill variants (two-part statistics [B, H, 2, Nq])
VARIANTS = [
    ("none", "none", HIDE), ("top_left", "none", HIDE), ("none", "additive", HIDE), ("bottom_right", "bool_keep", HIDE),
    ("none", "bool_drop", _fills(-1e4)),
    ("top_left", "none", _fills(NEG_INF, F32_MIN, "add")),
    ("bottom_right", "bool_keep", _fills(-2.0, -3.0, "replace")),
    # index predicates: a sliding window (hidden), with a finite fill, with a boolean mask
    ("none", "none", _fills(pred=(WINDOW, [0, 5], NEG_INF, "replace"))),
    ("none", "none", _fills(pred=(WINDOW, [2, 7], -1.5, "replace"))),
    ("none", "bool_keep", _fills(-2.0, pred=("or(ge(1,-1,0),ge(0,-1,1))", [0, 3], F32_MIN, "add"))),
]
VARIANT_IDS = ["none", "causal", "additive", "bool_keep", "maskfill", "causaladd", "maskfill_causalfill",
               "pred", "predfill", "maskfill_predadd"]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("causal,mask_kind,fills", VARIANTS, ids=VARIANT_IDS)
def test_opcheck_forward(strided, causal, mask_kind, fills):
    q, k, v = _qkv(strided)
    args = (q, k, v, _mask(mask_kind), 0.25, causal, mask_kind, True, PLAN, *fills)
    torch.library.opcheck(torch.ops.fuser.attention.default, args)
    out, lse = torch.ops.fuser.attention(*args)
    two_part = mask_kind == "additive" or fills[:3] != HIDE[:3] or fills[5] != NEG_INF
    assert lse.shape == ((2, 4, 2, 24) if two_part else (2, 4, 24)) and lse.is_contiguous()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("causal,mask_kind,fills", [VARIANTS[1], VARIANTS[2], VARIANTS[6], VARIANTS[7], VARIANTS[9]],
                         ids=["causal", "additive", "maskfill_causalfill", "pred", "maskfill_predadd"])
def test_opcheck_backward(strided, causal, mask_kind, fills):
    q, k, v = _qkv(strided, requires_grad=False)
    mask = _mask(mask_kind)
    out, lse = torch.ops.fuser.attention(q, k, v, mask, 0.25, causal, mask_kind, True, PLAN, *fills)
    dout = torch.randn_like(out)
    if strided:
        dout = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)
    torch.library.opcheck(
        torch.ops.fuser.attention_backward.default,
        (dout, q, k, v, out, lse, mask, 0.25, causal, mask_kind, PLAN, [True, True, True], *fills),
    )


@pytest.mark.parametrize("fills", [HIDE, _fills(-2.0, -3.0, "add")], ids=["hide", "fills"])
def test_autograd_through_the_op(fills):
    # gradients flow to q, k, v only (None for the mask and every non-tensor argument)
    q, k, v = _qkv(False)
    mask = _mask("bool_keep")
    out, _ = torch.ops.fuser.attention(q, k, v, mask, 0.25, "bottom_right", "bool_keep", True, PLAN, *fills)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_inference_forward_returns_empty_lse():
    q, k, v = _qkv(False, requires_grad=False)
    out, lse = torch.ops.fuser.attention(q, k, v, None, 0.25, "none", "none", False, PLAN, *HIDE)
    assert lse.numel() == 0 and out.shape == (2, 4, 24, 16)
    # output laid out [B, N, H, D] in memory, so out.transpose(1, 2) is contiguous
    assert out.transpose(1, 2).is_contiguous()


def test_predicate_through_the_op_matches_reference():
    # the op's text predicate and SymInt constants reach the kernels; gradients through autograd
    from fuser.patterns.attention_reference import reference

    q, k, v = _qkv(False)
    fills = _fills(pred=(WINDOW, [0, 3], NEG_INF, "replace"))
    out, lse = torch.ops.fuser.attention(q, k, v, None, 0.25, "none", "none", True, PLAN, *fills)
    assert lse.shape == (2, 4, 24)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*leaves, scale=0.25, mask_pred=WINDOW, pred_consts=[0, 3])
    assert (out.double() - ref).abs().max() < 1e-5
    out.sum().backward()
    want = torch.autograd.grad(ref.sum(), leaves)
    for t, w in zip((q, k, v), want):
        assert (t.grad.double() - w).abs().max() < 1e-4


def test_predicate_with_causal_is_rejected():
    q, k, v = _qkv(False, requires_grad=False)
    with pytest.raises(ValueError):
        torch.ops.fuser.attention(q, k, v, None, 0.25, "top_left", "none", True, PLAN,
                                  *_fills(pred=(WINDOW, [0, 3], NEG_INF, "replace")))


@pytest.mark.parametrize("needs", [(False, False, True), (True, False, True), (False, True, False)])
def test_saves_only_what_the_backward_needs(needs):
    # dV alone needs q, k and the statistics (P is recomputed), not v or out; gradients as before
    from fuser.patterns.attention_reference import reference

    q, k, v = (t.detach().requires_grad_(n) for t, n in zip(_qkv(False, requires_grad=False), needs))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = torch.ops.fuser.attention(q, k, v, None, 0.25, "top_left", "none", True, PLAN, *HIDE)
    kept = {id(t) for t in saved}
    assert (id(v) in kept) == (needs[0] or needs[1]) and (id(out) in kept) == (needs[0] or needs[1])
    assert id(q) in kept and id(k) in kept
    dout = torch.randn_like(out)
    leaves = [t for t, n in zip((q, k, v), needs) if n]
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_(n) for t, n in zip((q, k, v), needs)]
    want_out, _ = reference(*ref_leaves, scale=0.25, causal="top_left")
    want = torch.autograd.grad(want_out, [t for t in ref_leaves if t.requires_grad], dout.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
