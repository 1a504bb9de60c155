"""Attention kernels (codegen/attention.py + templates) against the float64 reference.

On CPU the kernels run in Triton's interpreter at small, ragged sizes; tests marked ``gpu``
run the compiled kernels at realistic sizes. Every output is allocated poisoned (NaN), so an
element a kernel fails to write shows up.
"""

from __future__ import annotations

import math

import pytest
from _kernel_checks import check_table, compiled_keys, rel_err as _rel
import torch

from fuser.codegen import attention, launch, variants
from fuser.patterns.attention import reference

LOG2E = 1.4426950408889634
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
BWD_MODES = ("two_kernel", "atomic_dq")
CPU = torch.device("cpu")


def _rand(gen, *shape, dtype=torch.float32, device=CPU):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _qkv(seed, b, hq, hkv, n_q, n_k, d, dv, dtype=torch.float32, device=CPU):
    gen = torch.Generator().manual_seed(seed)
    q = _rand(gen, b, hq, n_q, d, dtype=dtype, device=device)
    k = _rand(gen, b, hkv, n_k, d, dtype=dtype, device=device)
    v = _rand(gen, b, hkv, n_k, dv, dtype=dtype, device=device)
    return q, k, v


def _check(
    q, k, v, *, causal="none", mask=None, mask_kind="none", scale=None, need_lse=True,
    grad=True, modes=BWD_MODES, needs_grad=(True, True, True), config=None, bwd_config=None,
    dout=None, tol=None, seed=0, mask_fill=-math.inf, causal_fill=-math.inf, causal_fill_mode="replace",
    mask_pred=None, pred_consts=(), pred_fill=-math.inf, pred_fill_mode="replace",
):
    """Forward (and backward in each mode) against the reference; returns (out, lse, grads by mode)."""
    dtype = q.dtype
    tol = TOL[dtype] if tol is None else tol
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kw = dict(scale=scale, causal=causal, mask=mask, mask_kind=mask_kind, mask_fill=mask_fill,
              causal_fill=causal_fill, causal_fill_mode=causal_fill_mode)
    if mask_pred is not None:
        kw.update(mask_pred=mask_pred, pred_consts=pred_consts, pred_fill=pred_fill, pred_fill_mode=pred_fill_mode)
    with launch.poison_outputs():
        out, lse = attention.forward(q, k, v, need_lse=need_lse or grad, config=config, **kw)
    ref_out, ref_lse = reference(q, k, v, **kw)

    assert out.shape == ref_out.shape and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous(), "out must be [B, N, H, Dv] memory"
    assert not out.isnan().any()
    err = _rel(out, ref_out)
    assert err < tol, f"out: relative error {err:.3g} >= {tol}"

    if not (need_lse or grad):
        assert lse is None
    else:
        _check_stats(lse, ref_lse, k.shape[2], dtype, attention.two_part_stats(
            causal=causal, mask_kind=mask_kind, mask_fill=mask_fill, causal_fill=causal_fill,
            causal_fill_mode=causal_fill_mode, mask_pred=mask_pred, pred_fill=pred_fill, pred_fill_mode=pred_fill_mode))
        empty = torch.isneginf(ref_lse)
        assert (out[empty.unsqueeze(-1).expand_as(out)] == 0).all(), "empty rows must give out = 0"

    grads = {}
    if grad:
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        r_out, _ = reference(*leaves, **kw)
        if dout is None:
            gen = torch.Generator().manual_seed(seed + 1)
            dout = _rand(gen, *r_out.shape, dtype=dtype, device=q.device)
        ref_grads = torch.autograd.grad(r_out, leaves, dout.double())
        for mode in modes:
            with launch.poison_outputs():
                got = attention.backward(
                    dout, q, k, v, out, lse, bwd_mode=mode, needs_grad=needs_grad, config=bwd_config, **kw
                )
            grads[mode] = got
            for name, g, rg, t, need in zip("qkv", got, ref_grads, (q, k, v), needs_grad):
                if not need:
                    assert g is None, f"d{name} not asked for but returned ({mode})"
                    continue
                assert g.shape == t.shape and g.dtype == t.dtype, f"d{name} ({mode})"
                assert not g.isnan().any(), f"d{name} has NaN ({mode})"
                e = _rel(g, rg)
                assert e < tol, f"d{name} ({mode}): relative error {e:.3g} >= {tol}"
    return out, lse, grads


def _check_stats(lse, ref_lse, n_k, dtype, two_part):
    """The forward's softmax statistics against the reference's natural-log LSE: one base-2 LSE
    ``[B, H, Nq]`` (``+inf`` on rows with no visible key), or two-part ``[B, H, 2, Nq]`` (row max
    m2, log2 l; ``+inf``, ``0`` on rows whose scores are all -inf)."""
    assert lse.dtype == torch.float32 and lse.is_contiguous() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)
    abs_tol = 1e-4 if dtype == torch.float32 else 2e-3
    if not two_part:
        assert lse.shape == ref_lse.shape
        assert torch.isposinf(lse[empty]).all(), "rows with no visible key must store LSE = +inf"
        assert torch.isfinite(lse[~empty]).all()
        got = lse.double() / LOG2E
    else:
        assert lse.shape == (*ref_lse.shape[:2], 2, ref_lse.shape[2])
        row_max, log2_l = lse[:, :, 0], lse[:, :, 1]
        assert torch.isposinf(row_max[empty]).all() and (log2_l[empty] == 0).all(), "all -inf rows: m2 = +inf, log2 l = 0"
        assert torch.isfinite(row_max[~empty]).all() and torch.isfinite(log2_l[~empty]).all()
        assert (log2_l[~empty] >= 0).all() and (log2_l[~empty] <= math.log2(n_k) + 1e-3).all()
        got = (row_max.double() + log2_l.double()) / LOG2E
    # A row whose max is a huge finite value (finfo.min fills): base 2 holds at most about
    # -2.35e38 in natural units (fills below are held there), so only its sign and size are checked.
    huge = ~empty & (ref_lse.abs() > 1e30)
    assert (got[huge] < -1e38).all()
    normal = ~empty & ~huge
    if normal.any():
        # relative to the row's magnitude: scores around -1e4 carry float32 rounding of ~1e-3
        err = ((got[normal] - ref_lse[normal]).abs() / (1 + 1e-2 * ref_lse[normal].abs())).max().item()
        assert err < abs_tol, f"lse error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# Interpreter tests (CPU)
# ---------------------------------------------------------------------------------------------

SHAPES = [
    # id, B, Hq, Hkv, Nq, Nk, D, Dv, causal
    ("ragged_dv", 2, 2, 2, 37, 50, 24, 40, "none"),
    ("top_left_q<k", 1, 2, 2, 50, 67, 32, 32, "top_left"),
    ("top_left_q>k", 1, 2, 2, 67, 37, 32, 16, "top_left"),
    ("bottom_right_q<k", 2, 2, 2, 37, 67, 32, 32, "bottom_right"),
    ("bottom_right_q>k_empty_rows", 2, 2, 2, 67, 37, 16, 32, "bottom_right"),
    ("d80", 1, 2, 2, 40, 33, 80, 80, "none"),
    ("d96_dv64_bottom_right", 1, 2, 2, 33, 40, 96, 64, "bottom_right"),
    ("gqa_4_2_top_left", 2, 4, 2, 37, 50, 32, 32, "top_left"),
    ("mqa_4_1_bottom_right", 1, 4, 1, 45, 45, 32, 24, "bottom_right"),
    ("single_query", 2, 2, 1, 1, 67, 32, 32, "bottom_right"),
]


@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
def test_fp32_forward_backward(case):
    _, b, hq, hkv, n_q, n_k, d, dv, causal = case
    q, k, v = _qkv(SHAPES.index(case), b, hq, hkv, n_q, n_k, d, dv)
    out, lse, _ = _check(q, k, v, causal=causal)
    if case[0] == "bottom_right_q>k_empty_rows":
        # the first Nq - Nk rows see no key: out 0, LSE +inf
        assert (out[:, :, : n_q - n_k] == 0).all()
        assert torch.isposinf(lse[:, :, : n_q - n_k]).all()


@pytest.mark.parametrize("causal", ["none", "top_left"])
def test_fp16(causal):
    q, k, v = _qkv(11, 2, 4, 2, 67, 53, 64, 48, dtype=torch.float16)
    _check(q, k, v, causal=causal)


def test_bf16_interpreter_upcast():
    # the interpreter's bf16 tl.dot is wrong; interpreted kernels upcast dot operands to fp32
    q, k, v = _qkv(12, 1, 2, 1, 37, 50, 32, 32, dtype=torch.bfloat16)
    _check(q, k, v, causal="bottom_right")


def test_non_default_configs():
    q, k, v = _qkv(13, 1, 2, 2, 50, 45, 32, 32)
    fwd = attention.candidate_configs(head_dim=32, head_dim_v=32, dtype=q.dtype, device=q.device, kind="fwd")
    bwd = attention.candidate_configs(head_dim=32, head_dim_v=32, dtype=q.dtype, device=q.device, kind="bwd")
    for fc, bc in zip(fwd[1:], bwd[1:] + bwd[:1]):
        _check(q, k, v, causal="top_left", config=fc, bwd_config=bc)


@pytest.mark.parametrize("scale", [0.37, -0.5, 0.0])
def test_scale(scale):
    # a positive scale is folded into the exp2 argument; zero and negative scales take the plain path
    q, k, v = _qkv(14, 1, 2, 2, 29, 41, 32, 32)
    _check(q, k, v, scale=scale, causal="bottom_right", modes=("two_kernel",))


