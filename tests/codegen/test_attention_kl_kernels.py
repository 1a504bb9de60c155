"""Attention-KL kernels (codegen/attention_kl.py + templates) against the float64 reference.

On CPU the kernels run in Triton's interpreter at small, ragged sizes; tests marked ``gpu``
run the compiled kernels at realistic sizes. Every output is allocated poisoned (NaN), so an
element a kernel fails to write shows up.
"""

from __future__ import annotations

import math

import pytest
import torch.nn.functional as F
from _kernel_checks import check_table, compiled_keys, rel_err as _rel
import torch

from fuser.codegen import attention_kl, attention_kl_configs, launch
from fuser.patterns.attention_kl_reference import reference

LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
BWD_MODES = ("two_kernel", "atomic_dq")
ALL = (True, True, True, True)
FROZEN = (False, False, True, True)  # teacher frozen: only the student's gradients
CPU = torch.device("cpu")


def _inputs(seed, b, h, hkv1, hkv2, n_q, n_k, d1, d2, dtype=torch.float32, device=CPU):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, n_q, d1), (b, hkv1, n_k, d1), (b, h, n_q, d2), (b, hkv2, n_k, d2))
    return tuple(torch.randn(*s, generator=gen).to(device=device, dtype=dtype) for s in shapes)


def _grads_ref(q1, k1, q2, k2, g, **kw):
    leaves = [t.detach().double().requires_grad_() for t in (q1, k1, q2, k2)]
    rows = reference(*leaves, **kw)["rows"]
    return torch.autograd.grad((rows * g.double()).sum(), leaves)


def _check(
    q1, k1, q2, k2, *, causal="none", mask=None, mask_kind="none", scale1=None, scale2=None,
    split_k=1, grad=True, modes=BWD_MODES, needs=(ALL, FROZEN), g=None, tol=None,
    config=None, bwd_config=None, seed=0, fills=None, zero_hidden=False,
):
    """Forward (and the backward per mode and needs_grad) against the reference; ``fills``:
    the fill keyword arguments (mask_fill1, ..., causal_fill_mode) of forward/backward/reference;
    ``zero_hidden``: the hidden entries' KL terms zeroed (also passed to all three).

    Returns ``(rows, (lse1, lse2, delta), {(mode, needs): grads})``.
    """
    dtype = q1.dtype
    stat_tol = 1e-4 if dtype == torch.float32 else 2e-3
    stat_tol = stat_tol if tol is None else max(stat_tol, tol)  # a looser tolerance given for hard inputs
    tol = TOL[dtype] if tol is None else tol
    scale1 = q1.shape[-1] ** -0.5 if scale1 is None else scale1
    scale2 = q2.shape[-1] ** -0.5 if scale2 is None else scale2
    kw = dict(scale1=scale1, scale2=scale2, causal=causal, mask=mask, mask_kind=mask_kind, **(fills or {}))
    if zero_hidden:
        kw["zero_hidden"] = True
    with launch.poison_outputs():
        rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, split_k=split_k, config=config, **kw)
    ref = reference(q1, k1, q2, k2, **kw)

    assert rows.shape == ref["rows"].shape and rows.dtype == torch.float32 and rows.is_contiguous()
    assert not rows.isnan().any()
    err = _rel(rows, ref["rows"])
    assert err < tol, f"rows: relative error {err:.3g} >= {tol}"
    empty = torch.isneginf(ref["lse1"])
    assert (rows[empty] == 0).all(), "rows with no visible key must give L = 0"
    variant = attention_kl.fill_variant(causal, mask_kind, **(fills or {}))
    two_part = attention_kl.two_part_stats(mask_kind, **variant)
    zero = attention_kl.zero_hidden_flag(zero_hidden, mask_kind, **variant)
    assert lse1.dim() == lse2.dim() == (4 if two_part else 3)
    if two_part:
        _check_two_part_stats(ref, lse1, lse2, delta, empty, stat_tol, zero)
    for name, got, want in () if two_part else (("lse1", lse1, ref["lse1"]), ("lse2", lse2, ref["lse2"])):
        assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
        assert not got.isnan().any()
        assert torch.isposinf(got[empty]).all(), f"{name}: empty rows must store +inf"
        # a row whose every visible score carries a finfo.min bias has LSE = finfo.min + O(1),
        # which base 2 cannot hold in fp32: the kernel saturates it near -FLT_MAX (L and the
        # gradients stay exact: that row is uniform on both sides, as in the reference)
        saturated = ~empty & (want < -1e38)
        assert (got[saturated] < -1e38).all(), name
        normal = ~empty & ~saturated
        if normal.any():
            e = (got[normal].double() / LOG2E - want[normal]).abs().max().item()
            assert e < stat_tol * (1 + want[normal].abs().max().item()), f"{name} error {e:.3g}"
    assert not delta.isnan().any() and (delta[empty] == 0).all()
    if not two_part:
        e = (delta.double() * LN2 - ref["delta"]).abs().max().item()
        assert e < stat_tol * (1 + ref["delta"].abs().max().item()), f"delta error {e:.3g}"

    grads = {}
    if grad:
        if g is None:
            g = torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed + 1)).to(q1.device)
        ref_grads = _grads_ref(q1, k1, q2, k2, g, **kw)
        for mode in modes:
            for need in needs:
                with launch.poison_outputs():
                    got = attention_kl.backward(
                        g, q1, k1, q2, k2, lse1, lse2, delta, needs_grad=need, bwd_mode=mode,
                        config=bwd_config, **kw,
                    )
                grads[(mode, need)] = got
                for name, gr, rg, t, n in zip(("dq1", "dk1", "dq2", "dk2"), got, ref_grads, (q1, k1, q2, k2), need):
                    if not n:
                        assert gr is None, f"{name} not asked for but returned ({mode})"
                        continue
                    assert gr.shape == t.shape and gr.dtype == t.dtype and gr.is_contiguous(), f"{name} ({mode})"
                    assert not gr.isnan().any(), f"{name} has NaN ({mode}, {need})"
                    e = _rel(gr, rg)
                    assert e < tol, f"{name} ({mode}, {need}): relative error {e:.3g} >= {tol}"
    return rows, (lse1, lse2, delta), grads


def _check_two_part_stats(ref, stats1, stats2, delta, empty, stat_tol, zero_hidden=False):
    """Two-part statistics against the reference: per side plane 0 the row max (base 2), plane 1
    log2 of the row sum; DELTA offset-free. Empty rows store (0, +inf) and DELTA 0. With
    ``zero_hidden`` side 1 has planes 2, 3 (hidden and visible mass h1, w1) and DELTA is the
    zero_hidden form (the reference's ``mean_zh``)."""
    if zero_hidden:
        assert stats1.shape == (4, *ref["rows"].shape)
        for plane, name in ((2, "h1"), (3, "w1")):
            got = stats1[plane]
            assert not got.isnan().any() and (got[empty] == 0).all(), name
            e = (got.double() - ref[name]).abs().max().item()
            assert e < stat_tol, f"{name} error {e:.3g}"
        stats1 = stats1[:2]
    for side, stats in ((1, stats1), (2, stats2)):
        assert stats.shape == (2, *ref["rows"].shape) and stats.dtype == torch.float32 and stats.is_contiguous()
        m, log2l = stats[0], stats[1]
        if zero_hidden and side == 2:  # side 2 without any finite score (its mass all hidden): stored as empty
            empty = empty | torch.isneginf(ref["logl2"])
        assert not stats.isnan().any()
        assert (m[empty] == 0).all() and torch.isposinf(log2l[empty]).all(), f"side {side}: empty rows"
        want_m, want_logl = ref[f"max{side}"][~empty], ref[f"logl{side}"][~empty]
        # log l is exact whatever the max (the point of keeping it apart)
        e = (log2l[~empty].double() * LN2 - want_logl).abs().max().item() if want_logl.numel() else 0.0
        assert e < stat_tol * (1 + want_logl.abs().max().item()), f"log l{side} error {e:.3g}"
        # the max in base 2, relative; a max beyond float32's base-2 range saturates near -FLT_MAX
        got_m = m[~empty].double() / LOG2E
        saturated = want_m < -2.3e38
        assert (got_m[saturated] < -2.3e38).all(), f"max{side}: saturated rows"
        ok = ~saturated
        if ok.any():
            e = ((got_m[ok] - want_m[ok]).abs() / (1 + want_m[ok].abs())).max().item()
            assert e < stat_tol, f"max{side} error {e:.3g}"
    want = ref["mean_zh"] if zero_hidden else ref["mean"]
    e = (delta.double() * LN2 - want).abs().max().item()
    assert e < stat_tol * (1 + want.abs().max().item()), f"offset-free delta error {e:.3g}"


# ---------------------------------------------------------------------------------------------
# Interpreter tests (CPU)
# ---------------------------------------------------------------------------------------------

SHAPES = [
    # id, B, H, Hkv1, Hkv2, Nq, Nk, D1, D2, causal
    ("ragged_d24_d40_gqa_1_2", 2, 4, 1, 2, 37, 50, 24, 40, "none"),
    ("top_left_q<k", 1, 2, 2, 2, 50, 67, 32, 32, "top_left"),
    ("top_left_q>k", 1, 2, 2, 1, 67, 37, 32, 16, "top_left"),
    ("bottom_right_q<k_gqa_2_1", 2, 4, 2, 1, 37, 67, 32, 24, "bottom_right"),
    ("bottom_right_q>k_empty_rows", 2, 2, 1, 2, 67, 37, 16, 32, "bottom_right"),
    ("d80_d48", 1, 2, 2, 2, 40, 33, 80, 48, "none"),
    ("gqa_groups_2_3", 1, 6, 3, 2, 29, 45, 32, 16, "top_left"),  # groups that do not nest
    ("single_query", 2, 2, 1, 1, 1, 67, 32, 32, "bottom_right"),
]


@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
def test_fp32_forward_backward(case):
    _, b, h, hkv1, hkv2, n_q, n_k, d1, d2, causal = case
    q1, k1, q2, k2 = _inputs(SHAPES.index(case), b, h, hkv1, hkv2, n_q, n_k, d1, d2)
    rows, (lse1, lse2, delta), grads = _check(q1, k1, q2, k2, causal=causal)
    if case[0] == "bottom_right_q>k_empty_rows":
        # the first Nq - Nk rows see no key: L = 0, LSE = +inf, no gradient into their queries
        e = n_q - n_k
        assert (rows[:, :, :e] == 0).all() and torch.isposinf(lse1[:, :, :e]).all()
        assert torch.isposinf(lse2[:, :, :e]).all() and (delta[:, :, :e] == 0).all()
        for (mode, need), (dq1, _, dq2, _) in grads.items():
            assert (dq2[:, :, :e] == 0).all(), mode
            if dq1 is not None:
                assert (dq1[:, :, :e] == 0).all(), mode


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_fp16(causal):
    q1, k1, q2, k2 = _inputs(11, 2, 4, 2, 4, 45, 53, 64, 40, dtype=torch.float16)
    _check(q1, k1, q2, k2, causal=causal)


def test_bf16_interpreter_upcast():
    # the interpreter's bf16 tl.dot is wrong; interpreted kernels upcast dot operands to fp32
    q1, k1, q2, k2 = _inputs(12, 1, 2, 1, 2, 37, 50, 32, 24, dtype=torch.bfloat16)
    _check(q1, k1, q2, k2, causal="top_left", needs=(ALL,))


@pytest.mark.parametrize("scales", [(0.37, -0.5), (0.0, 0.25), (-0.3, -0.2)], ids=["neg2", "zero1", "neg_both"])
def test_scales(scales):
    # positive scales are folded into the exp2 argument; zero and negative ones take the plain path
    q1, k1, q2, k2 = _inputs(14, 1, 2, 2, 2, 29, 41, 32, 16)
    _check(q1, k1, q2, k2, scale1=scales[0], scale2=scales[1], causal="bottom_right",
           modes=("two_kernel",), needs=(ALL,))


def test_non_default_configs():
    q1, k1, q2, k2 = _inputs(13, 1, 2, 1, 2, 50, 45, 32, 24)
    kw = dict(head_dim1=32, head_dim2=24, dtype=q1.dtype, device=q1.device)
    fwd = attention_kl.candidate_configs(kind="fwd", **kw)
    bwd = attention_kl.candidate_configs(kind="bwd", **kw)
    for fc, bc in zip(fwd[1:], bwd[1:] + bwd[:1]):
        _check(q1, k1, q2, k2, causal="top_left", config=fc, bwd_config=bc, needs=(ALL,))


# --- split-K ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_split_k_equals_one_pass(causal):
    q1, k1, q2, k2 = _inputs(41, 2, 2, 1, 2, 37, 75, 32, 24)
    kw = dict(scale1=0.2, scale2=0.3, causal=causal)
    one = attention_kl.forward(q1, k1, q2, k2, split_k=1, **kw)
    ref = reference(q1, k1, q2, k2, **kw)
    # 75 keys = 5 tiles of 16: splits of 2 and 3 tiles, and more splits than tiles (clamped)
    for split in (2, 3, 8):
        with launch.poison_outputs():
            got = attention_kl.forward(q1, k1, q2, k2, split_k=split, **kw)
        for name, a, b in zip(("rows", "lse1", "lse2", "delta"), got, one):
            assert not a.isnan().any(), (name, split)
            fin = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), fin) and torch.equal(a[~fin], b[~fin]), (name, split)
            assert (a[fin] - b[fin]).abs().max().item() < 1e-6 * (1 + b[fin].abs().max().item()), (name, split)
        assert _rel(got[0], ref["rows"]) < 1e-4


def test_split_k_with_empty_splits_and_backward():
    # key padding hides the last 40 of 80 keys: for split_k = 3, the last split of every row
    # is empty (m = -inf, l = 0); one batch hides every key (all splits empty)
    b, h, n_q, n_k = 2, 2, 33, 80
    q1, k1, q2, k2 = _inputs(42, b, h, 2, 1, n_q, n_k, 16, 32)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., 40:] = False
    keep[1] = False
    rows, _, grads = _check(q1, k1, q2, k2, mask=keep, mask_kind="bool_keep", split_k=3,
                            modes=("atomic_dq",), needs=(FROZEN,))
    assert (rows[1] == 0).all()


# --- masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool_keep", "bool_drop"])
def test_key_padding_with_fully_masked_batch(kind):
    b, h, n_q, n_k = 2, 2, 37, 50
    q1, k1, q2, k2 = _inputs(21, b, h, 2, 1, n_q, n_k, 32, 24)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., 41:] = False  # padded keys
    keep[0, ..., 3] = False
    keep[1] = False  # every key of batch 1 is hidden
    mask = keep if kind == "bool_keep" else ~keep
    causal = "none" if kind == "bool_keep" else "top_left"
    rows, (lse1, lse2, delta), grads = _check(q1, k1, q2, k2, mask=mask, mask_kind=kind, causal=causal)
    assert (rows[1] == 0).all() and torch.isposinf(lse1[1]).all() and torch.isposinf(lse2[1]).all()
    for key, gs in grads.items():
        for gr in gs:
            if gr is not None:
                assert (gr[1] == 0).all(), key


def test_bool_mask_full_per_head():
    # a full [1, H, Nq, Nk] mask (not row-broadcast) with some rows entirely hidden
    h, n_q, n_k = 2, 45, 50
    q1, k1, q2, k2 = _inputs(22, 2, h, 1, 2, n_q, n_k, 32, 16)
    gen = torch.Generator().manual_seed(5)
    keep = torch.rand(1, h, n_q, n_k, generator=gen) > 0.3
    keep[0, 0, 7] = False
    keep[0, 1, 40] = False
    rows, _, _ = _check(q1, k1, q2, k2, mask=keep, mask_kind="bool_keep", causal="bottom_right")
    assert rows[:, 0, 7].eq(0).all() and rows[:, 1, 40].eq(0).all()


def test_additive_bias_per_head_with_neg_inf_and_finfo_min():
    b, h, n_q, n_k = 2, 2, 37, 50
    q1, k1, q2, k2 = _inputs(23, b, h, 2, 2, n_q, n_k, 24, 32)
    gen = torch.Generator().manual_seed(6)
    bias = 2.0 * torch.randn(1, h, n_q, n_k, generator=gen)
    pick = torch.rand(1, h, n_q, n_k, generator=gen)
    bias[pick < 0.2] = -math.inf
    bias[(pick >= 0.2) & (pick < 0.3)] = torch.finfo(torch.float32).min
    bias[0, 0, 3] = -math.inf  # a row with no visible key: L = 0
    bias[0, 1, 5] = torch.finfo(torch.float32).min  # finite everywhere: uniform on both sides, L = 0
    rows, _, _ = _check(q1, k1, q2, k2, mask=bias, mask_kind="additive")
    assert (rows[:, 0, 3] == 0).all() and (rows[:, 1, 5].abs() < 1e-6).all()


def test_additive_key_padding_low_precision_mask_causal():
    # row-broadcast additive mask in another float dtype than the inputs
    b, h, n_q, n_k = 2, 2, 33, 47
    q1, k1, q2, k2 = _inputs(26, b, h, 1, 2, n_q, n_k, 32, 32)
    bias = torch.zeros(b, 1, 1, n_k, dtype=torch.float16)
    bias[0, ..., 30:] = torch.finfo(torch.float16).min
    bias[1, ..., :5] = -math.inf
    bias[1, ..., 10:12] = 1.5
    _check(q1, k1, q2, k2, mask=bias, mask_kind="additive", causal="bottom_right", split_k=2)


# --- fills: hidden entries with finite scores, two-part statistics ----------------------------

MIN32 = torch.finfo(torch.float32).min


def _fills(mask_fill1=-math.inf, mask_fill2=-math.inf, causal_fill1=-math.inf, causal_fill2=-math.inf, mode="replace"):
    return dict(mask_fill1=mask_fill1, mask_fill2=mask_fill2, causal_fill1=causal_fill1, causal_fill2=causal_fill2,
                causal_fill_mode=mode)


def _near_fill_inputs(seed, b, h, n_q, n_k, d):
    """Adversarial scores: q.k = -10 + O(1e-3) (a constant last feature plus small noise), so
    with scale 1000 every score lies within a few units of -1e4 and a -1e4 fill is not
    negligible. Side 2 reads one kv head (GQA)."""
    gen = torch.Generator().manual_seed(seed)

    def side(hkv):
        q = 5e-4 * torch.randn(b, h, n_q, d, generator=gen)
        q[..., -1] = -10.0
        k = torch.randn(b, hkv, n_k, d, generator=gen)
        k[..., -1] = 1.0
        return q, k

    return (*side(h), *side(1))


NEAR_FILL_CASES = {
    # id: (causal, mask spec, fills, split_k)
    "bool_drop_full": ("none", "full", _fills(-1e4, -1e4 + 2.0), 1),
    "bool_keep_row_split": ("none", "row", _fills(-1e4 - 1.0, -1e4), 3),
    "causal_replace_bottom_right": ("bottom_right", None, _fills(causal_fill1=-1e4, causal_fill2=-1e4 + 3.0), 1),
    "causal_add_top_left_split": ("top_left", None, _fills(causal_fill1=-2.0, causal_fill2=-3.0, mode="add"), 2),
}


@pytest.mark.parametrize("case", list(NEAR_FILL_CASES))
def test_fill_near_the_scores_is_not_negligible(case):
    # scores ~ -1e4 +- a few units (scale 1000) and fills of the same size: the filled entries
    # carry much of each row's mass, so treating them as hidden would be far off
    causal, spec, fills, split = NEAR_FILL_CASES[case]
    b, h, n_q, n_k = 2, 2, 37, 45
    q1, k1, q2, k2 = _near_fill_inputs(61, b, h, n_q, n_k, 16)
    gen = torch.Generator().manual_seed(62)
    mask, kind = None, "none"
    if spec == "full":
        mask, kind = torch.rand(1, h, n_q, n_k, generator=gen) > 0.5, "bool_drop"
    elif spec == "row":
        mask, kind = torch.rand(b, 1, 1, n_k, generator=gen) > 0.4, "bool_keep"
    kw = dict(scale1=1000.0, scale2=1000.0, causal=causal, mask=mask, mask_kind=kind)
    # fp32 scores of magnitude 1e4 carry ~1e-3 absolute rounding (as in eager fp32)
    rows, _, _ = _check(q1, k1, q2, k2, fills=fills, split_k=split, tol=2e-3, needs=(ALL,), **kw)
    hidden = reference(q1, k1, q2, k2, **kw)["rows"]  # the same with every hidden entry skipped
    assert _rel(rows, hidden) > 0.05


@pytest.mark.parametrize("fill", [(-1e4, -2e4), (MIN32, MIN32 * 0.25)], ids=["finite", "finfo_min"])
def test_fully_filled_rows_are_uniform(fill):
    # rows whose every key is hidden take the fill everywhere: uniform on both sides, L = 0, no
    # gradient into those queries (the fill replaced their scores); the statistics hold
    # log2 l = log2 Nk exactly even where the max is about -FLT_MAX
    b, h, n_q, n_k = 2, 2, 29, 37
    q1, k1, q2, k2 = _inputs(63, b, h, 2, 1, n_q, n_k, 16, 24)
    keep = torch.rand(1, h, n_q, n_k, generator=torch.Generator().manual_seed(64)) > 0.4
    keep[0, 0, 7] = False
    keep[0, 1, 20:] = False
    rows, (s1, s2, _), grads = _check(q1, k1, q2, k2, mask=keep, mask_kind="bool_keep", causal="top_left",
                                      fills=_fills(*fill), modes=("two_kernel",))
    n_visible = (torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None]).sum(-1)  # top-left causal
    for hh, r in ((0, 7), (1, 25)):
        assert rows[:, hh, r].abs().max() < 1e-6
        for stats in (s1, s2):
            assert torch.allclose(stats[1][:, hh, r], torch.full((b,), math.log2(n_visible[r].item())))
        for gr in grads.values():
            assert (gr[0] is None or (gr[0][:, hh, r] == 0).all()) and (gr[2][:, hh, r] == 0).all()