# --- masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool_keep", "bool_drop"])
def test_key_padding_with_fully_masked_batch(kind):
    b, h, n_q, n_k = 2, 2, 37, 50
    q, k, v = _qkv(21, b, h, h, n_q, n_k, 32, 32)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., 41:] = False  # padded keys
    keep[0, ..., 3] = False
    keep[1] = False  # every key of batch 1 is hidden
    mask = keep if kind == "bool_keep" else ~keep
    causal = "none" if kind == "bool_keep" else "top_left"
    out, lse, grads = _check(q, k, v, mask=mask, mask_kind=kind, causal=causal)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    for mode, (dq, dk, dv) in grads.items():
        assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all(), mode


def test_bool_mask_full_tile_2d():
    # a 2-D [Nq, Nk] mask (not row-broadcast) with some rows entirely hidden
    n_q, n_k = 45, 50
    q, k, v = _qkv(22, 2, 2, 1, n_q, n_k, 32, 32)
    gen = torch.Generator().manual_seed(5)
    keep = torch.rand(n_q, n_k, generator=gen) > 0.3
    keep[7] = False
    keep[40] = False
    _check(q, k, v, mask=keep, mask_kind="bool_keep", causal="bottom_right")


def test_additive_bias_per_head():
    b, h, n_q, n_k = 2, 2, 37, 50
    q, k, v = _qkv(23, b, h, h, n_q, n_k, 24, 24)
    bias = 2.0 * torch.randn(b, h, n_q, n_k, generator=torch.Generator().manual_seed(6))
    _check(q, k, v, mask=bias, mask_kind="additive")


def test_additive_bias_broadcast_with_causal():
    n_q, n_k = 50, 50
    q, k, v = _qkv(24, 2, 4, 2, n_q, n_k, 32, 32)
    bias = torch.randn(1, 1, n_q, n_k, generator=torch.Generator().manual_seed(7))
    _check(q, k, v, mask=bias, mask_kind="additive", causal="top_left")


def test_additive_mask_with_neg_inf_and_finfo_min():
    b, h, n_q, n_k = 2, 2, 37, 50
    q, k, v = _qkv(25, b, h, h, n_q, n_k, 32, 32)
    gen = torch.Generator().manual_seed(8)
    bias = torch.randn(b, 1, n_q, n_k, generator=gen)
    pick = torch.rand(b, 1, n_q, n_k, generator=gen)
    bias[pick < 0.2] = -math.inf
    bias[(pick >= 0.2) & (pick < 0.4)] = torch.finfo(torch.float32).min
    bias[0, 0, 3] = -math.inf  # a row with no visible key: out 0
    bias[0, 0, 5] = torch.finfo(torch.float32).min  # finite everywhere: a uniform average
    bias[1, 0, :, 20:] = -math.inf  # key padding spelled additively
    # Row 5 of batch 0 has its max at finfo.min + O(1): the two-part statistics keep log2 l
    # beside it, so the backward's P is exact there too (1/Nk: the gradients of eager).
    out, lse, grads = _check(q, k, v, mask=bias, mask_kind="additive")
    assert (out[0, :, 3] == 0).all()
    assert lse.shape == (b, h, 2, n_q) and (lse[0, :, 1, 5] - math.log2(n_k)).abs().max() < 1e-5


def test_additive_key_padding_low_precision_mask():
    # row-broadcast additive mask in another float dtype than the inputs
    b, h, n_q, n_k = 2, 2, 33, 47
    q, k, v = _qkv(26, b, h, h, n_q, n_k, 32, 32)
    bias = torch.zeros(b, 1, 1, n_k, dtype=torch.float16)
    bias[0, ..., 30:] = torch.finfo(torch.float16).min
    bias[1, ..., :5] = -math.inf
    bias[1, ..., 10:12] = 1.5
    _check(q, k, v, mask=bias, mask_kind="additive", causal="bottom_right")


# --- hidden-entry values (fills) ---------------------------------------------------------------

F32_MIN = torch.finfo(torch.float32).min