CAUSAL_FILL_CASES = [
    # id, B, H, Hkv1, Hkv2, Nq, Nk, D1, D2, causal, mode, fill1, fill2, split_k
    ("replace_q>k_bottom_right", 2, 2, 1, 2, 45, 29, 16, 24, "bottom_right", "replace", -2.0, -3.0, 1),
    ("add_q>k_bottom_right_split", 1, 4, 2, 1, 45, 29, 16, 16, "bottom_right", "add", -1.5, -0.5, 3),
    ("replace_q<k_top_left_gqa_split", 1, 4, 1, 2, 29, 50, 24, 16, "top_left", "replace", -1.0, -1.0, 2),
    ("add_q<k_top_left", 2, 2, 2, 1, 29, 50, 16, 32, "top_left", "add", -4.0, -2.0, 1),
    ("add_finfo_min_q>k", 1, 2, 1, 1, 40, 23, 16, 16, "bottom_right", "add", MIN32, MIN32 * 0.5, 1),
]


@pytest.mark.parametrize("case", CAUSAL_FILL_CASES, ids=[c[0] for c in CAUSAL_FILL_CASES])
def test_causal_fill(case):
    name, b, h, hkv1, hkv2, n_q, n_k, d1, d2, causal, mode, f1, f2, split = case
    q1, k1, q2, k2 = _inputs(CAUSAL_FILL_CASES.index(case) + 70, b, h, hkv1, hkv2, n_q, n_k, d1, d2)
    fills = _fills(causal_fill1=f1, causal_fill2=f2, mode=mode)
    rows, _, grads = _check(q1, k1, q2, k2, causal=causal, fills=fills, split_k=split, scale1=0.4, scale2=0.3)
    if n_q > n_k:  # the first Nq - Nk rows have no key below the diagonal: not empty with a fill
        e = n_q - n_k
        if mode == "add" and f1 > -1e30:  # softmax(s + fill) = softmax(s): a real KL and gradient
            assert rows[:, :, :e].abs().min() > 1e-4
            assert all(gr[2][:, :, :e].abs().amax(-1).min() > 0 for gr in grads.values())
        else:  # uniform on both sides (replace, or a fill that swallows the scores)
            assert rows[:, :, :e].abs().max() < 1e-6


def test_huge_fills_with_key_padding_gqa():
    # finfo.min fills, scaled differently per side (a fill written before each side's scale),
    # on a key-padding mask (one batch fully padded) and the causal diagonal
    b, h, n_q, n_k = 2, 4, 33, 41
    q1, k1, q2, k2 = _inputs(80, b, h, 1, 2, n_q, n_k, 24, 16)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., 30:] = False
    keep[1] = False
    fills = _fills(MIN32 * 0.2, MIN32 * 0.25, MIN32 * 0.2, MIN32 * 0.25)
    rows, (s1, s2, delta), _ = _check(q1, k1, q2, k2, mask=keep, mask_kind="bool_keep", causal="bottom_right",
                                      scale1=0.2, scale2=0.25, fills=fills, split_k=2, modes=("atomic_dq",))
    assert (rows[1].abs() < 1e-6).all() and torch.allclose(s1[1][1], torch.full_like(s1[1][1], math.log2(n_k)))
    # the maxima are huge, DELTA is not (offset-free)
    assert (s1[0][1] < -1e37).all() and (s2[0][1] < -1e37).all() and delta.abs().max() < 100


def test_mixed_sides_teacher_hidden_student_filled():
    # teacher masked with -inf, student with a finite fill: the student's softmax gives the
    # hidden keys mass, the teacher's none; rows the teacher hides entirely give L = 0
    b, h, n_q, n_k = 1, 2, 31, 40
    q1, k1, q2, k2 = _inputs(81, b, h, 2, 2, n_q, n_k, 16, 16)
    drop = torch.rand(1, h, n_q, n_k, generator=torch.Generator().manual_seed(82)) > 0.6
    drop[0, 1, 4] = True
    rows, _, grads = _check(q1, k1, q2, k2, mask=drop, mask_kind="bool_drop", fills=_fills(-math.inf, -0.5),
                            scale1=0.3, scale2=0.3, needs=(ALL,), modes=("two_kernel",))
    assert (rows[:, 1, 4] == 0).all()
    assert all((gr[i][:, 1, 4] == 0).all() for gr in grads.values() for i in (0, 2))


def test_additive_finfo_min_mask_rows_without_key_get_eager_gradients():
    # transformers' causal mask as an additive finfo.min tensor with Nq > Nk (bottom-right): the
    # first rows see only finfo.min entries, a uniform average in eager; with a nonzero upstream
    # gradient there, the gradients are eager's (two-part statistics)
    b, h, n_q, n_k = 1, 2, 40, 25
    q1, k1, q2, k2 = _inputs(83, b, h, 1, 2, n_q, n_k, 16, 16)
    keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
    bias = torch.where(keep, 0.0, MIN32)[None, None]
    g = torch.ones(b, h, n_q)
    rows, (s1, _, _), _ = _check(q1, k1, q2, k2, mask=bias, mask_kind="additive", g=g, split_k=2)
    e = n_q - n_k
    assert (rows[:, :, :e].abs() < 1e-6).all() and torch.allclose(s1[1][:, :, :e], torch.tensor(math.log2(n_k)))


def test_fills_fp16():
    q1, k1, q2, k2 = _inputs(84, 1, 2, 1, 2, 37, 45, 32, 16, dtype=torch.float16)
    drop = torch.rand(1, 1, 1, 45, generator=torch.Generator().manual_seed(85)) > 0.7
    _check(q1, k1, q2, k2, mask=drop, mask_kind="bool_drop", causal="bottom_right", needs=(ALL,),
           fills=_fills(-3.0, -2.0, -1.0, -1.5, "add"), modes=("atomic_dq",))


def test_neg_inf_fills_are_todays_kernels():
    q1, k1, q2, k2 = _inputs(86, 1, 2, 2, 1, 29, 37, 16, 16)
    keep = torch.rand(1, 1, 29, 37, generator=torch.Generator().manual_seed(87)) > 0.3
    kw = dict(scale1=0.3, scale2=0.2, causal="top_left", mask=keep, mask_kind="bool_keep")
    inf = _fills(mode="add")
    assert attention_kl.fill_variant("top_left", "bool_keep", **inf) == {"mask_fill_finite": False, "causal_fill": "hide"}
    a = attention_kl.forward(q1, k1, q2, k2, **kw)
    b = attention_kl.forward(q1, k1, q2, k2, **kw, **inf)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and a[1].shape == (1, 2, 29)
    g = torch.randn(a[0].shape)
    ga = attention_kl.backward(g, q1, k1, q2, k2, *a[1:], **kw)
    gb = attention_kl.backward(g, q1, k1, q2, k2, *b[1:], **kw, **inf)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_fill_arguments_are_checked():
    fv = attention_kl.fill_variant
    assert fv("none", "bool_drop", -1e4, -1e4) == {"mask_fill_finite": True, "causal_fill": "hide"}
    assert fv("bottom_right", "none", causal_fill2=-1.0, causal_fill_mode="add") == {"mask_fill_finite": False,
                                                                                     "causal_fill": "add"}
    for bad in (dict(mask_fill1=math.nan), dict(mask_fill2=math.inf), dict(causal_fill1=math.nan)):
        with pytest.raises(ValueError):
            fv("top_left", "bool_keep", **bad)
    with pytest.raises(ValueError):
        fv("top_left", "additive", mask_fill1=-1.0)  # a fill belongs to a boolean mask
    with pytest.raises(ValueError):
        fv("none", "none", causal_fill1=-1.0)  # ... and a causal fill to a causal mode
    with pytest.raises(ValueError):
        fv("top_left", "none", causal_fill_mode="multiply")
    # the backward refuses statistics of the other layout
    q1, k1, q2, k2 = _inputs(88, 1, 2, 2, 2, 9, 11, 16, 16)
    kw = dict(scale1=0.3, scale2=0.3, causal="top_left")
    rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, **kw)
    with pytest.raises(ValueError, match="two-part"):
        attention_kl.backward(torch.ones(rows.shape), q1, k1, q2, k2, lse1, lse2, delta, **kw, causal_fill1=-1.0,
                              causal_fill2=-1.0)


def test_fill_variants_render():
    for causal in (False, True):
        for kind in attention_kl.MASK_KINDS:
            for mask_fill in (False, True):
                for cfill in attention_kl.CAUSAL_FILLS:
                    fills = dict(mask_fill_finite=mask_fill, causal_fill=cfill)
                    for kern in attention_kl.kernels_for(causal=causal, mask_kind=kind, mask_row_broadcast=False,
                                                         split_k=True, bwd_mode="two_kernel", interpret=False,
                                                         training=True, teacher_grad=True, **fills):
                        compile(kern.source, kern.path, "exec")
                        code = kern.source.split("import triton.language as tl")[1]
                        mf = mask_fill and kind in ("bool_keep", "bool_drop")
                        cf = cfill if causal else "hide"
                        two_part = attention_kl.two_part_stats(kind, mf, cf)
                        assert ("_maskfill" in kern.name) == mf and ("_causalfill" in kern.name) == (cf == "replace")
                        assert ("_causaladd" in kern.name) == (cf == "add")
                        assert ("STATS1" in code) == two_part and ("LSE1" in code) == (not two_part)
                        if kern.name.startswith("attention_kl_fwd"):
                            assert ("mask_fill1" in code) == mf and ("causal_fill1" in code) == (cf != "hide")
                            assert ("DEFER_SCALE" in code) == (not two_part)
                            assert ("hi = N_K\n" in code) == (not causal or cf != "hide")  # tile skipping
                        else:  # replaced entries are hidden in the backward; only "add" needs its fill
                            assert "mask_fill1" not in code and ("causal_fill1" in code) == (cf == "add")
    default = attention_kl.fwd_kernel(causal=True, mask_kind="bool_keep", mask_row_broadcast=True, need_stats=True,
                                      split_k=False, interpret=False)
    hide = attention_kl.fwd_kernel(causal=True, mask_kind="bool_keep", mask_row_broadcast=True, need_stats=True,
                                   split_k=False, interpret=False, mask_fill_finite=False, causal_fill="hide")
    assert default.path == hide.path and default.name == "attention_kl_fwd_causal_maskkeep_rowbcast"
    # a fill flag without the structure it belongs to renders the plain variant
    plain = attention_kl.fwd_kernel(causal=False, mask_kind="additive", mask_row_broadcast=False, need_stats=True,
                                    split_k=False, interpret=False, mask_fill_finite=True, causal_fill="add")
    assert plain.name == "attention_kl_fwd_maskadd"


# --- the reference against eager PyTorch's spellings (float64) --------------------------------


def _eager_rows(s1, s2):
    return F.kl_div(F.log_softmax(s2, -1), F.log_softmax(s1, -1), reduction="none", log_target=True).sum(-1)


@pytest.mark.parametrize("case", ["masked_fill_before_scale", "where_causal_replace", "additive_causal_add",
                                  "bool_and_causal_add"])
def test_reference_matches_eager_spelling(case):
    # what users write, in float64, against the reference's fill semantics (forward and gradients)
    b, h, n_q, n_k, d = 2, 2, 13, 9, 8
    gen = torch.Generator().manual_seed(90)
    leaves = [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()
              for s in ((b, h, n_q, d), (b, 1, n_k, d), (b, h, n_q, d), (b, h, n_k, d))]
    q1, k1, q2, k2 = leaves
    k1r = k1.expand(b, h, n_k, d)
    above = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + (n_k - n_q)  # bottom-right, Nq > Nk
    drop = torch.rand(b, 1, 1, n_k, generator=gen) > 0.6
    drop[1] = True  # batch 1: every key filled
    if case == "masked_fill_before_scale":  # the fill is scaled with the scores: natural fill * scale per side
        s1 = (q1 @ k1r.mT).masked_fill(drop, -1e4) * 0.3
        s2 = (q2 @ k2.mT).masked_fill(drop, -1e4) * 1e-3
        kw = dict(mask=drop, mask_kind="bool_drop", mask_fill1=-1e4 * 0.3, mask_fill2=-1e4 * 1e-3)
        sc = (0.3, 1e-3)
    elif case == "where_causal_replace":
        s1 = torch.where(above, -2.0, q1 @ k1r.mT * 0.5)
        s2 = torch.where(above, -1.0, q2 @ k2.mT * 0.25)
        kw = dict(causal="bottom_right", causal_fill1=-2.0, causal_fill2=-1.0)
        sc = (0.5, 0.25)
    elif case == "additive_causal_add":
        s1 = q1 @ k1r.mT * 0.5 + torch.where(above, -3.0, 0.0)
        s2 = q2 @ k2.mT * 0.25 + torch.where(above, -3.0, 0.0)
        kw = dict(causal="bottom_right", causal_fill1=-3.0, causal_fill2=-3.0, causal_fill_mode="add")
        sc = (0.5, 0.25)
    else:
        s1 = (q1 @ k1r.mT * 0.5).masked_fill(drop, -4.0) + torch.where(above, -1.0, 0.0)
        s2 = (q2 @ k2.mT * 0.25).masked_fill(drop, -5.0) + torch.where(above, -2.0, 0.0)
        kw = dict(mask=drop, mask_kind="bool_drop", causal="bottom_right", mask_fill1=-4.0, mask_fill2=-5.0,
                  causal_fill1=-1.0, causal_fill2=-2.0, causal_fill_mode="add")
        sc = (0.5, 0.25)
    eager = _eager_rows(s1, s2)
    ref = reference(q1, k1, q2, k2, scale1=sc[0], scale2=sc[1], **kw)["rows"]
    assert torch.allclose(ref, eager, rtol=1e-10, atol=1e-12)
    g = torch.randn(eager.shape, generator=gen, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad((ref * g).sum(), leaves), torch.autograd.grad((eager * g).sum(), leaves)):
        assert torch.allclose(a, e, rtol=1e-9, atol=1e-12)


# --- zero_hidden: the KL terms of hidden entries zeroed (MiniLM-style losses) ------------------


def _eager_zeroed(q1, k1, q2, k2, *, scale1, scale2, causal="none", mask=None, mask_kind="none",
                  mask_fill1=-math.inf, mask_fill2=-math.inf, causal_fill1=-math.inf, causal_fill2=-math.inf,
                  causal_fill_mode="replace", **_):
    """The user's program in float64: each side's scores filled (``masked_fill`` for the mask and a
    causal "replace", an added ``where(above, fill, 0)`` for "add"), then
    ``kl_div(log_softmax(s2), log_softmax(s1), log_target=True).masked_fill(hidden, 0).sum(-1)``.
    Returns ``(rows, leaves)`` (float64 leaves made from the inputs)."""
    leaves = [t.detach().double().requires_grad_() for t in (q1, k1, q2, k2)]
    h, n_q, n_k = q1.shape[1], q1.shape[2], k1.shape[2]
    hidden = torch.zeros(n_q, n_k, dtype=torch.bool)
    drop = None if mask_kind == "none" else (~mask.bool() if mask_kind == "bool_keep" else mask.bool())
    above = None
    if causal != "none":
        above = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + (0 if causal == "top_left" else n_k - n_q)
        hidden = hidden | above
    if drop is not None:
        hidden = hidden | drop
    s = []
    for q, k, scale, mf, cf in ((leaves[0], leaves[1], scale1, mask_fill1, causal_fill1),
                                (leaves[2], leaves[3], scale2, mask_fill2, causal_fill2)):
        x = q @ k.repeat_interleave(h // k.shape[1], 1).mT * scale
        if drop is not None:
            x = x.masked_fill(drop, mf)
        if above is not None:
            x = x + torch.where(above, cf, 0.0) if causal_fill_mode == "add" else x.masked_fill(above, cf)
        s.append(x)
    kl = F.kl_div(F.log_softmax(s[1], -1), F.log_softmax(s[0], -1), reduction="none", log_target=True)
    return kl.masked_fill(hidden, 0).sum(-1), leaves


def _check_zero_hidden(q1, k1, q2, k2, *, tol=None, eager=True, **kw):
    """``_check`` with zero_hidden (against the float64 reference), then the kernels' rows and
    gradients (two_kernel, both sides trainable) against the user's eager spelling in float64.
    Returns ``_check``'s result and the eager rows."""
    g = torch.randn(q1.shape[:3], generator=torch.Generator().manual_seed(7))
    out = _check(q1, k1, q2, k2, zero_hidden=True, g=g, tol=tol, **kw)
    rows, _, grads = out
    if not eager:
        return out, None
    kw.setdefault("scale1", q1.shape[-1] ** -0.5)
    kw.setdefault("scale2", q2.shape[-1] ** -0.5)
    want, leaves = _eager_zeroed(q1, k1, q2, k2, **kw.get("fills", {}), **kw)
    tol = TOL[q1.dtype] if tol is None else tol
    assert not want.isnan().any()
    e = _rel(rows, want)
    assert e < tol, f"rows vs eager: relative error {e:.3g}"
    key = next(k for k in grads if k[1] == ALL)
    for name, got, exp in zip(("dq1", "dk1", "dq2", "dk2"), grads[key],
                              torch.autograd.grad((want * g.double()).sum(), leaves)):
        assert not exp.isnan().any()
        e = _rel(got, exp)
        assert e < tol, f"{name} vs eager: relative error {e:.3g}"
    return out, want.detach()


@pytest.mark.parametrize("case", ["nq=nk_top_left", "nq>nk_bottom_right_split"])
def test_zero_hidden_causal_finfo_min(case):
    # the MiniLM spelling: causal scores filled with finfo.min, the terms above the diagonal
    # zeroed; with Nq > Nk the first rows see no key (every entry filled): eager gives 0 and no
    # gradient there
    n_q, n_k, causal, split = (37, 37, "top_left", 1) if case.startswith("nq=nk") else (45, 29, "bottom_right", 3)
    q1, k1, q2, k2 = _inputs(120, 2, 2, 1, 2, n_q, n_k, 16, 24)
    fills = _fills(causal_fill1=MIN32, causal_fill2=MIN32)
    (rows, (s1, _, _), grads), want = _check_zero_hidden(q1, k1, q2, k2, causal=causal, fills=fills, split_k=split)
    e = max(n_q - n_k, 0)
    assert (rows[:, :, :e] == 0).all() and (s1[2][:, :, :e] == 1).all()  # every key filled: all mass hidden
    assert (s1[2][:, :, e:] == 0).all()  # beside a visible key no hidden mass survives finfo.min
    for gr in grads.values():
        assert (gr[2][:, :, :e] == 0).all() and (gr[0] is None or (gr[0][:, :, :e] == 0).all())


def test_zero_hidden_data_mask_with_fully_hidden_rows():
    # a per-head boolean mask with fully hidden rows and moderate fills (hidden mass is real):
    # those rows give L = 0 and pass no gradient to their queries; the zeroed KL differs from the
    # full one; GQA on both sides, split-K
    b, h, n_q, n_k = 2, 4, 33, 41
    q1, k1, q2, k2 = _inputs(121, b, h, 1, 2, n_q, n_k, 24, 16)
    keep = torch.rand(1, h, n_q, n_k, generator=torch.Generator().manual_seed(122)) > 0.4
    keep[0, 0, 5] = False
    keep[0, 3, 20:] = False
    fills = _fills(-2.0, -3.0)
    (rows, (s1, _, delta), grads), _ = _check_zero_hidden(q1, k1, q2, k2, mask=keep, mask_kind="bool_keep",
                                                          fills=fills, split_k=2, scale1=0.3, scale2=0.4)
    for hh, r in ((0, 5), (3, 25)):
        assert (rows[:, hh, r] == 0).all() and (delta[:, hh, r] == 0).all()
        assert torch.allclose(s1[2][:, hh, r], torch.ones(b)) and (s1[3][:, hh, r] == 0).all()
        for gr in grads.values():
            assert (gr[2][:, hh, r] == 0).all() and (gr[0] is None or (gr[0][:, hh, r] == 0).all())
    full = reference(q1, k1, q2, k2, scale1=0.3, scale2=0.4, mask=keep, mask_kind="bool_keep", **fills)["rows"]
    assert _rel(rows, full) > 0.01


@pytest.mark.parametrize("case", ["bool_drop_full", "causal_replace_bottom_right_split"])
def test_zero_hidden_adversarial_fill_near_the_scores(case):
    # scores ~ -1e4 (scale 1000) and fills of -1e4: much of each row's mass is hidden, and the
    # zeroed terms are far from negligible
    b, h, n_q, n_k = 2, 2, 37, 45
    q1, k1, q2, k2 = _near_fill_inputs(123, b, h, n_q, n_k, 16)
    if case == "bool_drop_full":
        mask = torch.rand(1, h, n_q, n_k, generator=torch.Generator().manual_seed(124)) > 0.5
        kw = dict(mask=mask, mask_kind="bool_drop", fills=_fills(-1e4, -1e4 + 2.0), split_k=1)
    else:
        kw = dict(causal="bottom_right", fills=_fills(causal_fill1=-1e4, causal_fill2=-1e4 + 3.0), split_k=2)
    (rows, (s1, _, _), _), _ = _check_zero_hidden(q1, k1, q2, k2, scale1=1000.0, scale2=1000.0, tol=2e-3,
                                                  needs=(ALL,), **kw)
    assert s1[2].max() > 0.5  # rows whose mass is mostly hidden
    full = reference(q1, k1, q2, k2, scale1=1000.0, scale2=1000.0, causal=kw.get("causal", "none"),
                     mask=kw.get("mask"), mask_kind=kw.get("mask_kind", "none"), **kw["fills"])["rows"]
    assert _rel(rows, full) > 0.05


ZERO_ADD_CASES = [
    # id, dtype, B, H, Hkv1, Hkv2, Nq, Nk, D1, D2, causal, mask, fills, split_k, modes
    ("transformers_finfo_min_q>k", torch.float32, 1, 2, 1, 2, 40, 25, 16, 16, "bottom_right", None,
     _fills(causal_fill1=MIN32, causal_fill2=MIN32, mode="add"), 2, BWD_MODES),
    ("moderate_q>k_gqa_split", torch.float32, 1, 4, 2, 1, 45, 29, 16, 24, "bottom_right", None,
     _fills(causal_fill1=-1.5, causal_fill2=-0.5, mode="add"), 3, BWD_MODES),
    ("bool_drop_and_add_q<k_fp16", torch.float16, 1, 2, 1, 2, 29, 50, 32, 16, "top_left", "drop",
     _fills(-3.0, -2.0, -1.0, -1.5, "add"), 1, ("atomic_dq",)),
]


@pytest.mark.parametrize("case", ZERO_ADD_CASES, ids=[c[0] for c in ZERO_ADD_CASES])
def test_zero_hidden_additive_causal(case):
    # an additive causal mask (transformers' finfo.min, or a moderate bias) whose terms are then
    # zeroed: the gradient flows through the shifted entries (dS1 = -g P1 (L + w1),
    # dS2 = g w1 P2); rows with no visible key give L = 0 and no gradient (eager: the same)
    _, dtype, b, h, hkv1, hkv2, n_q, n_k, d1, d2, causal, spec, fills, split, modes = case
    q1, k1, q2, k2 = _inputs(125 + ZERO_ADD_CASES.index(case), b, h, hkv1, hkv2, n_q, n_k, d1, d2, dtype=dtype)
    mask, kind = None, "none"
    if spec == "drop":
        mask = torch.rand(b, 1, 1, n_k, generator=torch.Generator().manual_seed(126)) > 0.7
        kind = "bool_drop"
    (rows, (s1, _, _), grads), _ = _check_zero_hidden(q1, k1, q2, k2, causal=causal, mask=mask, mask_kind=kind,
                                                      fills=fills, split_k=split, modes=modes, scale1=0.4, scale2=0.3)
    e = max(n_q - n_k, 0)
    assert (rows[:, :, :e] == 0).all() and (s1[3][:, :, :e] == 0).all()
    for gr in grads.values():
        assert (gr[2][:, :, :e] == 0).all() and (gr[0] is None or (gr[0][:, :, :e] == 0).all())
    if fills["causal_fill1"] > -1e30 and e:  # the hidden entries carry mass: the full KL differs there
        assert (s1[2][:, :, e:] > 0).any()


def test_zero_hidden_teacher_filled_student_hidden():
    # the teacher fills hidden entries, the student hides them (-inf): the full KL is +inf, the
    # zeroed one is finite (the eager spelling gives NaN gradients here: only the reference)
    b, h, n_q, n_k = 1, 2, 31, 40
    q1, k1, q2, k2 = _inputs(127, b, h, 2, 2, n_q, n_k, 16, 16)
    drop = torch.rand(1, h, n_q, n_k, generator=torch.Generator().manual_seed(128)) > 0.6
    drop[0, 1, 4] = True  # a row with only hidden keys: side 2 has no finite score at all
    fills = _fills(-0.5, -math.inf)
    (rows, (s1, s2, _), grads), _ = _check_zero_hidden(q1, k1, q2, k2, mask=drop, mask_kind="bool_drop", fills=fills,
                                                       scale1=0.3, scale2=0.3, eager=False)
    assert torch.isinf(reference(q1, k1, q2, k2, scale1=0.3, scale2=0.3, mask=drop, mask_kind="bool_drop",
                                 **fills)["rows"]).any()
    assert torch.isfinite(rows).all() and (rows[:, 1, 4] == 0).all()
    assert (s2[0][:, 1, 4] == 0).all() and torch.isposinf(s2[1][:, 1, 4]).all()  # side 2 stored as empty


def test_zero_hidden_split_k_equals_one_pass():
    q1, k1, q2, k2 = _inputs(129, 2, 2, 1, 2, 37, 75, 32, 24)
    keep = torch.rand(2, 1, 1, 75, generator=torch.Generator().manual_seed(130)) > 0.3
    kw = dict(scale1=0.2, scale2=0.3, causal="top_left", mask=keep, mask_kind="bool_keep", zero_hidden=True,
              **_fills(-1.0, -2.0, -0.5, -0.5, "add"))
    one = attention_kl.forward(q1, k1, q2, k2, split_k=1, **kw)
    for split in (2, 3, 8):
        with launch.poison_outputs():
            got = attention_kl.forward(q1, k1, q2, k2, split_k=split, **kw)
        for name, a, b in zip(("rows", "stats1", "stats2", "delta"), got, one):
            assert a.shape == b.shape and not a.isnan().any(), (name, split)
            fin = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), fin) and torch.equal(a[~fin], b[~fin]), (name, split)
            assert (a[fin] - b[fin]).abs().max().item() < 1e-5 * (1 + b[fin].abs().max().item()), (name, split)