def _near_scores(seed, b, h, n_q, n_k, d, dv, center, spread=0.003):
    """q, k, v with q.k close to ``center`` (spread ~``spread``): at scale 1000 the scores lie
    around ``1000 * center``, a few units apart (the adversarial scale of the spec)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.ones(d) / math.sqrt(d)
    q = 2.0 * u + spread * torch.randn(b, h, n_q, d, generator=gen)
    k = (center / 2.0) * u + spread * torch.randn(b, h, n_k, d, generator=gen)
    v = torch.randn(b, h, n_k, dv, generator=gen)
    return q, k, v


@pytest.mark.parametrize("kind", ["bool_drop", "bool_keep"])
def test_mask_fill_wins_over_lower_scores(kind):
    # scores around -2e4, mask_fill = -1e4: the filled (hidden) entries carry the whole softmax,
    # so each row is the uniform average of v over its hidden keys (what eager computes for
    # masked_fill(m, -1e4)); treating them as hidden would give the average over the visible keys.
    b, h, n_q, n_k = 1, 2, 37, 45
    q, k, v = _near_scores(41, b, h, n_q, n_k, 32, 24, center=-20.0)
    gen = torch.Generator().manual_seed(42)
    drop = torch.rand(b, 1, n_q, n_k, generator=gen) < 0.3
    drop[..., 0] = True  # every row has a hidden key
    mask = drop if kind == "bool_drop" else ~drop
    out, lse, grads = _check(q, k, v, mask=mask, mask_kind=kind, scale=1000.0, mask_fill=-1e4)
    want = (drop.double() @ v.double()) / drop.sum(-1, keepdim=True)
    assert _rel(out, want) < 1e-5
    skip, _ = reference(q, k, v, scale=1000.0, mask=mask, mask_kind=kind)  # the -inf semantics
    assert _rel(skip, want) > 0.5, "the test must tell a finite fill from hiding"
    for mode, (dq, dk, dv) in grads.items():
        # the filled entries are constants and the visible ones get P = 0: no gradient to q, k
        assert dq.abs().max() < 1e-6 and dk.abs().max() < 1e-6, mode


def test_mask_fill_mixes_with_visible_scores():
    # scores about -1e4 +- a few, mask_fill = -1e4: filled and visible entries share each row
    b, h, n_q, n_k = 2, 2, 33, 40
    q, k, v = _near_scores(43, b, h, n_q, n_k, 16, 16, center=-10.0)
    gen = torch.Generator().manual_seed(44)
    keep = torch.rand(b, 1, 1, n_k, generator=gen) > 0.4  # key padding, row-broadcast
    fill = -1e4
    out, _, _ = _check(q, k, v, mask=keep, mask_kind="bool_keep", scale=1000.0, mask_fill=fill,
                       causal="bottom_right", tol=5e-3)
    ref, _ = reference(q, k, v, scale=1000.0, mask=keep, mask_kind="bool_keep", mask_fill=fill, causal="bottom_right")
    p = torch.softmax((q.double() @ k.double().mT * 1000.0).masked_fill(~keep, fill), -1)
    row_weight = p.masked_fill(keep, 0).sum(-1)  # the weight the fill carries per row
    assert row_weight.max() > 0.2, "the fill must carry weight in some rows"


@pytest.mark.parametrize("fill", [-3.0, F32_MIN], ids=["fill-3", "finfo_min"])
def test_fully_filled_rows(fill):
    # rows and a whole batch whose every key is hidden by a mask with a finite fill: eager gives
    # the uniform average of v (all scores equal the fill) and its gradients
    b, h, n_q, n_k = 2, 2, 29, 37
    q, k, v = _qkv(45, b, h, 1, n_q, n_k, 32, 32)
    gen = torch.Generator().manual_seed(46)
    keep = torch.rand(b, h, n_q, n_k, generator=gen) > 0.3
    keep[0, :, 4] = False
    keep[1] = False
    out, lse, grads = _check(q, k, v, mask=keep, mask_kind="bool_keep", mask_fill=fill)
    mean_v = v.double().mean(2, keepdim=True)
    assert _rel(out[1], mean_v[1].expand(h, n_q, -1)) < 1e-5
    assert (lse[1, :, 1] - math.log2(n_k)).abs().max() < 1e-5  # log2 l of a uniform row
    for mode, (dq, dk, dv) in grads.items():
        # constant scores everywhere in batch 1: no gradient to q, k; dv = dO averaged
        assert dq[1].abs().max() < 1e-6 and dk[1].abs().max() < 1e-6, mode


def test_neg_inf_fills_are_todays_kernels():
    # -inf fills (the defaults) render the very same kernels and give the same bits
    q, k, v = _qkv(47, 1, 2, 2, 37, 29, 32, 32)
    keep = torch.rand(1, 1, 37, 29, generator=torch.Generator().manual_seed(48)) > 0.3
    keep[0, 0, 5] = False
    kw = dict(scale=0.3, causal="bottom_right", mask=keep, mask_kind="bool_keep")
    a = attention.fwd_kernel(causal="bottom_right", mask_kind="bool_keep", mask_row_broadcast=False, need_lse=True,
                             interpret=True)
    b = attention.fwd_kernel(causal="bottom_right", mask_kind="bool_keep", mask_row_broadcast=False, need_lse=True,
                             interpret=True, mask_fill=-math.inf, causal_fill=-math.inf, causal_fill_mode="add")
    assert a is b
    out0, lse0 = attention.forward(q, k, v, **kw)
    out1, lse1 = attention.forward(q, k, v, mask_fill=-math.inf, causal_fill=-math.inf, causal_fill_mode="add", **kw)
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1) and lse0.shape == (1, 2, 37)
    # rows with no visible key: 0, never NaN, as before
    _check(q, k, v, mask_fill=-math.inf, causal_fill=-math.inf, **kw)


CAUSAL_FILL_CASES = [
    # id, Hq, Hkv, Nq, Nk, causal, fill, mode
    ("replace_q>k_bottom_right", 2, 2, 45, 29, "bottom_right", -2.0, "replace"),
    ("replace_q<k_top_left_gqa", 4, 2, 29, 50, "top_left", -1.0, "replace"),
    ("add_q>k_bottom_right_finfo_min", 2, 1, 45, 29, "bottom_right", F32_MIN, "add"),
    ("add_q<k_top_left", 2, 2, 29, 45, "top_left", -1.5, "add"),
    ("add_q>k_top_left_gqa", 4, 2, 50, 37, "top_left", -0.5, "add"),
]


@pytest.mark.parametrize("case", CAUSAL_FILL_CASES, ids=[c[0] for c in CAUSAL_FILL_CASES])
def test_causal_fill(case):
    _, hq, hkv, n_q, n_k, causal, fill, mode = case
    q, k, v = _qkv(CAUSAL_FILL_CASES.index(case) + 50, 2, hq, hkv, n_q, n_k, 32, 24)
    out, lse, _ = _check(q, k, v, causal=causal, causal_fill=fill, causal_fill_mode=mode, scale=0.5)
    assert lse.shape == (2, hq, 2, n_q)
    if n_q > n_k and causal == "bottom_right":
        # the first Nq - Nk rows have no visible key: every score is the (added) fill
        rows = out[:, :, : n_q - n_k].double()
        if mode == "replace" or fill == F32_MIN:  # constant scores (finfo.min swallows s): uniform
            want = v.double().mean(2, keepdim=True).repeat_interleave(hq // hkv, 1)
            assert _rel(rows, want.expand_as(rows)) < 1e-5


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_causal_and_mask_fills_combined(mode):
    # boolean mask with a finite fill, then the causal fill on top (order: mask, then causal)
    b, h, n_q, n_k = 2, 2, 40, 33
    q, k, v = _qkv(56, b, h, 1, n_q, n_k, 16, 32)
    gen = torch.Generator().manual_seed(57)
    drop = torch.rand(b, 1, 1, n_k, generator=gen) < 0.3  # row-broadcast padding
    drop[1] = True  # every key of batch 1 hidden
    _check(q, k, v, mask=drop, mask_kind="bool_drop", mask_fill=-0.5, causal="bottom_right",
           causal_fill=F32_MIN if mode == "add" else -4.0, causal_fill_mode=mode)


def test_causal_fill_with_additive_mask():
    # transformers: a padding mask of finfo.min summed with an additive finfo.min causal mask
    b, h, n_q, n_k = 2, 2, 37, 29
    q, k, v = _qkv(58, b, h, h, n_q, n_k, 32, 32)
    pad = torch.zeros(b, 1, 1, n_k)
    pad[0, ..., 20:] = F32_MIN
    pad[1] = F32_MIN  # batch 1 fully padded
    out, lse, _ = _check(q, k, v, mask=pad, mask_kind="additive", causal="bottom_right",
                         causal_fill=F32_MIN, causal_fill_mode="add")
    assert not out.isnan().any()


def test_hidden_tiles_skippable_bound():
    # the run-time proof that tiles above the diagonal add exactly 0 (see its docstring)
    q, k, _ = _qkv(63, 1, 2, 2, 40, 40, 32, 32)

    def flag(qq=q, kk=k, scale=0.5, fill=F32_MIN, mode="add", offset=0):
        return int(attention.hidden_tiles_skippable(qq, kk, scale=scale, causal_fill=fill, causal_fill_mode=mode,
                                                    causal_offset=offset))

    assert flag() == 1 and flag(mode="replace") == 1 and flag(fill=-1e4, mode="replace") == 1
    assert flag(fill=-2.0) == 0 and flag(fill=-2.0, mode="replace") == 0  # small fills: hidden keys weigh
    assert flag(fill=1.0) == 0  # a positive "fill" boosts the hidden keys
    assert flag(offset=-3) == 0  # bottom-right with Nq > Nk: rows with no visible key
    assert flag(scale=1e37) == 0  # scores near finfo.max: finfo.min no longer hides them
    assert flag(scale=1e36) == 1  # scores ~1e37 stay ~30x below it: still exact
    assert flag(qq=q * 1e20) == 0  # the norms overflow float32: no proof
    bad = q.clone()
    bad[0, 0, 3, 1] = float("nan")
    assert flag(qq=bad) == 0
    # the bound holds for the worst scores: |s| ≤ |scale|·max‖q‖·max‖k‖, with a 200 (base 2) margin
    s_max = 0.5 * q.norm(dim=-1).max().item() * k.norm(dim=-1).max().item()
    edge = -(2 * s_max + attention.SKIP_MARGIN_BASE2 / attention.LOG2E)
    assert flag(fill=edge * 1.01) == 1 and flag(fill=edge * 0.99) == 0


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_causal_fill_skips_tiles_only_when_proven(monkeypatch, mode):
    # A small fill (-2) keeps the keys above the diagonal in play: the guard must refuse the skip
    # and the kernels match the fill's reference. Forcing the flag shows what the kernels skip:
    # with 16x16 tiles everywhere, row i (block p = i // 16) drops the keys j >= 16 (p + 1); the
    # entries above the diagonal inside its diagonal tile keep the fill.
    n, blk = 70, 16
    q, k, v = _qkv(64, 1, 2, 2, n, n, 16, 16)
    kw = dict(scale=0.5, causal="top_left", causal_fill=-2.0, causal_fill_mode=mode)
    fwd_cfg = {"BLOCK_M": blk, "BLOCK_N": blk, "num_warps": 4, "num_stages": 1}
    bwd_cfg = {"BLOCK_M1": blk, "BLOCK_N1": blk, "BLOCK_M2": blk, "BLOCK_N2": blk, "PRE_BLOCK_M": blk,
               "num_warps": 4, "num_stages": 1}
    _check(q, k, v, config=fwd_cfg, bwd_config=bwd_cfg, **kw)

    def expected(q, k, v):  # float64: fill above the diagonal, then the skipped keys removed
        s = q @ k.mT * 0.5
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        above = j > i
        s = torch.where(above, -2.0 if mode == "replace" else s - 2.0, s)
        s = s.masked_fill(j >= (i // blk + 1) * blk, float("-inf"))
        return torch.softmax(s, -1) @ v

    calls = []

    def always(q, k, **_):
        calls.append(1)
        return torch.ones((), dtype=torch.int32, device=q.device)

    monkeypatch.setattr(attention, "hidden_tiles_skippable", always)
    check_forced_skip(q, k, v, kw, fwd_cfg, bwd_cfg, expected, calls)


def check_forced_skip(q, k, v, kw: dict, fwd_cfg: dict, bwd_cfg: dict, expected, calls: list) -> None:
    """With a skip flag forced on (the caller's monkeypatch, which appends to ``calls``): the
    forward and both backwards (outputs poisoned) equal ``expected(q, k, v)`` in float64 — the
    attention without the keys the kernels skip — which differs from the unskipped reference."""
    with launch.poison_outputs():
        out, lse = attention.forward(q, k, v, config=fwd_cfg, **kw)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want_out = expected(*leaves)
    unskipped, _ = reference(*(t.double() for t in (q, k, v)), **kw)
    assert calls and _rel(out, want_out) < 1e-5 and _rel(unskipped, want_out) > 1e-2
    dout = torch.randn_like(out)
    want = torch.autograd.grad(want_out, leaves, dout.double())
    for bwd_mode in attention.BWD_MODES:
        with launch.poison_outputs():
            got = attention.backward(dout, q, k, v, out, lse, bwd_mode=bwd_mode, config=bwd_cfg, **kw)
        errs = [_rel(g, w) for g, w in zip(got, want)]
        assert max(errs) < 1e-5, (bwd_mode, errs)


def test_fills_fp16_and_needs_grad_subsets():
    q, k, v = _qkv(59, 1, 4, 2, 45, 37, 32, 32, dtype=torch.float16)
    keep = torch.rand(1, 4, 45, 37, generator=torch.Generator().manual_seed(60)) > 0.3
    keep[0, 1, 7] = False
    kw = dict(mask=keep, mask_kind="bool_keep", mask_fill=-1.0, causal="top_left", causal_fill=-2.0)
    _check(q, k, v, **kw)
    for needs in ((True, False, False), (False, True, False), (False, False, True)):
        _check(q, k, v, needs_grad=needs, modes=("atomic_dq",), **kw)


def test_reference_matches_eager_spellings():
    # the reference's fill semantics are what users write in eager PyTorch (float64 here)
    g = torch.Generator().manual_seed(61)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64) for n in (23, 31, 31))
    s = q @ k.mT * 0.4
    drop = torch.rand(2, 1, 23, 31, generator=g) < 0.4
    drop[0, 0, 3] = True
    for fill in (-1e4, -2.0, F32_MIN):
        eager = torch.softmax(s.masked_fill(drop, fill), -1) @ v
        ref, _ = reference(q, k, v, scale=0.4, mask=drop, mask_kind="bool_drop", mask_fill=fill)
        assert _rel(ref, eager) < 1e-12
        eager = torch.softmax(torch.where(~drop, s, fill), -1) @ v
        ref, _ = reference(q, k, v, scale=0.4, mask=~drop, mask_kind="bool_keep", mask_fill=fill)
        assert _rel(ref, eager) < 1e-12
    # transformers-style additive causal mask (bottom-right, Nq > Nk: rows with no visible key)
    qq = torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64)
    s = qq @ k.mT * 0.4
    i, j = torch.arange(40)[:, None], torch.arange(31)[None, :]
    allowed = j <= i + (31 - 40)
    for fill in (F32_MIN, -3.0):
        eager = torch.softmax(s + torch.where(allowed, 0.0, fill), -1) @ v
        ref, _ = reference(qq, k, v, scale=0.4, causal="bottom_right", causal_fill=fill, causal_fill_mode="add")
        assert _rel(ref, eager) < 1e-12
        eager = torch.softmax(s.masked_fill(~allowed, fill), -1) @ v
        ref, _ = reference(qq, k, v, scale=0.4, causal="bottom_right", causal_fill=fill)
        assert _rel(ref, eager) < 1e-12
    # gradients: torch.where(m, s, fill) gives no gradient to s where the fill replaces it
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*leaves, scale=0.4, mask=drop, mask_kind="bool_drop", mask_fill=-2.0)
    got = torch.autograd.grad(ref.sum(), leaves)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = torch.softmax((leaves2[0] @ leaves2[1].mT * 0.4).masked_fill(drop, -2.0), -1) @ leaves2[2]
    want = torch.autograd.grad(eager.sum(), leaves2)
    assert all(_rel(a, b) < 1e-12 for a, b in zip(got, want))


def test_rejects_bad_fills():
    q, k, v = _qkv(62, 1, 2, 2, 8, 8, 16, 16)
    keep = torch.ones(8, 8, dtype=torch.bool)
    for kw in (dict(mask=keep, mask_kind="bool_keep", mask_fill=math.nan),
               dict(mask=keep, mask_kind="bool_keep", mask_fill=math.inf),
               dict(causal="top_left", causal_fill=math.inf),
               dict(causal="top_left", causal_fill=-1.0, causal_fill_mode="multiply")):
        with pytest.raises(ValueError):
            attention.forward(q, k, v, scale=1.0, **kw)
    out, lse = attention.forward(q, k, v, scale=1.0, causal="top_left")
    with pytest.raises(ValueError):  # a single LSE given to a two-part variant's backward
        attention.backward(torch.randn_like(out), q, k, v, out, lse, scale=1.0, causal="top_left", causal_fill=-1.0)


# --- index predicates (codegen/predicate.py) ----------------------------------------------------

WINDOW = ("and", ("atom", 1, -1, 0), ("atom", -1, 1, 1))  # i - C1 <= j <= i + C0
PREFIX_LM = ("or", ("atom", 1, -1, 0), ("atom", 0, -1, 1))  # j <= i + C0 or j <= C1
KEY_LIMIT = ("atom", 0, -1, 0)  # j <= C0 (j < L with C0 = L - 1)


def _window(w: int, offset: int = 0) -> tuple:
    """Sliding window of width w on the diagonal j <= i + offset: i + offset - w < j <= i + offset."""
    return WINDOW, (offset, w - 1 - offset)


@pytest.mark.parametrize("w", [1, 7, 200], ids=["w1", "w7", "wider_than_n"])
def test_predicate_sliding_window(w):
    q, k, v = _qkv(70 + w, 1, 2, 2, 45, 37, 32, 24)
    pred, consts = _window(w)
    out, lse, _ = _check(q, k, v, mask_pred=pred, pred_consts=consts)
    assert lse.shape == (1, 2, 45)  # hidden (-inf) drops: one LSE, as today
    if w == 200:  # the causal kernel's semantics exactly (top-left)
        ref, _ = reference(q, k, v, scale=32 ** -0.5, causal="top_left")
        assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("n_q,n_k", [(50, 29), (29, 50)], ids=["q>k", "q<k"])
def test_predicate_window_bottom_right_gqa(n_q, n_k):
    # j <= i + Nk - Nq and j > i + Nk - Nq - w: constants from the sizes; rows with no key give 0
    q, k, v = _qkv(72, 2, 4, 2, n_q, n_k, 32, 32)
    pred, consts = _window(6, offset=n_k - n_q)
    out, lse, grads = _check(q, k, v, mask_pred=pred, pred_consts=consts)
    if n_q > n_k:
        assert (out[:, :, : n_q - n_k] == 0).all() and torch.isposinf(lse[:, :, : n_q - n_k]).all()
        for dq, _, _ in grads.values():
            assert (dq[:, :, : n_q - n_k] == 0).all()


def test_predicate_prefix_lm_and_band():
    q, k, v = _qkv(73, 1, 2, 1, 53, 53, 32, 32)
    _check(q, k, v, mask_pred=PREFIX_LM, pred_consts=(0, 19))  # bidirectional prefix of 20 keys
    # |i - j| <= 5 as two atoms: i - j + 5 >= 0 and j - i + 5 >= 0
    _check(q, k, v, mask_pred=WINDOW, pred_consts=(5, 5), modes=("atomic_dq",))


def test_predicate_key_limit_and_strided_atoms():
    # j < L with L < Nk; 2 j <= i + 3 (|b| = 2: floor division on negative bounds)
    q, k, v = _qkv(74, 2, 2, 2, 37, 45, 16, 16)
    _check(q, k, v, mask_pred=KEY_LIMIT, pred_consts=(30,))
    _check(q, k, v, mask_pred=("and", ("atom", 1, -2, 0), ("atom", -1, 2, 1)), pred_consts=(3, 20))


def test_predicate_always_false_rows_give_zero():
    q, k, v = _qkv(75, 1, 2, 2, 29, 33, 32, 32)
    for pred, consts in ((("false",), ()), (("atom", 0, 0, 0), (-1,))):  # false, and false at run time
        out, lse, grads = _check(q, k, v, mask_pred=pred, pred_consts=consts, modes=("two_kernel",))
        assert (out == 0).all() and torch.isposinf(lse).all()
        assert all((g == 0).all() for g in grads["two_kernel"])


def test_predicate_with_masks():
    # order: additive mask, boolean mask (with its fill), then the predicate
    b, h, n_q, n_k = 2, 2, 41, 35
    q, k, v = _qkv(76, b, h, h, n_q, n_k, 32, 32)
    gen = torch.Generator().manual_seed(77)
    keep = torch.rand(b, 1, 1, n_k, generator=gen) > 0.2
    pred, consts = _window(9)
    _check(q, k, v, mask=keep, mask_kind="bool_keep", mask_pred=pred, pred_consts=consts)
    _check(q, k, v, mask=~keep, mask_kind="bool_drop", mask_fill=-2.0, mask_pred=pred, pred_consts=consts,
           pred_fill=-1.0, modes=("atomic_dq",))
    bias = torch.randn(b, h, n_q, n_k, generator=gen)
    _check(q, k, v, mask=bias, mask_kind="additive", mask_pred=PREFIX_LM, pred_consts=(0, 4), modes=("two_kernel",))


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_predicate_finite_fill(mode):
    # a finite pred_fill: every tile visited, the fill applied per element, two-part statistics;
    # rows past the window's end (Nq > Nk, bottom-right) have every key filled: uniform average
    q, k, v = _qkv(78, 2, 4, 2, 45, 29, 32, 24)
    pred, consts = _window(5, offset=29 - 45)
    fill = -2.0 if mode == "replace" else F32_MIN
    out, lse, grads = _check(q, k, v, mask_pred=pred, pred_consts=consts, pred_fill=fill, pred_fill_mode=mode,
                             scale=0.5)
    assert lse.shape == (2, 4, 2, 45)
    rows = out[:, :, : 45 - 29].double()
    want = v.double().mean(2, keepdim=True).repeat_interleave(2, 1)
    assert _rel(rows, want.expand_as(rows)) < 1e-5
    if mode == "replace":  # constant scores in those rows: no gradient to q there
        for dq, _, _ in grads.values():
            assert dq[:, :, : 45 - 29].abs().max() < 1e-6


def test_predicate_fill_wins_over_lower_scores():
    # scores around -2e4, pred_fill = -1e4: the dropped keys carry the whole softmax (what eager
    # gives for torch.where(window, s, -1e4)); hiding them instead would be far off
    b, h, n_q, n_k = 1, 2, 37, 45
    q, k, v = _near_scores(79, b, h, n_q, n_k, 32, 24, center=-20.0)
    pred, consts = _window(4)
    out, _, grads = _check(q, k, v, scale=1000.0, mask_pred=pred, pred_consts=consts, pred_fill=-1e4)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    dropped = ~((j <= i) & (j > i - 4))
    want = (dropped.double() @ v.double()) / dropped.sum(-1, keepdim=True)
    assert _rel(out, want) < 1e-5
    skip, _ = reference(q, k, v, scale=1000.0, mask_pred=pred, pred_consts=consts)
    assert _rel(skip, want) > 0.5


def test_predicate_fp16():
    q, k, v = _qkv(80, 2, 4, 2, 67, 53, 64, 48, dtype=torch.float16)
    pred, consts = _window(13, offset=53 - 67)
    _check(q, k, v, mask_pred=pred, pred_consts=consts)
    _check(q, k, v, mask_pred=PREFIX_LM, pred_consts=(0, 9), pred_fill=-3.0, pred_fill_mode="add", modes=("two_kernel",))


def test_predicate_reference_matches_eager():
    # the reference's predicate semantics are what users write in eager PyTorch (float64)
    g = torch.Generator().manual_seed(81)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for n in (23, 31, 31))
    s = q @ k.mT * 0.4
    i, j = torch.arange(23)[:, None], torch.arange(31)[None, :]
    window = (j <= i + 8) & (j > i + 8 - 5)  # bottom-right window of 5
    for fill in (-math.inf, -1e4, F32_MIN):
        eager = torch.softmax(s.masked_fill(~window, fill), -1) @ v
        if fill == -math.inf:
            eager = torch.nan_to_num(eager)  # rows with no key: eager NaN, the reference 0
        ref, _ = reference(q, k, v, scale=0.4, mask_pred="and(ge(1,-1,0),ge(-1,1,1))", pred_consts=(8, 4 - 8),
                           pred_fill=fill)
        assert _rel(ref, eager) < 1e-12
    eager = torch.softmax(s + torch.where(j < 20, 0.0, -3.0), -1) @ v
    ref, _ = reference(q, k, v, scale=0.4, mask_pred=KEY_LIMIT, pred_consts=(19,), pred_fill=-3.0, pred_fill_mode="add")
    assert _rel(ref, eager) < 1e-12


def test_predicate_rejects_bad_arguments():
    q, k, v = _qkv(82, 1, 2, 2, 8, 8, 16, 16)
    for kw in (dict(causal="top_left", mask_pred=WINDOW, pred_consts=(0, 2)),  # fold causal into the predicate
               dict(mask_pred=WINDOW, pred_consts=(0,)),  # too few constants
               dict(mask_pred=WINDOW, pred_consts=(0, 2), pred_fill=math.nan),
               dict(mask_pred=WINDOW, pred_consts=(0, 2), pred_fill=-1.0, pred_fill_mode="multiply"),
               dict(mask_pred="and(ge(1,-1,0)", pred_consts=(0,)),
               dict(mask_pred=("not", ("true",)), pred_consts=())):
        with pytest.raises(ValueError):
            attention.forward(q, k, v, scale=1.0, **kw)


def test_predicate_true_is_no_predicate():
    a = attention.fwd_kernel(causal="none", mask_kind="none", mask_row_broadcast=False, need_lse=True, interpret=True)
    for pred in (None, "", "true", ("or", ("true",), ("atom", 1, -1, 0))):
        b = attention.fwd_kernel(causal="none", mask_kind="none", mask_row_broadcast=False, need_lse=True,
                                 interpret=True, mask_pred=pred)
        assert b is a


@pytest.mark.parametrize("target", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("mutation", ["hi = hi - 16", "lo = lo + 16", "full_hi = full_hi + 16", "full_lo = full_lo - 16"])
def test_predicate_bounds_mutations_are_caught(monkeypatch, target, mutation):
    # the kernel tests catch wrong loop bounds: a too-small [lo, hi) or a too-large full range in
    # one kernel (forward, dQ, or dK/dV: roles swapped) makes the comparison fail
    real = attention._pred_params

    def mutated(pred, pred_fill_k, backward):
        params = real(pred, pred_fill_k, backward)
        key = {"fwd": "pred_bounds", "dq": "pred_bounds", "dkdv": "pred_bounds_t"}[target]
        if backward == (target != "fwd"):
            params[key] = params[key] + (mutation,)
        return params

    q, k, v = _qkv(83, 1, 2, 2, 64, 64, 16, 16)
    pred, consts = _window(40)  # wider than the blocks: some tiles are fully kept, some skipped
    monkeypatch.setattr(attention, "_pred_params", mutated)
    attention._fwd_module.cache_clear()
    attention._bwd_module.cache_clear()
    try:
        with pytest.raises(AssertionError):
            _check(q, k, v, mask_pred=pred, pred_consts=consts, modes=("two_kernel",))
    finally:
        attention._fwd_module.cache_clear()
        attention._bwd_module.cache_clear()


# --- layouts, options ------------------------------------------------------------------------


def test_strided_views_of_fused_qkv():
    b, n, h, d = 2, 45, 2, 32
    gen = torch.Generator().manual_seed(31)
    qkv = torch.randn(b, n, 3, h, d, generator=gen)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    dout = torch.randn(b, n, h, d, generator=gen).transpose(1, 2)  # strided upstream grad too
    _check(q, k, v, causal="top_left", dout=dout)


def test_expanded_upstream_grad():
    # out.sum() gives an all-ones grad with stride 0 everywhere
    q, k, v = _qkv(32, 1, 2, 2, 37, 37, 32, 16)
    dout = torch.ones(1, 1, 1, 1).expand(1, 2, 37, 16)
    _check(q, k, v, dout=dout)


def test_need_lse_false():
    q, k, v = _qkv(33, 2, 2, 2, 37, 50, 32, 32)
    out, lse, _ = _check(q, k, v, causal="bottom_right", need_lse=False, grad=False)
    assert lse is None
    src = attention.fwd_kernel(causal=True, mask_kind="none", mask_row_broadcast=False, need_lse=False,
                               interpret=True).source
    assert "LSE" not in src.split("def attention_fwd_kernel")[1].split("def launch_fwd")[0]


@pytest.mark.parametrize("mode", BWD_MODES)
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)],
                         ids=["dq", "dk", "dv", "dkdv"])
def test_needs_grad_subsets(mode, needs):
    q, k, v = _qkv(34, 1, 4, 2, 37, 29, 32, 24)
    _check(q, k, v, causal="bottom_right", modes=(mode,), needs_grad=needs)


def test_given_output_buffers():
    q, k, v = _qkv(35, 1, 2, 2, 20, 30, 32, 32)
    out_buf, lse_buf = attention.alloc_out(q, v), attention.alloc_lse(q)
    out, lse = attention.forward(q, k, v, scale=0.2, out=out_buf, lse=lse_buf)
    assert out is out_buf and lse is lse_buf
    dq, dk, dv = attention.alloc_grads(q, k, v, (True, True, True))
    do = torch.randn_like(out)
    got = attention.backward(do, q, k, v, out, lse, scale=0.2, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    ref = attention.backward(do, q, k, v, out, lse, scale=0.2)
    for a, r in zip(got, ref):
        assert torch.equal(a, r)


def test_two_kernel_mode_is_deterministic():
    q, k, v = _qkv(36, 1, 4, 1, 40, 40, 32, 32)
    out, lse = attention.forward(q, k, v, scale=0.2, causal="top_left")
    do = torch.randn_like(out)
    a = attention.backward(do, q, k, v, out, lse, scale=0.2, causal="top_left")
    b = attention.backward(do, q, k, v, out, lse, scale=0.2, causal="top_left")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_empty_sizes():
    # Nq == 0, B == 0: empty outputs, nothing launched
    for shape_q, shape_kv in [((2, 2, 0, 32), (2, 2, 5, 32)), ((0, 2, 7, 32), (0, 2, 5, 32))]:
        q, k, v = torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv)
        out, lse = attention.forward(q, k, v, scale=0.1)
        assert out.shape == shape_q and lse.shape == shape_q[:3]
        dq, dk, dv = attention.backward(torch.randn_like(out), q, k, v, out, lse, scale=0.1)
        assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
    # Nk == 0: every row is empty -> out 0, LSE +inf, dq 0
    q, k, v = torch.randn(1, 2, 7, 32), torch.randn(1, 2, 0, 32), torch.randn(1, 2, 0, 16)
    with launch.poison_outputs():
        out, lse = attention.forward(q, k, v, scale=0.1)
        assert (out == 0).all() and out.shape == (1, 2, 7, 16) and torch.isposinf(lse).all()
        dq, dk, dv = attention.backward(torch.randn_like(out), q, k, v, out, lse, scale=0.1)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


def test_alloc_helpers_work_on_meta_tensors():
    q = torch.empty(2, 4, 9, 24, device="meta")
    k = torch.empty(2, 2, 11, 24, device="meta")
    v = torch.empty(2, 2, 11, 40, device="meta")
    out = attention.alloc_out(q, v)
    assert out.shape == (2, 4, 9, 40) and out.stride() == (9 * 4 * 40, 40, 4 * 40, 1)
    assert attention.alloc_lse(q).shape == (2, 4, 9)
    dq, dk, dv = attention.alloc_grads(q, k, v, (True, False, True))
    assert dq.shape == q.shape and dk is None and dv.shape == v.shape and dv.is_contiguous()


def test_rejects_bad_inputs():
    q, k, v = _qkv(37, 1, 3, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError):
        attention.forward(q, k, v, scale=1.0)  # 3 query heads, 2 kv heads
    q, k, v = _qkv(37, 1, 2, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError):
        attention.forward(q, k, v, scale=1.0, mask=torch.ones(8, 8, dtype=torch.bool), mask_kind="additive")
    with pytest.raises(ValueError):
        attention.forward(q, k, v, scale=1.0, causal="diagonal")
    with pytest.raises(ValueError):
        attention.forward(q, k.half(), v, scale=1.0)


# --- rendering and configs -------------------------------------------------------------------


def test_kernels_for_renders_every_variant():
    seen = set()
    for causal in attention.CAUSAL_MODES:
        for mask_kind in attention.MASK_KINDS:
            for row in (False, True):
                for bwd_mode in attention.BWD_MODES:
                    for interpret in (False, True):
                        for need_lse in (False, True):
                            for training in (False, True):
                                ks = attention.kernels_for(
                                    causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
                                    bwd_mode=bwd_mode, interpret=interpret, need_lse=need_lse,
                                    training=training,
                                )
                                rows = attention.mask_skips(causal, mask_kind, row, None)
                                assert len(ks) == (2 if training else 1) + rows
                                if rows:  # the mask-rows kernel of the run-time skip test, last
                                    assert ks[-1].name.startswith("attention_mask_rows")
                                    assert "def attention_mask_rows_kernel" in ks[-1].source
                                for kern in ks:
                                    if kern.path not in seen:
                                        seen.add(kern.path)
                                        compile(kern.source, kern.path, "exec")
                                assert "def attention_fwd_kernel" in ks[0].source
                                assert "def launch_fwd" in ks[0].source
                                assert ks[0].name.startswith("attention_fwd")
                                if training:
                                    src = ks[1].source
                                    assert "def attention_bwd_preprocess" in src
                                    assert "def attention_bwd_dkdv" in src
                                    assert ("def attention_bwd_dq(" in src) == (bwd_mode == "two_kernel")
                                    assert ("tl.atomic_add" in src) == (bwd_mode == "atomic_dq")
    k_gpu = attention.fwd_kernel(causal="top_left", mask_kind="additive", mask_row_broadcast=False,
                                 need_lse=True, interpret=False)
    k_cpu = attention.fwd_kernel(causal="top_left", mask_kind="additive", mask_row_broadcast=False,
                                 need_lse=True, interpret=True)
    assert k_gpu.name == "attention_fwd_causal_maskadd" and k_cpu.path != k_gpu.path
    assert "tl.float32)" not in k_gpu.source.split("tl.dot(")[1].split("\n")[0]
    assert "CAUSAL_OFFSET" in k_gpu.source and "BLOCK_M" in k_gpu.source


FILL_VARIANTS = [
    # mask_fill, causal_fill, causal_fill_mode
    (-1e4, -math.inf, "replace"), (-math.inf, -1e9, "replace"), (-math.inf, -1.0, "add"), (-2.0, -3.0, "add"),
]


def test_kernels_for_renders_fill_variants():
    names = set()
    for causal in attention.CAUSAL_MODES:
        for mask_kind in attention.MASK_KINDS:
            for mask_fill, causal_fill, mode in FILL_VARIANTS:
                for bwd_mode in attention.BWD_MODES:
                    fills = dict(mask_fill=mask_fill, causal_fill=causal_fill, causal_fill_mode=mode)
                    ks = attention.kernels_for(causal=causal, mask_kind=mask_kind, mask_row_broadcast=False,
                                               bwd_mode=bwd_mode, interpret=False, need_lse=True, training=True, **fills)
                    # a fill that does not apply (no boolean mask, no causal) or is -inf changes nothing
                    mask_fill_on = mask_kind in ("bool_keep", "bool_drop") and mask_fill != -math.inf
                    causal_fill_on = causal != "none" and causal_fill != -math.inf
                    plain = attention.kernels_for(causal=causal, mask_kind=mask_kind, mask_row_broadcast=False,
                                                  bwd_mode=bwd_mode, interpret=False, need_lse=True, training=True)
                    assert (ks == plain) == (not mask_fill_on and not causal_fill_on)
                    two_part = attention.two_part_stats(causal=causal, mask_kind=mask_kind, **fills)
                    assert two_part == (mask_kind == "additive" or mask_fill_on or causal_fill_on)
                    skips = attention.mask_skips(causal, mask_kind, False, None)
                    if skips:  # the mask-rows kernel of the run-time skip test (test_attention_mask_skip.py)
                        assert ks[-1].name.startswith("attention_mask_rows")
                        compile(ks[-1].source, ks[-1].path, "exec")
                        ks = ks[:-1]
                    for kern in ks:
                        if kern.name not in names:
                            names.add(kern.name)
                            compile(kern.source, kern.path, "exec")
                        src = kern.source
                        # the fill values are runtime arguments, never baked into the source
                        assert "1e4" not in src and "10000" not in src and "1e9" not in src
                        assert ("mask_fill" in src) == mask_fill_on
                        assert ("causal_fill" in src) == causal_fill_on
                        assert ("Stats" in src) == two_part and ("LSE" in src.split("import triton.language as tl")[1]) == (not two_part)
                        if causal_fill_on:
                            # every key tile is visited, unless (no data mask) the run-time
                            # SkipHidden flag proves the tiles above the diagonal add exactly 0
                            assert ("SkipHidden" in src) == (mask_kind == "none")
                            # the heavy query blocks go first where tiles may be skipped
                            # (the forward and dQ kernels, over query blocks; atomic_dq has no dQ kernel)
                            by_query_block = kern is ks[0] or "def attention_bwd_dq(" in src
                            assert ("launched first" in src) == ("SkipHidden" in src and by_query_block)
                            if mask_kind != "none":
                                assert ("hi = N_K" in src) if kern is ks[0] else ("    lo = 0\n" in src)
                        else:
                            # a full data mask without causal masking: the run-time mask test's flag
                            assert ("SkipHidden" in src) == skips
                        assert ("DEFER_SCALE" in src) == (kern is ks[0] and not two_part)
    assert {"attention_fwd_causalfill", "attention_fwd_causaladd_maskkeepfill", "attention_bwd_maskdropfill_atomicdq",
            "attention_fwd_maskkeepfill"} <= names


PRED_VARIANTS = [
    # predicate, pred_fill, mode
    (("and", ("atom", 1, -1, 0), ("atom", -1, 1, 1)), -math.inf, "replace"),
    (("or", ("atom", 1, -1, 0), ("atom", 0, -1, 1)), -1e4, "replace"),
    (("and", ("atom", 1, -2, 0), ("atom", 0, 0, 1)), -1e9, "add"),
    (("false",), -math.inf, "replace"),
]


def test_kernels_for_renders_predicate_variants():
    from fuser.codegen import predicate

    names = set()
    for mask_kind in attention.MASK_KINDS:
        for pred, fill, mode in PRED_VARIANTS:
            for bwd_mode in attention.BWD_MODES:
                kw = dict(mask_pred=pred, pred_fill=fill, pred_fill_mode=mode)
                ks = attention.kernels_for(causal="none", mask_kind=mask_kind, mask_row_broadcast=False,
                                           bwd_mode=bwd_mode, interpret=False, need_lse=True, training=True, **kw)
                text = predicate.serialize(pred)
                ks_text = attention.kernels_for(causal="none", mask_kind=mask_kind, mask_row_broadcast=False,
                                                bwd_mode=bwd_mode, interpret=False, need_lse=True, training=True,
                                                **dict(kw, mask_pred=text))
                assert ks == ks_text  # the tuple and its text are the same variant
                two_part = attention.two_part_stats(causal="none", mask_kind=mask_kind, **kw)
                assert two_part == (mask_kind == "additive" or fill != -math.inf)
                for kern in ks:
                    src = kern.source
                    if kern.name not in names:
                        names.add(kern.name)
                        compile(src, kern.path, "exec")
                    kind = "pred" if fill == -math.inf else "predfill" if mode == "replace" else "predadd"
                    assert f"_{kind}_{predicate.digest(pred)}" in kern.name
                    # the header says in words which predicate the kernel evaluates
                    assert f"#   keep:    {predicate.describe(pred)}\n" in src
                    assert "1e4" not in src and "10000" not in src and "1e9" not in src
                    assert "launched first" not in src and "CAUSAL_OFFSET + 1" not in src
                    assert ("pred_fill" in src) == (fill != -math.inf)
                    assert ("Stats" in src) == two_part
                    assert ("_floordiv" in src) == predicate.needs_floordiv(pred)
                    n = predicate.n_consts(pred)
                    if n:  # the constants are runtime arguments, never specialised
                        assert '"CAUSAL_OFFSET", "PC0"' in src and f"PC{n - 1}" in src and f"PC{n}" not in src
    assert any(n.startswith("attention_fwd_predfill_") and n.endswith("_maskkeep") for n in names)
    k = attention.fwd_kernel(causal="none", mask_kind="none", mask_row_broadcast=False, need_lse=True,
                             interpret=False, mask_pred=PRED_VARIANTS[0][0])
    # a window: key tiles outside [lo, hi) of the block are never visited; three stages
    assert "lo = tl.maximum(i_first - PC1, 0)" in k.source and "hi = tl.minimum(i_last + PC0 + 1, N_K)" in k.source
    assert k.source.count("= _attn_fwd_inner(") == 3


def test_config_table():
    check_table(attention._FWD_TABLE, attention._BWD_TABLE)
    for key, cands in attention._FWD_CAUSAL_TABLE.items():
        assert key in attention._FWD_TABLE and cands
    first = attention.candidate_configs(head_dim=80, head_dim_v=80, dtype=torch.float16, device="cpu", kind="fwd")
    assert first[0]["num_stages"] == 1 and first[0]["BLOCK_M"] <= 32


# ---------------------------------------------------------------------------------------------
# GPU tests (compiled kernels, realistic sizes)
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # id, dtype, B, Hq, Hkv, Nq, Nk, D, Dv, causal, mask
    ("bf16_d128_causal", torch.bfloat16, 2, 8, 8, 2048, 2048, 128, 128, "top_left", None),
    ("bf16_d64_gqa", torch.bfloat16, 2, 8, 2, 1024, 1024, 64, 64, "none", None),
    ("fp16_d64_mqa_causal", torch.float16, 1, 8, 1, 2048, 2048, 64, 64, "top_left", None),
    ("fp16_d128", torch.float16, 2, 4, 4, 1024, 1024, 128, 128, "none", None),
    ("bf16_d128_bottom_right_ragged_gqa", torch.bfloat16, 1, 8, 4, 1000, 1536, 128, 128, "bottom_right", None),
    ("fp16_d80_keypad", torch.float16, 2, 4, 4, 1024, 1024, 80, 80, "none", "keypad"),
    ("bf16_d256", torch.bfloat16, 1, 4, 4, 1024, 1024, 256, 256, "top_left", None),
    ("bf16_d96_bias", torch.bfloat16, 1, 4, 2, 1024, 777, 96, 96, "none", "bias"),
    ("fp32_d64", torch.float32, 1, 4, 4, 1024, 1024, 64, 64, "top_left", None),
    # causal over at most 1024 keys: the short-causal table (64-row blocks), ragged edges
    ("bf16_d128_causal_short_gqa", torch.bfloat16, 2, 8, 4, 1000, 1000, 128, 128, "top_left", None),
    ("fp16_d96_causal_short_bottom_right", torch.float16, 1, 4, 4, 700, 900, 96, 96, "bottom_right", None),
]


def _sdpa_baseline(q, k, v, dout, *, scale, causal, mask, mask_kind):
    """Errors of torch's own SDPA in the same dtype: the yardstick for low-precision kernels."""
    import torch.nn.functional as F

    n_q, n_k = q.shape[2], k.shape[2]
    attn_mask = None
    if causal != "none":
        off = attention.causal_offset(causal, n_q, n_k)
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        attn_mask = j <= i + off
    if mask is not None:
        if mask_kind == "additive":
            m = mask.to(q.dtype)
            attn_mask = m if attn_mask is None else m.masked_fill(~attn_mask, -math.inf)
        else:
            keep = mask if mask_kind == "bool_keep" else ~mask
            attn_mask = keep if attn_mask is None else keep & attn_mask
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    kk = leaves[1].repeat_interleave(g, dim=1)
    vv = leaves[2].repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=attn_mask, scale=scale)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, grads