def test_zero_hidden_without_finite_fills_is_todays_kernels():
    # -inf fills give hidden entries no mass: zero_hidden changes nothing and renders nothing new
    q1, k1, q2, k2 = _inputs(131, 1, 2, 2, 1, 29, 37, 16, 16)
    keep = torch.rand(1, 1, 29, 37, generator=torch.Generator().manual_seed(132)) > 0.3
    kw = dict(scale1=0.3, scale2=0.2, causal="top_left", mask=keep, mask_kind="bool_keep")
    assert not attention_kl.zero_hidden_flag(True, "bool_keep", False, "hide")
    assert not attention_kl.zero_hidden_flag(True, "additive", True, "hide")  # an additive mask hides nothing
    assert attention_kl.zero_hidden_flag(True, "additive", False, "add")
    assert attention_kl.stat_planes("bool_keep", True, "hide", True) == (4, 2)
    assert attention_kl.stat_planes("bool_keep", False, "hide", True) == (0, 0)
    a = attention_kl.forward(q1, k1, q2, k2, **kw)
    b = attention_kl.forward(q1, k1, q2, k2, zero_hidden=True, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and a[1].shape == (1, 2, 29)
    g = torch.randn(a[0].shape)
    ga = attention_kl.backward(g, q1, k1, q2, k2, *a[1:], **kw)
    gb = attention_kl.backward(g, q1, k1, q2, k2, *b[1:], zero_hidden=True, **kw)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    # the backward refuses statistics of the other layout
    fills = _fills(-1.0, -1.0)
    rows, s1, s2, delta = attention_kl.forward(q1, k1, q2, k2, **kw, **fills)
    with pytest.raises(ValueError, match=r"\[4, B, H, Nq\]"):
        attention_kl.backward(g, q1, k1, q2, k2, s1, s2, delta, zero_hidden=True, **kw, **fills)


def test_zero_hidden_variants_render():
    for causal in (False, True):
        for kind in attention_kl.MASK_KINDS:
            for mask_fill in (False, True):
                for cfill in attention_kl.CAUSAL_FILLS:
                    for split, stats in ((True, True), (False, True), (False, False)):
                        flags = dict(causal=causal, mask_kind=kind, mask_row_broadcast=True, split_k=split,
                                     bwd_mode="two_kernel" if split else "atomic_dq", interpret=False,
                                     training=stats, teacher_grad=split, mask_fill_finite=mask_fill,
                                     causal_fill=cfill)
                        zero = attention_kl.kernels_for(zero_hidden=True, **flags)
                        plain = attention_kl.kernels_for(**flags)
                        mf = mask_fill and kind in ("bool_keep", "bool_drop")
                        cf = cfill if causal else "hide"
                        active = mf or cf != "hide"
                        assert attention_kl.zero_hidden_flag(True, kind, mf, cf) == active
                        for z, p in zip(zero, plain):
                            if not active:  # normalised: the same kernel
                                assert z.path == p.path and z.source == p.source
                                continue
                            compile(z.source, z.path, "exec")
                            code = z.source.split("import triton.language as tl")[1]
                            assert "_zerohidden" in z.name and z.name.replace("_zerohidden", "") == p.name
                            assert "#   zeroed:" in z.source or "# zeroed:" in z.source
                            if z.name.startswith("attention_kl_fwd"):
                                assert "lh1" in code and "lv1" in code and "p1v" in code
                                assert ("tl.store(STATS1 + 3 * N_ROWS + row, w1" in code) == stats
                                assert ("[6, SPLIT_K, N_ROWS]" in code) == split
                            else:
                                assert "W1_row" in code and "w1[None, :]" in code
                                assert ("e1 = tl.where(w1 > 0.0" in code) == (cf == "add" and split)


@pytest.mark.parametrize("case", ["causal_finfo_min_q>k", "data_mask_fully_hidden_rows", "additive_finfo_min_q>k",
                                  "bool_and_causal_add", "adversarial_scale"])
def test_reference_zero_hidden_matches_eager_spelling(case):
    # the MiniLM program (kl_div of the filled scores' log-softmaxes, hidden terms zeroed with
    # masked_fill(m, 0)) in float64 against the reference's zero_hidden, forward and gradients
    b, h, n_q, n_k, d = 2, 2, 13, 9, 8
    gen = torch.Generator().manual_seed(140)
    q1, k1, q2, k2 = (torch.randn(*s, generator=gen, dtype=torch.float64)
                      for s in ((b, h, n_q, d), (b, 1, n_k, d), (b, h, n_q, d), (b, h, n_k, d)))
    drop = torch.rand(b, 1, n_q, n_k, generator=gen) > 0.6
    drop[1, :, 3] = True  # a fully hidden row
    kw = dict(scale1=0.5, scale2=0.25)
    if case == "causal_finfo_min_q>k":
        kw.update(causal="bottom_right", **_fills(causal_fill1=MIN32, causal_fill2=MIN32))
    elif case == "data_mask_fully_hidden_rows":
        kw.update(mask=drop, mask_kind="bool_drop", **_fills(-2.0, -1.0))
    elif case == "additive_finfo_min_q>k":
        kw.update(causal="bottom_right", **_fills(causal_fill1=MIN32, causal_fill2=MIN32, mode="add"))
    elif case == "bool_and_causal_add":
        kw.update(mask=~drop, mask_kind="bool_keep", causal="top_left", **_fills(-4.0, -5.0, -1.0, -2.0, "add"))
    else:  # scores of size 1e2 and fills near them
        kw.update(scale1=30.0, scale2=40.0, mask=drop, mask_kind="bool_drop", **_fills(-20.0, -25.0))
    eager, leaves = _eager_zeroed(q1, k1, q2, k2, **kw)
    ref = reference(*leaves, zero_hidden=True, **kw)
    assert torch.allclose(ref["rows"], eager, rtol=1e-10, atol=1e-12)
    assert torch.allclose(ref["h1"] + ref["w1"], torch.ones_like(ref["h1"]))
    g = torch.randn(eager.shape, generator=gen, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad((ref["rows"] * g).sum(), leaves, retain_graph=True),
                    torch.autograd.grad((eager * g).sum(), leaves)):
        assert not a.isnan().any() and torch.allclose(a, e, rtol=1e-9, atol=1e-12 * (1 + e.abs().max().item()))


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_zero_hidden_gradient_formulas(mode):
    # the formulas the kernels implement (KL_ZEROED.md, natural units), against autograd in
    # float64 on score rows: visible dS1 = g P1 (r - L + h1), dS2 = g (P2 (1 - h1) - P1);
    # hidden, added: dS1 = -g P1 (L + 1 - h1), dS2 = g P2 (1 - h1); hidden, replaced: none
    gen = torch.Generator().manual_seed(141)
    n = 23
    s1 = (3 * torch.randn(6, n, generator=gen, dtype=torch.float64)).requires_grad_()
    s2 = (3 * torch.randn(6, n, generator=gen, dtype=torch.float64)).requires_grad_()
    hid = torch.rand(6, n, generator=gen) < 0.4
    hid[0] = True  # a row with no visible entry
    hid[1, 0] = False
    fill1, fill2 = torch.tensor(1.0, dtype=torch.float64), torch.tensor(-0.5, dtype=torch.float64)
    if mode == "add":
        t1, t2 = torch.where(hid, s1 + fill1, s1), torch.where(hid, s2 + fill2, s2)
    else:
        t1, t2 = torch.where(hid, fill1, s1), torch.where(hid, fill2, s2)
    lp1, lp2 = F.log_softmax(t1, -1), F.log_softmax(t2, -1)
    rows = (lp1.exp() * (lp1 - lp2)).masked_fill(hid, 0).sum(-1)
    g = torch.randn(6, generator=gen, dtype=torch.float64)
    d1, d2 = torch.autograd.grad((rows * g).sum(), (s1, s2))
    with torch.no_grad():
        p1, p2, r = lp1.exp(), lp2.exp(), lp1 - lp2
        h1 = torch.where(hid, p1, 0.0).sum(-1, keepdim=True)
        big_l, gg = rows[:, None], g[:, None]
        hidden1 = -gg * p1 * (big_l + 1 - h1) if mode == "add" else torch.zeros_like(p1)
        hidden2 = gg * p2 * (1 - h1) if mode == "add" else torch.zeros_like(p2)
        f1 = torch.where(hid, hidden1, gg * p1 * (r - big_l + h1))
        f2 = torch.where(hid, hidden2, gg * (p2 * (1 - h1) - p1))
    assert torch.allclose(d1, f1, rtol=1e-10, atol=1e-13) and torch.allclose(d2, f2, rtol=1e-10, atol=1e-13)
    assert (d1[0] == 0).all() and (d2[0].abs() < 1e-15).all()  # no visible entry: no gradient


# --- layouts, options ------------------------------------------------------------------------


def test_strided_views_and_expanded_upstream_grad():
    b, n, h, d = 2, 45, 2, 32
    gen = torch.Generator().manual_seed(31)
    qkv1 = torch.randn(b, n, 3, h, d, generator=gen)  # teacher: q, k, v views of one buffer
    qk2 = torch.randn(b, n, h, 2, 24, generator=gen)  # student: another interleaving
    q1, k1 = qkv1[:, :, 0].transpose(1, 2), qkv1[:, :, 1].transpose(1, 2)
    q2, k2 = qk2[:, :, :, 0].transpose(1, 2), qk2[:, :, :, 1].transpose(1, 2)
    assert not any(t.is_contiguous() for t in (q1, k1, q2, k2))
    g = torch.full((1, 1, 1), 0.5).expand(b, h, n)  # rows.sum() * 0.5: stride 0 everywhere
    _check(q1, k1, q2, k2, causal="top_left", g=g)
    g2 = torch.randn(b, n, h, generator=gen).transpose(1, 2)  # strided, another dtype
    _check(q1, k1, q2, k2, g=g2.double(), modes=("atomic_dq",), needs=(ALL,))


@pytest.mark.parametrize("mode", BWD_MODES)
@pytest.mark.parametrize(
    "need",
    [(True, False, False, False), (False, True, False, False), (False, False, False, True), (False, True, False, True)],
    ids=["dq1", "dk1", "dk2", "dk1_dk2"],
)
def test_needs_grad_subsets(mode, need):
    q1, k1, q2, k2 = _inputs(34, 1, 4, 1, 2, 37, 29, 32, 24)
    _check(q1, k1, q2, k2, causal="bottom_right", modes=(mode,), needs=(need,))


def test_atomic_dq_chunks_cover_every_head_once():
    chunk = attention_kl.atomic_dq_chunks
    assert chunk(2, 8, 1, 1, 100, budget=1600) == [(slice(None), slice(None))]
    # whole batches per chunk
    assert chunk(3, 8, 1, 1, 100, budget=1600) == [(slice(0, 2), slice(None)), (slice(2, 3), slice(None))]
    # head chunks aligned to lcm(group1, group2) = 6 query heads
    got = chunk(2, 12, 2, 3, 100, budget=700)
    assert got == [(slice(b, b + 1), slice(h, h + 6)) for b in (0, 1) for h in (0, 6)]
    # a single unit above the budget still runs, one unit per chunk
    assert chunk(1, 4, 2, 2, 100, budget=10) == [(slice(0, 1), slice(0, 2)), (slice(0, 1), slice(2, 4))]


@pytest.mark.parametrize("need,fills", [(ALL, None), (FROZEN, None), (ALL, "causal_add")],
                         ids=["both", "frozen", "both_two_part_stats"])
def test_atomic_dq_in_chunks_matches_reference(monkeypatch, need, fills):
    # fp16 (float32 inputs accumulate in place, no chunks); a budget of one kv-head group of
    # side 2 per chunk: 3 batches x 2 chunks, GQA groups 2 and 1 (lcm 2)
    b, h, n_q, n_k, d1, d2 = 3, 4, 33, 40, 32, 16
    q1, k1, q2, k2 = _inputs(36, b, h, 2, 4, n_q, n_k, d1, d2, dtype=torch.float16)
    row_bytes = 4 * ((d1 if need[0] else 0) + d2)
    monkeypatch.setattr(attention_kl, "ATOMIC_DQ_WORKSPACE_BYTES", 2 * n_q * row_bytes)
    assert len(attention_kl.atomic_dq_chunks(b, h, 2, 1, n_q * row_bytes)) == 6
    # two-part statistics ([2, B, H, Nq]) are sliced per chunk with both planes
    fills = dict(causal_fill1=-1.0, causal_fill2=-2.0, causal_fill_mode="add") if fills else None
    _check(q1, k1, q2, k2, causal="bottom_right", modes=("atomic_dq",), needs=(need,), fills=fills)


def test_frozen_teacher_needs_no_delta():
    q1, k1, q2, k2 = _inputs(35, 1, 2, 2, 2, 20, 30, 32, 32)
    rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, scale1=0.2, scale2=0.3)
    g = torch.randn(rows.shape)
    a = attention_kl.backward(g, q1, k1, q2, k2, lse1, lse2, None, scale1=0.2, scale2=0.3, needs_grad=FROZEN)
    b = attention_kl.backward(g, q1, k1, q2, k2, lse1, lse2, delta, scale1=0.2, scale2=0.3, needs_grad=FROZEN)
    assert a[0] is None and a[1] is None and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    with pytest.raises(ValueError):
        attention_kl.backward(g, q1, k1, q2, k2, lse1, lse2, None, scale1=0.2, scale2=0.3)
    src = attention_kl.bwd_kernel(causal="none", mask_kind="none", mask_row_broadcast=False,
                                  bwd_mode="two_kernel", teacher_grad=False, interpret=False).source
    src = src.split("import triton.language as tl")[1]  # the code, not the header comment
    assert "Delta" not in src and "dK1" not in src and "dQ1" not in src


def test_need_stats_false():
    q1, k1, q2, k2 = _inputs(33, 2, 2, 2, 2, 37, 50, 32, 32)
    kw = dict(scale1=0.2, scale2=0.3, causal="bottom_right")
    rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, need_stats=False, **kw)
    assert lse1 is None and lse2 is None and delta is None
    assert _rel(rows, reference(q1, k1, q2, k2, **kw)["rows"]) < 1e-4
    for split in (False, True):
        src = attention_kl.fwd_kernel(causal=True, mask_kind="none", mask_row_broadcast=False,
                                      need_stats=False, split_k=split, interpret=True).source
        assert "LSE1" not in src.split("import triton")[1].split("def launch_fwd")[0]


def test_given_output_buffers():
    q1, k1, q2, k2 = _inputs(36, 1, 2, 2, 2, 20, 30, 32, 32)
    bufs = [attention_kl.alloc_rows(q1)] + [attention_kl.alloc_stats(q1) for _ in range(3)]
    got = attention_kl.forward(q1, k1, q2, k2, scale1=0.2, scale2=0.3, rows=bufs[0], lse1=bufs[1],
                               lse2=bufs[2], delta=bufs[3])
    assert all(a is b for a, b in zip(got, bufs))


def test_two_kernel_mode_is_deterministic():
    q1, k1, q2, k2 = _inputs(37, 1, 4, 1, 2, 40, 40, 32, 32)
    kw = dict(scale1=0.2, scale2=0.3, causal="top_left")
    rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, **kw)
    g = torch.randn(rows.shape)
    a = attention_kl.backward(g, q1, k1, q2, k2, lse1, lse2, delta, **kw)
    b = attention_kl.backward(g, q1, k1, q2, k2, lse1, lse2, delta, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_empty_sizes():
    # Nq == 0, B == 0: empty outputs, nothing launched
    for b, n_q, n_k in [(2, 0, 5), (0, 7, 5)]:
        q1, k1, q2, k2 = _inputs(38, b, 2, 2, 1, n_q, n_k, 32, 16)
        rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, scale1=0.1, scale2=0.1)
        assert rows.shape == (b, 2, n_q) and lse1.shape == (b, 2, n_q)
        grads = attention_kl.backward(torch.zeros(rows.shape), q1, k1, q2, k2, lse1, lse2, delta,
                                      scale1=0.1, scale2=0.1)
        assert all(gr.shape == t.shape and (gr == 0).all() for gr, t in zip(grads, (q1, k1, q2, k2)))
    # Nk == 0: every row is empty -> L 0, LSE +inf, gradients 0
    q1, k1, q2, k2 = _inputs(39, 1, 2, 2, 1, 7, 0, 32, 16)
    with launch.poison_outputs():
        rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, scale1=0.1, scale2=0.1)
        assert (rows == 0).all() and torch.isposinf(lse1).all() and torch.isposinf(lse2).all()
        assert (delta == 0).all()
        grads = attention_kl.backward(torch.ones(rows.shape), q1, k1, q2, k2, lse1, lse2, delta,
                                      scale1=0.1, scale2=0.1)
    assert all(gr.shape == t.shape and (gr == 0).all() for gr, t in zip(grads, (q1, k1, q2, k2)))


def test_alloc_helpers_work_on_meta_tensors():
    q1 = torch.empty(2, 4, 9, 24, device="meta")
    k1 = torch.empty(2, 1, 11, 24, device="meta")
    q2 = torch.empty(2, 4, 9, 40, device="meta")
    k2 = torch.empty(2, 2, 11, 40, device="meta")
    rows = attention_kl.alloc_rows(q1)
    assert rows.shape == (2, 4, 9) and rows.dtype == torch.float32 and rows.is_contiguous()
    assert attention_kl.alloc_stats(q1).shape == (2, 4, 9)
    dq1, dk1, dq2, dk2 = attention_kl.alloc_grads(q1, k1, q2, k2, (False, False, True, True))
    assert dq1 is None and dk1 is None and dq2.shape == q2.shape and dk2.shape == k2.shape
    assert dk2.is_contiguous()