def _check_gpu_fwd_bwd(q, k, v, dout, kw):
    """GPU kernels (forward, both backward modes, outputs poisoned) against the float64
    reference at 16-bit tolerances."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference(*leaves, **kw)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    with launch.poison_outputs():
        out, lse = attention.forward(q, k, v, **kw)
    assert not out.isnan().any() and _rel(out, ref_out.detach()) < 2e-2
    for mode_ in BWD_MODES:
        with launch.poison_outputs():
            grads = attention.backward(dout, q, k, v, out, lse, bwd_mode=mode_, **kw)
        for name, g, r in zip("qkv", grads, ref_grads):
            assert not g.isnan().any(), f"d{name} NaN ({mode_})"
            e = _rel(g, r)
            assert e < 3e-2, f"d{name} ({mode_}): error {e:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_reference(case):
    _, dtype, b, hq, hkv, n_q, n_k, d, dv, causal, mask_spec = case
    dev = torch.device("cuda")
    q, k, v = _qkv(101, b, hq, hkv, n_q, n_k, d, dv, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(102)
    mask, mask_kind = None, "none"
    if mask_spec == "keypad":
        keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
        keep[0, ..., n_k - 300:] = False
        mask, mask_kind = keep.to(dev), "bool_keep"
    elif mask_spec == "bias":
        mask, mask_kind = torch.randn(b, hq, n_q, n_k, generator=gen).to(dev), "additive"
    dout = _rand(gen, b, hq, n_q, dv, dtype=dtype, device=dev)
    scale = d ** -0.5
    kw = dict(scale=scale, causal=causal, mask=mask, mask_kind=mask_kind)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, **kw)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    ref_out = ref_out.detach()
    if dtype == torch.float32:
        base_out, base_grads = 0.0, (0.0, 0.0, 0.0)
    else:
        s_out, s_grads = _sdpa_baseline(q, k, v, dout, **kw)
        base_out = _rel(s_out, ref_out)
        base_grads = [_rel(g, r) for g, r in zip(s_grads, ref_grads)]

    def ok(err, base):
        return err <= max(2.0 * base, 2e-3 if dtype != torch.float32 else 1e-4)

    with launch.poison_outputs():
        out, lse = attention.forward(q, k, v, **kw)
    assert not out.isnan().any()
    e = _rel(out, ref_out)
    assert ok(e, base_out), f"out error {e:.3g} vs sdpa {base_out:.3g}"
    _check_stats(lse, ref_lse.detach(), n_k, dtype, attention.two_part_stats(causal=causal, mask_kind=mask_kind))
    for mode in BWD_MODES:
        with launch.poison_outputs():
            grads = attention.backward(dout, q, k, v, out, lse, bwd_mode=mode, **kw)
        for name, g, r, base in zip("qkv", grads, ref_grads, base_grads):
            assert not g.isnan().any(), f"d{name} NaN ({mode})"
            e = _rel(g, r)
            assert ok(e, base), f"d{name} ({mode}): error {e:.3g} vs sdpa {base:.3g}"


GPU_FILL_CASES = [
    # id, dtype, Nq, Nk, causal, mask spec, mask_fill, causal_fill, mode
    ("bf16_keypad_fill", torch.bfloat16, 1024, 1024, "none", "keypad", -1e4, -math.inf, "replace"),
    ("bf16_causal_add_finfo_min_q>k", torch.bfloat16, 1100, 777, "bottom_right", None, -math.inf,
     torch.finfo(torch.float32).min, "add"),
    ("fp16_causal_replace_keypad_fill", torch.float16, 777, 1024, "top_left", "keypad", -2.0, -3.0, "replace"),
    ("bf16_additive_finfo_min_rows", torch.bfloat16, 1024, 900, "none", "padbias", -math.inf, -math.inf, "replace"),
    # no data mask, every row keeps a key: the run-time bound lets the tiles above the diagonal be skipped
    ("bf16_skip_causal_add_finfo_min", torch.bfloat16, 1000, 1000, "top_left", None, -math.inf,
     torch.finfo(torch.float32).min, "add"),
    ("fp16_skip_causal_replace_1e4_q<k", torch.float16, 777, 1024, "bottom_right", None, -math.inf, -1e4, "replace"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_FILL_CASES, ids=[c[0] for c in GPU_FILL_CASES])
def test_gpu_fills(case):
    # compiled fill / two-part variants in 16-bit against the float64 reference (fully filled
    # rows included: keypad hides the last 300 keys of batch 0 and every key of batch 1)
    _, dtype, n_q, n_k, causal, mask_spec, mask_fill, causal_fill, mode = case
    dev = torch.device("cuda")
    b, hq, hkv, d = 2, 8, 2, 128
    q, k, v = _qkv(111, b, hq, hkv, n_q, n_k, d, d, dtype=dtype, device=dev)
    mask, mask_kind = None, "none"
    if mask_spec == "keypad":
        keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
        keep[0, ..., n_k - 300:] = False
        keep[1] = False
        mask, mask_kind = keep.to(dev), "bool_keep"
    elif mask_spec == "padbias":
        bias = torch.zeros(b, 1, 1, n_k)
        bias[0, ..., n_k - 300:] = torch.finfo(torch.float32).min
        bias[1] = torch.finfo(torch.float32).min
        mask, mask_kind = bias.to(dev), "additive"
    kw = dict(scale=d ** -0.5, causal=causal, mask=mask, mask_kind=mask_kind, mask_fill=mask_fill,
              causal_fill=causal_fill, causal_fill_mode=mode)
    if "_skip_" in case[0]:  # the case exercises the skipping path
        assert int(attention.hidden_tiles_skippable(q, k, scale=d ** -0.5, causal_fill=causal_fill, causal_fill_mode=mode,
                                                    causal_offset=variants.causal_offset(causal, n_q, n_k))) == 1
    gen = torch.Generator().manual_seed(112)
    dout = _rand(gen, b, hq, n_q, d, dtype=dtype, device=dev)
    _check_gpu_fwd_bwd(q, k, v, dout, kw)


@pytest.mark.gpu
def test_gpu_one_compile_for_every_fill_value():
    dev = torch.device("cuda")
    kern = attention.fwd_kernel(causal=True, mask_kind="none", mask_row_broadcast=False, need_lse=True,
                                interpret=False, causal_fill=-1.0, causal_fill_mode="add")
    fn = launch.kernel_module(kern, False).attention_fwd_kernel
    compiled_keys(fn)
    counts = []
    for fill in (-1.0, -2.5, torch.finfo(torch.float32).min, -1e4):
        q, k, v = _qkv(113, 1, 2, 2, 300, 257, 64, 64, dtype=torch.bfloat16, device=dev)
        attention.forward(q, k, v, scale=0.125, causal="bottom_right", causal_fill=fill, causal_fill_mode="add")
        counts.append(len(compiled_keys(fn)))
    assert counts[1:] == counts[:1] * 3, f"compiled variants after each fill: {counts}"


GPU_PRED_CASES = [
    # id, dtype, Nq, Nk, predicate, constants, pred_fill, mode
    ("bf16_window_256", torch.bfloat16, 2048, 2048, "and(ge(1,-1,0),ge(-1,1,1))", (0, 255), -math.inf, "replace"),
    ("fp16_window_bottom_right_q>k", torch.float16, 1100, 777, "and(ge(1,-1,0),ge(-1,1,1))",
     (777 - 1100, 99 - (777 - 1100)), -math.inf, "replace"),
    ("bf16_prefix_lm", torch.bfloat16, 1024, 1024, "or(ge(1,-1,0),ge(0,-1,1))", (0, 299), -math.inf, "replace"),
    ("bf16_window_fill", torch.bfloat16, 1024, 1000, "and(ge(1,-1,0),ge(-1,1,1))", (0, 127), -1e4, "replace"),
    ("bf16_keylimit_add_finfo_min", torch.bfloat16, 777, 1024, "ge(0,-1,0)", (900,), torch.finfo(torch.float32).min,
     "add"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_PRED_CASES, ids=[c[0] for c in GPU_PRED_CASES])
def test_gpu_predicates(case):
    # compiled predicate variants in 16-bit against the float64 reference
    _, dtype, n_q, n_k, pred, consts, fill, mode = case
    dev = torch.device("cuda")
    b, hq, hkv, d = 2, 8, 2, 128
    q, k, v = _qkv(121, b, hq, hkv, n_q, n_k, d, d, dtype=dtype, device=dev)
    kw = dict(scale=d ** -0.5, mask_pred=pred, pred_consts=consts, pred_fill=fill, pred_fill_mode=mode)
    dout = _rand(torch.Generator().manual_seed(122), b, hq, n_q, d, dtype=dtype, device=dev)
    _check_gpu_fwd_bwd(q, k, v, dout, kw)


@pytest.mark.gpu
def test_gpu_one_compile_for_every_window():
    dev = torch.device("cuda")
    pred = "and(ge(1,-1,0),ge(-1,1,1))"
    kern = attention.fwd_kernel(causal="none", mask_kind="none", mask_row_broadcast=False, need_lse=True,
                                interpret=False, mask_pred=pred)
    fn = launch.kernel_module(kern, False).attention_fwd_kernel
    compiled_keys(fn)
    counts = []
    for n, w in ((1000, 1), (1100, 16), (1234, 33), (77, 1000)):
        q, k, v = _qkv(123, 1, 2, 2, n, n + 7, 64, 64, dtype=torch.bfloat16, device=dev)
        attention.forward(q, k, v, scale=0.125, mask_pred=pred, pred_consts=(7, w - 1 - 7))
        counts.append(len(compiled_keys(fn)))
    assert counts[1:] == counts[:1] * 3, f"compiled variants after each window: {counts}"


@pytest.mark.gpu
def test_gpu_one_compile_for_many_lengths():
    dev = torch.device("cuda")
    kern = attention.fwd_kernel(causal=True, mask_kind="none", mask_row_broadcast=False, need_lse=True,
                                interpret=False)
    fn = launch.kernel_module(kern, False).attention_fwd_kernel
    compiled_keys(fn)  # skips where Triton keeps no device caches

    def compiled():
        return compiled_keys(fn)

    counts = []
    for n in (1000, 1100, 1234, 77):
        q, k, v = _qkv(103, 1, 2, 2, n, n + 7, 48, 48, dtype=torch.float16, device=dev)
        attention.forward(q, k, v, scale=0.125, causal="bottom_right")
        counts.append(len(compiled()))
    assert counts[1:] == counts[:1] * 3, f"compiled variants after each length: {counts}: {compiled()}"


def test_short_causal_forward_takes_its_own_table(monkeypatch):
    """A causal pointer forward with max(Nq, Nk) <= SHORT_CAUSAL_N takes _FWD_SHORT_CAUSAL_TABLE
    (measured faster there) under a launch key of its own, so a config remembered for a long
    call is never reused for a short one; unknown or symbolic lengths, non-causal calls and
    descriptor paths keep the long tables."""
    monkeypatch.setattr(launch, "device_kind", lambda device: "sm90")
    kw = dict(head_dim=128, head_dim_v=128, dtype=torch.bfloat16, device="cuda", kind="fwd")
    short, long_ = attention._FWD_SHORT_CAUSAL_TABLE[("sm90", 128, 2)], attention._FWD_TABLE[("sm90", 128, 2)]
    n = attention.SHORT_CAUSAL_N
    assert attention.candidate_configs(causal="top_left", n_ctx=n, **kw) == short
    assert short[0] != long_[0]
    for n_ctx in (None, n + 1, True):
        assert attention.candidate_configs(causal="top_left", n_ctx=n_ctx, **kw) == long_
    assert attention.candidate_configs(causal="none", n_ctx=64, **kw) == long_
    assert attention.candidate_configs(causal="top_left", n_ctx=64, desc="host", **kw) == \
        attention._FWD_DESC_CAUSAL_TABLE[("sm90", 128, 2)]
    kw64 = dict(kw, head_dim=64, head_dim_v=64)  # no short entry: the causal table
    assert attention.candidate_configs(causal="top_left", n_ctx=64, **kw64) == attention._FWD_CAUSAL_TABLE[("sm90", 64, 2)]
    for c in short:
        launch.check_config(c)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    sym = env.create_unbacked_symint()  # a symbolic length: unknown, and asking must not guard
    assert not attention.short_causal(sym) and not env.guards

    seen = []
    monkeypatch.setattr(launch, "interpreted", lambda device: False)
    monkeypatch.setattr(launch, "launch_first_fitting", lambda key, configs, run, **k: seen.append((key, configs)))
    for n_q, n_k, causal in ((n, n, "top_left"), (1, n + 1, "bottom_right"), (n, n, "none")):
        q = torch.empty(1, 2, n_q, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, 2, n_k, 128, dtype=torch.bfloat16, device="meta")
        attention.forward(q, k, k, scale=0.1, causal=causal, tma="none")
    (k_short, c_short), (k_long, c_long), (k_full, c_full) = seen
    assert c_short == short and c_long == long_ and c_full == long_
    assert k_short != k_long and k_short[:-1] == k_long[:-1]


def _nan_case(name):
    """(q, k, v, kwargs) with one NaN that a clamp of the kernels meets: in an additive mask
    (mask_bias's clamp at -2.35e38), or in a key that some rows see and others take with an
    added finite fill (predicate or causal fill: the sum's clamp at -FLT_MAX)."""
    b, h, n_q, n_k = 1, 2, 37, 45
    q, k, v = _qkv(91, b, h, h, n_q, n_k, 16, 24)
    if name == "additive_mask":
        bias = torch.zeros(b, 1, n_q, n_k)
        bias[..., 30:] = -math.inf
        bias[0, 0, 4, 7] = math.nan
        return q, k, v, dict(mask=bias, mask_kind="additive")
    k[0, 1, 20, 3] = math.nan  # a NaN score column: kept below the diagonal, fill-added above
    if name == "predicate_add":
        pred, consts = _window(5)
        return q, k, v, dict(mask_pred=pred, pred_consts=consts, pred_fill=-1e4, pred_fill_mode="add")
    return q, k, v, dict(causal="top_left", causal_fill=-1e4, causal_fill_mode="add")


def _eager_nan(q, k, v, name, kw):
    """Eager PyTorch in float64 on the case's scores (torch.softmax: the oracle for NaN, whose
    pattern the float64 reference, with its own guards for empty rows, does not reproduce in
    the gradients)."""
    s = (q @ k.mT) * kw["scale"]
    n_q, n_k = s.shape[-2:]
    i = torch.arange(n_q, device=s.device)[:, None]
    j = torch.arange(n_k, device=s.device)[None, :]
    if name == "additive_mask":
        s = s + kw["mask"].double()
    elif name == "predicate_add":
        w = kw["pred_consts"][1] + 1
        s = torch.where((j <= i) & (j > i - w), s, s + kw["pred_fill"])
    else:
        s = torch.where(j > i, s + kw["causal_fill"], s)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["additive_mask", "predicate_add", "causal_add"])
def test_a_nan_input_is_nan_where_eager_is(name, device):
    """A NaN reaching the scores makes its row NaN in eager's softmax (and, through P, the
    gradients it touches): the kernels' clamps (finite mask values and finite fills kept above
    -FLT_MAX) must not turn it into a number (the interpreter's maximum keeps a NaN where the
    GPU's, without ``propagate_nan``, drops it: run on both). Forward and both backward modes
    against eager in float64: the same NaN entries, the rest within tolerance."""
    q, k, v, extra = _nan_case(name)
    q, k, v = (t.to(device) for t in (q, k, v))
    if "mask" in extra:
        extra["mask"] = extra["mask"].to(device)
    kw = dict(scale=16 ** -0.5, **extra)
    with launch.poison_outputs():
        out, lse = attention.forward(q, k, v, need_lse=True, **kw)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = _eager_nan(*leaves, name, kw)
    ref_ours, _ = reference(*(t.detach() for t in leaves), **kw)
    assert torch.equal(ref_ours.isnan(), ref_out.isnan()) and ref_out.isnan().any()
    assert torch.equal(out.isnan(), ref_out.isnan()), f"{name}: NaN entries differ from eager"
    ok = ~ref_out.isnan()
    assert _rel(out[ok], ref_out.detach()[ok].float()) < TOL[torch.float32]
    dout = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    for mode in BWD_MODES:
        with launch.poison_outputs():
            got = attention.backward(dout, q, k, v, out, lse, bwd_mode=mode, needs_grad=(True, True, True), **kw)
        for name_g, g, rg in zip("qkv", got, ref_grads):
            assert torch.equal(g.isnan(), rg.isnan()), f"{name}: d{name_g} ({mode}) NaN entries differ from eager"
            fine = ~rg.isnan()
            if fine.any():
                assert _rel(g[fine], rg[fine].float()) < TOL[torch.float32], f"{name}: d{name_g} ({mode})"