def test_rejects_bad_inputs():
    q1, k1, q2, k2 = _inputs(40, 1, 3, 3, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError):
        attention_kl.forward(q1, k1, q2, k2, scale1=1.0, scale2=1.0)  # 3 query heads, 2 kv heads
    q1, k1, q2, k2 = _inputs(40, 1, 2, 2, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError):
        attention_kl.forward(q1, k1, q2[:, :, :7], k2, scale1=1.0, scale2=1.0)  # Nq differs
    with pytest.raises(ValueError):
        attention_kl.forward(q1, k1, q2, k2.half(), scale1=1.0, scale2=1.0)
    with pytest.raises(ValueError):
        attention_kl.forward(q1, k1, q2, k2, scale1=1.0, scale2=1.0, mask=torch.ones(8, 8, dtype=torch.bool),
                             mask_kind="additive")
    with pytest.raises(ValueError):
        attention_kl.forward(q1, k1, q2, k2, scale1=1.0, scale2=1.0, causal="diagonal")
    with pytest.raises(ValueError):
        attention_kl.backward(torch.zeros(1, 2, 8), q1, k1, q2, k2, None, None, None, scale1=1.0, scale2=1.0,
                              bwd_mode="fused")


# --- numerics --------------------------------------------------------------------------------


def _streamed_rows_fp32(s1, s2, block_n, offset_free):
    """A float32 torch emulation of the streaming forward (base-2 scores), with the offset-free
    accumulator or the naive one that sums raw s1 - s2; returns L in nats."""
    shape = s1.shape[:-1]
    m1 = torch.full(shape, -math.inf)
    m2, l1, l2, acc = m1.clone(), torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    for j in range(0, s1.shape[-1], block_n):
        t1, t2 = s1[..., j:j + block_n], s2[..., j:j + block_n]
        n1, n2 = torch.maximum(m1, t1.amax(-1)), torch.maximum(m2, t2.amax(-1))
        a1, a2 = torch.exp2(m1 - n1), torch.exp2(m2 - n2)
        p1, p2 = torch.exp2(t1 - n1[..., None]), torch.exp2(t2 - n2[..., None])
        if offset_free:
            shift = torch.where(l1 > 0, ((m1 - n1) - (m2 - n2)) * l1, torch.zeros_like(l1))
            acc = a1 * (acc + shift) + (p1 * ((t1 - n1[..., None]) - (t2 - n2[..., None]))).sum(-1)
        else:
            acc = a1 * acc + (p1 * (t1 - t2)).sum(-1)
        l1, l2, m1, m2 = a1 * l1 + p1.sum(-1), a2 * l2 + p2.sum(-1), n1, n2
    if offset_free:
        return (acc / l1 + torch.log2(l2 / l1)) * LN2
    return (acc / l1 - (m1 + torch.log2(l1)) + (m2 + torch.log2(l2))) * LN2


def test_offset_free_accumulator_is_accurate_with_large_scores():
    # A student whose scores are the teacher's plus a per-row offset of up to +-50 (softmax does
    # not see it) plus a small perturbation: |S2| ~ 50, KL ~ 1e-4. Summing raw s1 - s2 in fp32
    # cancels ~50-sized terms against the LSE difference; the offset-free accumulator never
    # forms them.
    b, h, n, d = 1, 2, 64, 32
    gen = torch.Generator().manual_seed(51)
    q1 = torch.randn(b, h, n, d, generator=gen) * 2 / d ** 0.25
    k1 = torch.randn(b, h, n, d, generator=gen) / d ** 0.25
    offset = (torch.rand(b, h, n, 1, generator=gen) * 2 - 1) * 50
    q2 = torch.cat([q1 + 0.01 * torch.randn(b, h, n, d, generator=gen) / d ** 0.25, offset], -1)
    k2 = torch.cat([k1, torch.ones(b, h, n, 1)], -1)  # D2 = D1 + 1: S2 = S1' + offset
    kw = dict(scale1=1.0, scale2=1.0)
    ref = reference(q1, k1, q2, k2, **kw)["rows"]
    assert 40 < (q2 @ k2.transpose(-1, -2)).abs().max() < 80 and 1e-5 < ref.mean() < 1e-3
    rows = attention_kl.forward(q1, k1, q2, k2, need_stats=False, **kw)[0]
    err = (rows - ref).abs().max().item()
    s1 = (q1 @ k1.transpose(-1, -2)) * LOG2E
    s2 = (q2 @ k2.transpose(-1, -2)) * LOG2E
    raw_err = (_streamed_rows_fp32(s1, s2, 16, False) - ref).abs().max().item()
    free_err = (_streamed_rows_fp32(s1, s2, 16, True) - ref).abs().max().item()
    assert err < 1e-6, f"kernel error {err:.3g}"
    assert raw_err > 10 * max(err, free_err), f"raw {raw_err:.3g} vs kernel {err:.3g}, offset-free {free_err:.3g}"


# --- rendering and configs -------------------------------------------------------------------


def test_kernels_for_renders_every_variant():
    seen = set()
    for causal in attention_kl.CAUSAL_MODES:
        for mask_kind in attention_kl.MASK_KINDS:
            for row in (False, True):
                for split in (False, True):
                    for bwd_mode in attention_kl.BWD_MODES:
                        for interpret in (False, True):
                            for training in (False, True):
                                for teacher in (False, True):
                                    ks = attention_kl.kernels_for(
                                        causal=causal, mask_kind=mask_kind, mask_row_broadcast=row,
                                        split_k=split, bwd_mode=bwd_mode, interpret=interpret,
                                        training=training, teacher_grad=teacher,
                                    )
                                    assert len(ks) == (2 if training else 1)
                                    for kern in ks:
                                        if kern.path not in seen:
                                            seen.add(kern.path)
                                            compile(kern.source, kern.path, "exec")
                                    fwd = ks[0].source
                                    assert ks[0].name.startswith("attention_kl_fwd")
                                    assert "def attention_kl_fwd_kernel" in fwd and "def launch_fwd" in fwd
                                    assert ("def attention_kl_fwd_merge" in fwd) == split
                                    assert ("tl.store(LSE1" in fwd) == (training and mask_kind != "additive")
                                    assert ("tl.store(STATS1" in fwd) == (training and mask_kind == "additive")
                                    if training:
                                        src = ks[1].source
                                        assert "def attention_kl_bwd_dk(" in src and "def launch_bwd" in src
                                        assert ("def attention_kl_bwd_dq(" in src) == (bwd_mode == "two_kernel")
                                        assert ("tl.atomic_add" in src) == (bwd_mode == "atomic_dq")
                                        assert ("dK1" in src.split("import triton.language")[1]) == teacher
    k_gpu = attention_kl.fwd_kernel(causal="top_left", mask_kind="additive", mask_row_broadcast=False,
                                    need_stats=True, split_k=False, interpret=False)
    k_cpu = attention_kl.fwd_kernel(causal="top_left", mask_kind="additive", mask_row_broadcast=False,
                                    need_stats=True, split_k=False, interpret=True)
    assert k_gpu.name == "attention_kl_fwd_causal_maskadd" and k_cpu.path != k_gpu.path
    assert "tl.float32)" not in k_gpu.source.split("tl.dot(")[1].split("\n")[0]
    for word in ("CAUSAL_OFFSET", "BLOCK_M", "BLOCK_N", "GROUP1", "GROUP2", "STATS1", "DELTA"):
        assert word in k_gpu.source


def test_config_table(monkeypatch):
    t = attention_kl_configs
    check_table(t._FWD_TABLE, t._BWD_TABLE)
    for extra, base in ((t._FWD_CAUSAL_TABLE, t._FWD_TABLE), (t._BWD_FROZEN_TABLE, t._BWD_TABLE),
                        (t._BWD_CAUSAL_TABLE, t._BWD_TABLE)):
        for key, cands in extra.items():
            assert key in base and cands
            for c in cands:
                assert set(c) == set(base[key][0])
    kw = dict(head_dim1=128, head_dim2=128, dtype=torch.bfloat16, device="cuda", kind="bwd")
    monkeypatch.setattr(attention_kl_configs, "device_kind", lambda d: "sm90")
    assert attention_kl.candidate_configs(causal="top_left", **kw) == t._BWD_CAUSAL_TABLE[("sm90", 128, 2)]
    assert attention_kl.candidate_configs(causal="none", **kw) == t._BWD_TABLE[("sm90", 128, 2)]
    assert (attention_kl.candidate_configs(causal="top_left", teacher_grad=False, **kw)
            == t._BWD_FROZEN_TABLE[("sm90", 128, 2)])
    monkeypatch.undo()
    first = attention_kl.candidate_configs(head_dim1=80, head_dim2=24, dtype=torch.float16, device="cpu", kind="fwd")
    assert first[0]["num_stages"] == 1 and first[0]["BLOCK_M"] <= 32


def test_default_split_k(monkeypatch):
    assert attention_kl.default_split_k(1, 1, 64, 8192, "cpu") == 1  # interpreter: 1 unless asked
    monkeypatch.setattr(launch, "interpreted", lambda device: False)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    # big grid: 8 * 16 * 32 = 4096 programs >= 2 waves
    assert attention_kl.default_split_k(8, 16, 4096, 4096, "cuda") == 1
    # one head, 8 query blocks: split to reach ~264 programs, capped at 16
    assert attention_kl.default_split_k(1, 1, 1024, 65536, "cuda") == 16
    # 2 * 4 * 8 = 64 programs -> 5 splits, but 1024 keys / 64 = 16 tiles allow at most 4
    assert attention_kl.default_split_k(2, 4, 1024, 1024, "cuda") == 4
    assert attention_kl.default_split_k(2, 4, 1024, 1024, "cuda", {"BLOCK_M": 64, "BLOCK_N": 32}) == 3
    assert attention_kl.default_split_k(1, 1, 64, 100, "cuda") == 1  # too few key tiles to split


# ---------------------------------------------------------------------------------------------
# GPU tests (compiled kernels, realistic sizes)
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # id, dtype, B, H, Hkv1, Hkv2, Nq, Nk, D1, D2, causal, mask
    ("bf16_d128_causal", torch.bfloat16, 1, 8, 8, 8, 2048, 2048, 128, 128, "top_left", None),
    ("bf16_d64_gqa_n4096", torch.bfloat16, 1, 4, 1, 2, 4096, 4096, 64, 64, "none", None),
    ("fp16_d128_d64_bottom_right_ragged", torch.float16, 2, 4, 4, 2, 1000, 1536, 128, 64, "bottom_right", None),
    ("bf16_d128_keypad", torch.bfloat16, 2, 4, 4, 4, 1024, 1024, 128, 128, "none", "keypad"),
    ("fp16_d64_bias_causal", torch.float16, 1, 4, 2, 4, 1024, 1024, 64, 64, "top_left", "bias"),
    ("bf16_d256_d128", torch.bfloat16, 1, 4, 4, 4, 1024, 1024, 256, 128, "none", None),
    ("fp32_d64", torch.float32, 1, 4, 4, 4, 1024, 1024, 64, 64, "top_left", None),
]


def _check_gpu_backward(g, q1, k1, q2, k2, stats1, stats2, delta, ref_grads, tol, kw):
    """Both backward modes, trainable and frozen teacher, against the float64 gradients:
    poisoned outputs, no NaN, grads not asked for are None, relative error below ``tol``."""
    for mode in BWD_MODES:
        for need in (ALL, FROZEN):
            with launch.poison_outputs():
                grads = attention_kl.backward(g, q1, k1, q2, k2, stats1, stats2, delta, bwd_mode=mode,
                                              needs_grad=need, **kw)
            for name, gr, r, n in zip(("dq1", "dk1", "dq2", "dk2"), grads, ref_grads, need):
                if not n:
                    assert gr is None
                    continue
                assert not gr.isnan().any(), f"{name} NaN ({mode})"
                e = _rel(gr, r)
                assert e < tol, f"{name} ({mode}, {need}): error {e:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_reference(case):
    _, dtype, b, h, hkv1, hkv2, n_q, n_k, d1, d2, causal, mask_spec = case
    dev = torch.device("cuda")
    q1, k1, q2, k2 = _inputs(101, b, h, hkv1, hkv2, n_q, n_k, d1, d2, dtype=dtype, device=dev)
    mask, mask_kind = _gpu_mask(mask_spec, b, h, n_q, n_k, dev, torch.Generator().manual_seed(102))
    kw = dict(scale1=d1 ** -0.5, scale2=d2 ** -0.5, causal=causal, mask=mask, mask_kind=mask_kind)
    g = torch.randn(b, h, n_q, generator=torch.Generator().manual_seed(103)).to(dev)
    ref = reference(q1, k1, q2, k2, **kw)
    ref_grads = _grads_ref(q1, k1, q2, k2, g, **kw)
    # the scores are exact products of the inputs accumulated in fp32 (as in the reference up to
    # fp32 rounding); only dS is rounded to the input dtype before the gradient products
    fwd_tol = 1e-4 if dtype == torch.float32 else 1e-3
    bwd_tol = 1e-4 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 5e-3)
    splits = (1, 4, attention_kl.default_split_k(b, h, n_q, n_k, dev))
    for split in splits:
        with launch.poison_outputs():
            rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, split_k=split, **kw)
        assert not rows.isnan().any() and not delta.isnan().any()
        e = _rel(rows, ref["rows"])
        assert e < fwd_tol, f"rows error {e:.3g} (split_k={split})"
        empty = torch.isneginf(ref["lse1"])
        if attention_kl.two_part_stats(mask_kind, **attention_kl.fill_variant(causal, mask_kind)):
            _check_two_part_stats(ref, lse1, lse2, delta, empty, 1e-3)
            continue
        lse_err = (lse1[~empty].double() / LOG2E - ref["lse1"][~empty]).abs().max().item()
        assert lse_err < 1e-3, f"lse1 error {lse_err:.3g}"
        d_err = (delta.double() * LN2 - ref["delta"]).abs().max().item()
        assert d_err < 1e-3 * (1 + ref["delta"].abs().max().item()), f"delta error {d_err:.3g}"
    _check_gpu_backward(g, q1, k1, q2, k2, lse1, lse2, delta, ref_grads, bwd_tol, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large_small_grid_split_k(dtype):
    # small B*H*Nq with long keys: the split-K path the heuristic picks, against the reference
    dev = torch.device("cuda")
    q1, k1, q2, k2 = _inputs(104, 1, 2, 1, 2, 256, 8192, 128, 128, dtype=dtype, device=dev)
    kw = dict(scale1=128 ** -0.5, scale2=128 ** -0.5, causal="bottom_right")
    split = attention_kl.default_split_k(1, 2, 256, 8192, dev)
    assert split > 1
    ref = reference(q1, k1, q2, k2, **kw)
    one = attention_kl.forward(q1, k1, q2, k2, split_k=1, **kw)
    many = attention_kl.forward(q1, k1, q2, k2, split_k=split, **kw)
    assert _rel(one[0], ref["rows"]) < 1e-3 and _rel(many[0], ref["rows"]) < 1e-3
    assert (one[0] - many[0]).abs().max().item() < 1e-4 * (1 + one[0].abs().max().item())


@pytest.mark.gpu
def test_gpu_one_compile_for_many_lengths():
    dev = torch.device("cuda")
    kern = attention_kl.fwd_kernel(causal=True, mask_kind="none", mask_row_broadcast=False, need_stats=True,
                                   split_k=False, interpret=False)
    fn = launch.kernel_module(kern, False).attention_kl_fwd_kernel
    compiled_keys(fn)  # skips where Triton keeps no device caches

    def compiled():
        return compiled_keys(fn)

    counts = []
    for n in (1000, 1100, 1234, 77):
        q1, k1, q2, k2 = _inputs(105, 1, 2, 2, 1, n, n + 7, 64, 64, dtype=torch.float16, device=dev)
        attention_kl.forward(q1, k1, q2, k2, scale1=0.125, scale2=0.125, causal="bottom_right")
        counts.append(len(compiled()))
    assert counts[1:] == counts[:1] * 3, f"compiled variants after each length: {counts}"


def _gpu_mask(spec, b, h, n_q, n_k, dev, gen):
    """(mask, mask_kind) of a GPU case: ``"keypad"`` (batch 0: the last 300 keys padded),
    ``"keypad_empty"`` (the same, and every key of batch 1 padded: rows with no visible key),
    ``"bias"`` (a random additive ``[1, H, Nq, Nk]`` bias), ``"drop"`` (a random boolean drop
    mask) or none."""
    if spec in ("keypad", "keypad_empty"):
        keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
        keep[0, ..., n_k - 300:] = False
        if spec == "keypad_empty":
            keep[1] = False
        return keep.to(dev), "bool_keep"
    if spec == "bias":
        return torch.randn(1, h, n_q, n_k, generator=gen).to(dev), "additive"
    if spec == "drop":
        return (torch.rand(1, h, n_q, n_k, generator=gen) > 0.7).to(dev), "bool_drop"
    return None, "none"


GPU_FILL_CASES = [
    # id, dtype, B, H, Hkv1, Hkv2, Nq, Nk, D1, D2, causal, mask spec, fills
    ("bf16_keypad_finfo_min_per_side", torch.bfloat16, 2, 4, 2, 4, 1024, 1024, 128, 128, "top_left", "keypad_empty",
     _fills(MIN32 * 128 ** -0.5, MIN32 * 64 ** -0.5)),
    ("bf16_causal_add_q>k", torch.bfloat16, 1, 4, 4, 2, 1280, 1024, 64, 64, "bottom_right", None,
     _fills(causal_fill1=-2.0, causal_fill2=-3.0, mode="add")),
    ("bf16_causal_replace_q>k", torch.bfloat16, 1, 4, 4, 4, 1280, 1024, 128, 64, "bottom_right", None,
     _fills(causal_fill1=-1e4 * 128 ** -0.5, causal_fill2=-1e4 * 64 ** -0.5)),
    ("fp16_bool_drop_fill_causal_replace", torch.float16, 1, 4, 2, 2, 1000, 1536, 64, 64, "bottom_right", "drop",
     _fills(-5.0, -4.0, -3.0, -3.0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_FILL_CASES, ids=[c[0] for c in GPU_FILL_CASES])
def test_gpu_fills_match_reference(case):
    _, dtype, b, h, hkv1, hkv2, n_q, n_k, d1, d2, causal, spec, fills = case
    dev = torch.device("cuda")
    q1, k1, q2, k2 = _inputs(106, b, h, hkv1, hkv2, n_q, n_k, d1, d2, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(107)
    mask, kind = _gpu_mask(spec, b, h, n_q, n_k, dev, gen)
    kw = dict(scale1=d1 ** -0.5, scale2=d2 ** -0.5, causal=causal, mask=mask, mask_kind=kind, **fills)
    g = torch.randn(b, h, n_q, generator=torch.Generator().manual_seed(108)).to(dev)
    ref = reference(q1, k1, q2, k2, **kw)
    ref_grads = _grads_ref(q1, k1, q2, k2, g, **kw)
    bwd_tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for split in (1, 4):
        with launch.poison_outputs():
            rows, s1, s2, delta = attention_kl.forward(q1, k1, q2, k2, split_k=split, **kw)
        assert s1.shape == (2, b, h, n_q) and not rows.isnan().any() and not s1.isnan().any()
        e = _rel(rows, ref["rows"])
        assert e < 1e-3, f"rows error {e:.3g} (split_k={split})"
        d_err = (delta.double() * LN2 - ref["mean"]).abs().max().item()
        assert d_err < 1e-3 * (1 + ref["mean"].abs().max().item()), f"delta error {d_err:.3g}"
    _check_gpu_backward(g, q1, k1, q2, k2, s1, s2, delta, ref_grads, bwd_tol, kw)


GPU_ZERO_CASES = [
    # id, dtype, B, H, Hkv1, Hkv2, Nq, Nk, D1, D2, causal, mask spec, fills
    ("bf16_keypad_causal_finfo_min", torch.bfloat16, 2, 4, 2, 4, 1024, 1024, 128, 128, "top_left", "keypad_empty",
     _fills(MIN32, MIN32, MIN32, MIN32)),
    ("bf16_causal_add_q>k", torch.bfloat16, 1, 4, 4, 2, 1280, 1024, 64, 64, "bottom_right", None,
     _fills(causal_fill1=-2.0, causal_fill2=-3.0, mode="add")),
    ("fp16_bool_drop_fill_causal_add", torch.float16, 1, 4, 2, 2, 1000, 1536, 64, 64, "bottom_right", "drop",
     _fills(-5.0, -4.0, -3.0, -3.0, "add")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_ZERO_CASES, ids=[c[0] for c in GPU_ZERO_CASES])
def test_gpu_zero_hidden_matches_reference(case):
    # zero_hidden compiled at realistic sizes (bf16/fp16): rows, the statistics (h1, w1, DELTA)
    # and both backward modes against the float64 reference
    _, dtype, b, h, hkv1, hkv2, n_q, n_k, d1, d2, causal, spec, fills = case
    dev = torch.device("cuda")
    q1, k1, q2, k2 = _inputs(150, b, h, hkv1, hkv2, n_q, n_k, d1, d2, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(151)
    mask, kind = _gpu_mask(spec, b, h, n_q, n_k, dev, gen)
    kw = dict(scale1=d1 ** -0.5, scale2=d2 ** -0.5, causal=causal, mask=mask, mask_kind=kind, zero_hidden=True, **fills)
    g = torch.randn(b, h, n_q, generator=torch.Generator().manual_seed(152)).to(dev)
    ref = reference(q1, k1, q2, k2, **kw)
    ref_grads = _grads_ref(q1, k1, q2, k2, g, **kw)
    bwd_tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for split in (1, 4):
        with launch.poison_outputs():
            rows, s1, s2, delta = attention_kl.forward(q1, k1, q2, k2, split_k=split, **kw)
        assert s1.shape == (4, b, h, n_q) and s2.shape == (2, b, h, n_q) and not rows.isnan().any()
        e = _rel(rows, ref["rows"])
        assert e < 1e-3, f"rows error {e:.3g} (split_k={split})"
        for plane, name in ((2, "h1"), (3, "w1")):
            e = (s1[plane].double() - ref[name]).abs().max().item()
            assert e < 1e-3, f"{name} error {e:.3g} (split_k={split})"
        d_err = (delta.double() * LN2 - ref["mean_zh"]).abs().max().item()
        assert d_err < 1e-3 * (1 + ref["mean_zh"].abs().max().item()), f"delta error {d_err:.3g}"
    _check_gpu_backward(g, q1, k1, q2, k2, s1, s2, delta, ref_grads, bwd_tol, kw)
