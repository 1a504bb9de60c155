"""H2O column-sum kernels (codegen/h2o.py + templates/h2o_colsum.py.jinja, plan "two kernels")
against the float64 reference (patterns/h2o_reference.py).

On CPU the kernels run in Triton's interpreter at small, ragged sizes; tests marked ``gpu`` run
the compiled kernels at realistic sizes. Every output is allocated poisoned (NaN), so an element a
kernel fails to write shows up.
"""

from __future__ import annotations

import math

import pytest
from _kernel_checks import compiled_keys, rel_err as _rel
import torch

from fuser.codegen import h2o, launch, render
from fuser.patterns.attention_reference import reference as attention_reference
from fuser.patterns.h2o_reference import probabilities, reference

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
CPU = torch.device("cpu")
F32_MIN = torch.finfo(torch.float32).min


def _rand(gen, *shape, dtype=torch.float32, device=CPU):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _qkv(seed, b, hq, hkv, n_q, n_k, d, dv, dtype=torch.float32, device=CPU):
    gen = torch.Generator().manual_seed(seed)
    q = _rand(gen, b, hq, n_q, d, dtype=dtype, device=device)
    k = _rand(gen, b, hkv, n_k, d, dtype=dtype, device=device)
    v = _rand(gen, b, hkv, n_k, dv, dtype=dtype, device=device)
    return q, k, v


def _check(q, k, v, *, causal="none", mask=None, mask_kind="none", scale=None, need_out=True, config=None,
           tol=None, plan_kw=None):
    """Kernels (outputs poisoned) against the reference; returns (out, score, reference score).
    ``plan_kw``: the plan's arguments of ``h2o.forward`` (then the workspaces are dropped first:
    a fresh, poisoned workspace shows a cached tile read before it is written)."""
    dtype = q.dtype
    tol = TOL[dtype] if tol is None else tol
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kw = dict(scale=scale, causal=causal, mask=mask, mask_kind=mask_kind)
    if plan_kw is not None:
        h2o.clear_workspaces()
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, need_out=need_out, config=config, **(plan_kw or {}), **kw)
    ref_out, ref_score = reference(q, k, v, **kw)

    b, hq, n_q = q.shape[:3]
    n_k = k.shape[2]
    assert score.shape == (b, hq, n_k) and score.dtype == torch.float32 and score.is_contiguous()
    assert not score.isnan().any() and torch.isfinite(score).all()
    err = _rel(score, ref_score)
    assert err < tol, f"score: relative error {err:.3g} >= {tol}"
    # a key no query sees scores exactly 0; a column sum is at most Nq
    assert (score[ref_score == 0] == 0).all(), "keys no query sees must score 0"
    assert (score >= 0).all() and (score <= n_q * (1 + 1e-3)).all()
    if not need_out:
        assert out is None
    else:
        assert out.shape == ref_out.shape and out.dtype == dtype and not out.isnan().any()
        e = _rel(out, ref_out)
        assert e < tol, f"out: relative error {e:.3g} >= {tol}"
    return out, score, ref_score


# ---------------------------------------------------------------------------------------------
# Interpreter tests (CPU)
# ---------------------------------------------------------------------------------------------

SHAPES = [
    # id, B, Hq, Hkv, Nq, Nk, D, Dv, causal
    ("ragged_none", 2, 2, 2, 37, 50, 24, 40, "none"),
    ("none_q>k", 1, 2, 2, 50, 37, 32, 16, "none"),
    ("top_left_q<k_unseen_keys", 1, 2, 2, 37, 67, 32, 32, "top_left"),
    ("top_left_q>k", 1, 2, 2, 67, 37, 32, 16, "top_left"),
    ("bottom_right_q<k", 2, 2, 2, 37, 67, 32, 32, "bottom_right"),
    ("bottom_right_q>k_empty_rows", 2, 2, 2, 67, 37, 16, 32, "bottom_right"),
    ("d80_bottom_right_square", 1, 2, 2, 45, 45, 80, 80, "bottom_right"),
    ("gqa_4_2_top_left", 2, 4, 2, 37, 50, 32, 32, "top_left"),
    ("mqa_4_1_bottom_right", 1, 4, 1, 45, 33, 32, 24, "bottom_right"),
    ("single_query", 2, 2, 1, 1, 67, 32, 32, "bottom_right"),
    ("single_key", 1, 2, 2, 20, 1, 16, 16, "top_left"),
]


@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
def test_fp32(case):
    name, b, hq, hkv, n_q, n_k, d, dv, causal = case
    q, k, v = _qkv(SHAPES.index(case), b, hq, hkv, n_q, n_k, d, dv)
    out, score, ref_score = _check(q, k, v, causal=causal)
    if name == "top_left_q<k_unseen_keys":
        # keys j >= Nq are seen by no query (j <= i <= Nq - 1)
        assert (score[..., n_q:] == 0).all() and (score[..., :n_q] > 0).all()
    if name == "bottom_right_q>k_empty_rows":
        # the first Nq - Nk rows see no key: out 0, and the scores still sum to the Nk rows that see one
        assert (out[:, :, : n_q - n_k] == 0).all()
        assert torch.allclose(score.sum(-1), torch.full((b, hq), float(n_k)), rtol=1e-5)
    if causal == "none":
        # every row is a distribution over the keys: the scores sum to Nq
        assert torch.allclose(score.sum(-1), torch.full((b, hq), float(n_q)), rtol=1e-5)


@pytest.mark.parametrize("offset", [1, 33, -2, 14, -17, 17])
def test_causal_offsets_at_block_edges(offset):
    # bottom-right offsets Nk - Nq that put a key block's first visible row (n_first - offset) or
    # its first fully visible row (n_last - offset) one row off a query-block edge: a loop bound
    # off by one row there skips a block or leaves a partly hidden block unmasked
    n_q = 40
    q, k, v = _qkv(17, 1, 2, 1, n_q, n_q + offset, 16, 16)
    for cfg in (None, {"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32}):
        _check(q, k, v, causal="bottom_right", config=cfg)


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_fp16(causal):
    q, k, v = _qkv(11, 2, 4, 2, 67, 53, 64, 48, dtype=torch.float16)
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", ["none", "top_left"])
def test_large_scores_keep_the_max(causal):
    # scores ~ 30 N(0, 1) * log2(e): exp2 of an unshifted score overflows float32 (> 128), so a
    # kernel that dropped the running max would give inf/NaN; P is nearly one-hot per row
    q, k, v = _qkv(12, 1, 2, 2, 45, 50, 32, 32)
    scale = 30 * 32 ** -0.5
    s = (q @ k.mT).double() * scale * math.log2(math.e)
    assert s.max() > 128
    _check(q, k, v, causal=causal, scale=scale)


def test_need_out_false():
    q, k, v = _qkv(13, 2, 4, 2, 37, 50, 32, 32)
    _, score, _ = _check(q, k, v, causal="bottom_right", need_out=False)
    with launch.poison_outputs():
        out, without_v = h2o.forward(q, k, None, scale=32 ** -0.5, causal="bottom_right", need_out=False)
    assert out is None and torch.equal(without_v, score)


def test_explicit_configs():
    q, k, v = _qkv(14, 1, 2, 2, 50, 45, 32, 32)
    cands = h2o.candidate_configs(head_dim=32, dtype=q.dtype, device=q.device)
    for cfg in cands[1:] + [{"BLOCK_M": 64, "BLOCK_N": 16}]:
        _check(q, k, v, causal="top_left", config=cfg)
    with pytest.raises(ValueError):
        h2o.forward(q, k, v, scale=0.1, config={"BLOCK_M": 24})


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_scale_sign(scale):
    q, k, v = _qkv(15, 1, 2, 2, 29, 41, 32, 32)
    _check(q, k, v, scale=scale, causal="bottom_right")


def test_strided_views_of_fused_qkv():
    b, n, h, d = 2, 45, 2, 32
    gen = torch.Generator().manual_seed(16)
    qkv = torch.randn(b, n, 3, h, d, generator=gen)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    _check(q, k, v, causal="top_left")


# --- masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [True, False], ids=["rowbcast", "full"])
@pytest.mark.parametrize("kind", ["bool_keep", "bool_drop", "additive"])
def test_mask_kinds(kind, row):
    b, hq, hkv, n_q, n_k = 2, 4, 2, 37, 50
    q, k, v = _qkv(21, b, hq, hkv, n_q, n_k, 32, 32)
    gen = torch.Generator().manual_seed(22)
    shape = (b, 1, 1, n_k) if row else (b, hq, n_q, n_k)
    if kind == "additive":
        mask = torch.randn(*shape, generator=gen)
    else:
        mask = torch.rand(*shape, generator=gen) > 0.3
    causal = "bottom_right" if row else "none"
    _check(q, k, v, mask=mask, mask_kind=kind, causal=causal)


@pytest.mark.parametrize("kind", ["bool_keep", "bool_drop"])
def test_key_padding_with_fully_masked_batch(kind):
    b, h, n_q, n_k = 2, 2, 37, 50
    q, k, v = _qkv(23, b, h, h, n_q, n_k, 32, 32)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., 41:] = False  # padded keys
    keep[0, ..., 3] = False
    keep[1] = False  # every key of batch 1 is hidden: no row sees a key
    mask = keep if kind == "bool_keep" else ~keep
    causal = "none" if kind == "bool_keep" else "top_left"
    out, score, _ = _check(q, k, v, mask=mask, mask_kind=kind, causal=causal)
    assert (score[1] == 0).all() and (out[1] == 0).all()
    assert (score[0, :, 41:] == 0).all() and (score[0, :, 3] == 0).all()


def test_additive_mask_with_neg_inf_and_finfo_min():
    # two-part statistics (row max m2, log2 l): a row of finfo.min scores has its max near -3.4e38
    b, h, n_q, n_k = 2, 2, 37, 50
    q, k, v = _qkv(24, b, h, h, n_q, n_k, 32, 32)
    gen = torch.Generator().manual_seed(25)
    bias = torch.randn(b, 1, n_q, n_k, generator=gen)
    pick = torch.rand(b, 1, n_q, n_k, generator=gen)
    bias[pick < 0.2] = -math.inf
    bias[(pick >= 0.2) & (pick < 0.4)] = F32_MIN
    bias[0, 0, 3] = -math.inf  # a row with no visible key: contributes 0
    bias[0, 0, 5] = F32_MIN  # finite everywhere: a uniform row (1/Nk per key, in float64 too)
    bias[1, 0, :, 20:] = -math.inf  # key padding spelled additively
    _, score, ref_score = _check(q, k, v, mask=bias, mask_kind="additive", causal="top_left")
    assert (score[1, :, 20:] == 0).all()
    p = probabilities(q, k, scale=32 ** -0.5, causal="top_left", mask=bias, mask_kind="additive")
    # top_left: row 5 sees keys 0..5, all at finfo.min + O(1): 1/6 each in float64 and in the kernels
    want = torch.where(torch.arange(n_k) <= 5, 1 / 6, 0.0).double().expand(h, n_k)
    assert torch.allclose(p[0, :, 5], want)


def test_additive_mask_low_precision_fp16():
    q, k, v = _qkv(26, 1, 2, 1, 40, 45, 32, 32, dtype=torch.float16)
    bias = torch.randn(1, 1, 1, 45, generator=torch.Generator().manual_seed(27)).half()
    bias[..., 30:] = -math.inf
    _check(q, k, v, mask=bias, mask_kind="additive", causal="bottom_right")


# --- sizes, recompiles, errors ---------------------------------------------------------------


def test_empty_sizes():
    q, k, v = torch.randn(2, 2, 0, 32), torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 16)
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, scale=0.1)
    assert out.shape == (2, 2, 0, 16) and score.shape == (2, 2, 5) and (score == 0).all()
    q, k, v = torch.randn(1, 2, 7, 32), torch.randn(1, 2, 0, 32), torch.randn(1, 2, 0, 16)
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, scale=0.1, causal="top_left")
    assert score.shape == (1, 2, 0) and (out == 0).all()


def test_new_length_does_not_recompile():
    # the interpreter: one rendered module serves every length
    q, k, v = _qkv(31, 1, 2, 2, 30, 40, 32, 32)
    h2o.forward(q, k, v, scale=0.2, causal="bottom_right")
    before = len(render.rendered_kernels())
    for n_q, n_k in ((33, 17), (50, 61)):
        q, k, v = _qkv(32, 1, 2, 2, n_q, n_k, 32, 32)
        _check(q, k, v, causal="bottom_right")
    assert len(render.rendered_kernels()) == before
    # compiled kernels: the lengths, the causal offset and the first row (ROW_BASE) are never
    # specialised (no divisibility or ==1 specialisation: one compile per dtype and config)
    kern = h2o.colsum_kernel(causal=True, mask_kind="bool_keep", mask_row_broadcast=False, interpret=False)
    fn = launch.kernel_module(kern, False).h2o_colsum_kernel
    nospec = {p.name for p in fn.params if p.do_not_specialize}
    assert nospec == {"N_Q", "N_K", "CAUSAL_OFFSET", "ROW_BASE"}


def test_rejects_unsupported():
    q, k, v = _qkv(33, 1, 2, 2, 8, 8, 32, 32)
    for bad in (math.nan, math.inf):  # a finite fill is supported; NaN and +inf are not fills
        with pytest.raises(ValueError, match="mask_fill must be finite or -inf"):
            h2o.forward(q, k, v, scale=1.0, mask=torch.ones(8, 8, dtype=torch.bool), mask_kind="bool_keep",
                        mask_fill=bad)
    with pytest.raises(ValueError, match="causal_fill.*two_kernel"):  # supported by two_kernel only
        h2o.forward(q, k, v, scale=1.0, causal="top_left", causal_fill=F32_MIN, plan="one_kernel")
    with pytest.raises(ValueError, match="predicate"):
        h2o.forward(q, k, v, scale=1.0, mask_pred="ge(1,-1,0)")
    with pytest.raises(ValueError, match="needs v"):
        h2o.forward(q, k, None, scale=1.0)
    with pytest.raises(ValueError):
        h2o.forward(q, k, v, scale=1.0, causal="diagonal")
    with pytest.raises(ValueError):
        h2o.forward(q, k, v, scale=1.0, mask=torch.ones(8, 8, dtype=torch.bool), mask_kind="additive")
    q3, k2, v2 = _qkv(34, 1, 3, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError):
        h2o.forward(q3, k2, v2, scale=1.0)


def test_kernel_variants_render():
    names = set()
    for causal in (False, True):
        for kind in ("none", "bool_keep", "bool_drop", "additive"):
            for row in (False, True):
                for interpret in (False, True):
                    kern = h2o.colsum_kernel(causal=causal, mask_kind=kind, mask_row_broadcast=row,
                                             interpret=interpret)
                    names.add(kern.name)
                    src = kern.source
                    assert "h2o_colsum_kernel" in src and ("log2_l" in src) == (kind == "additive")
                    assert ("n_first - CAUSAL_OFFSET" in src) == causal
    assert len(names) == 2 * (1 + 3 * 2) * 2


def test_config_table():
    for dev in ("sm90", "cuda"):
        for bucket in (64, 128, 256):
            for size in (2, 4):
                cands = h2o._TABLE[(dev, bucket, size)]
                assert cands
                for c in cands:
                    launch.check_config(c)
                    assert c["num_warps"] in (1, 2, 4, 8) and c["num_stages"] >= 1
    for c in h2o.candidate_configs(head_dim=80, dtype=torch.float16, device="cpu"):
        assert c["num_stages"] == 1 and c["BLOCK_M"] <= 32


# --- the reference ---------------------------------------------------------------------------


def test_reference_matches_eager():
    # the reference is torch.softmax(...).sum(-2), spelled in plain float64 PyTorch
    g = torch.Generator().manual_seed(41)
    q = torch.randn(2, 4, 23, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 31, 16, generator=g, dtype=torch.float64) for _ in range(2))
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ kk.mT * 0.4
    out, score = reference(q, k, v, scale=0.4)
    assert _rel(score, torch.softmax(s, -1).sum(-2)) < 1e-12
    assert _rel(out, torch.softmax(s, -1) @ vv) < 1e-12
    # key padding (every row keeps a key)
    keep = torch.rand(2, 1, 1, 31, generator=g) > 0.3
    keep[..., 0] = True
    eager = torch.softmax(s.masked_fill(~keep, -math.inf), -1).sum(-2)
    assert _rel(reference(q, k, scale=0.4, mask=keep, mask_kind="bool_keep")[1], eager) < 1e-12
    assert _rel(reference(q, k, scale=0.4, mask=~keep, mask_kind="bool_drop")[1], eager) < 1e-12
    bias = torch.randn(2, 4, 23, 31, generator=g, dtype=torch.float64)
    eager = torch.softmax(s + bias, -1).sum(-2)
    assert _rel(reference(q, k, scale=0.4, mask=bias, mask_kind="additive")[1], eager) < 1e-12
    # causal, both alignments, Nq < Nk and Nq > Nk; eager's rows with no visible key are NaN,
    # the reference's contribute 0
    for n_q in (23, 40):
        qq = torch.randn(2, 4, n_q, 16, generator=g, dtype=torch.float64)
        s = qq @ kk.mT * 0.4
        i, j = torch.arange(n_q)[:, None], torch.arange(31)[None, :]
        for causal, allowed in (("top_left", j <= i), ("bottom_right", j <= i + 31 - n_q)):
            eager = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0).sum(-2)
            _, score = reference(qq, k, scale=0.4, causal=causal)
            assert _rel(score, eager) < 1e-12, (causal, n_q)
            if causal == "top_left" and n_q < 31:
                assert (score[..., n_q:] == 0).all()


# ---------------------------------------------------------------------------------------------
# GPU tests (compiled kernels, realistic sizes)
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # id, dtype, B, Hq, Hkv, Nq, Nk, D, causal, mask
    ("bf16_d128_causal", torch.bfloat16, 2, 8, 8, 2048, 2048, 128, "top_left", None),
    ("bf16_d64_gqa", torch.bfloat16, 2, 8, 2, 1024, 1024, 64, "none", None),
    ("fp16_d64_mqa_bottom_right_q<k", torch.float16, 1, 8, 1, 1000, 1536, 64, "bottom_right", None),
    ("bf16_d128_bottom_right_q>k", torch.bfloat16, 1, 8, 4, 1100, 777, 128, "bottom_right", None),
    ("fp16_d80_keypad", torch.float16, 2, 4, 4, 1024, 1024, 80, "none", "keypad"),
    ("bf16_d96_bias", torch.bfloat16, 1, 4, 2, 1024, 777, 96, "top_left", "bias"),
    ("fp32_d64", torch.float32, 1, 4, 4, 1024, 1024, 64, "top_left", None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_reference(case):
    _, dtype, b, hq, hkv, n_q, n_k, d, causal, mask_spec = case
    dev = torch.device("cuda")
    q, k, v = _qkv(101, b, hq, hkv, n_q, n_k, d, d, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(102)
    mask, mask_kind = None, "none"
    if mask_spec == "keypad":
        keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
        keep[0, ..., n_k - 300:] = False
        keep[1] = False
        mask, mask_kind = keep.to(dev), "bool_keep"
    elif mask_spec == "bias":
        mask, mask_kind = torch.randn(b, hq, n_q, n_k, generator=gen).to(dev), "additive"
    kw = dict(scale=d ** -0.5, causal=causal, mask=mask, mask_kind=mask_kind)
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, **kw)
    ref_out, ref_score = reference(q, k, v, **kw)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert not score.isnan().any() and _rel(score, ref_score) < tol
    assert not out.isnan().any() and _rel(out, ref_out) < tol
    assert (score[ref_score == 0] == 0).all()


@pytest.mark.gpu
def test_gpu_one_compile_for_many_lengths():
    dev = torch.device("cuda")
    kern = h2o.colsum_kernel(causal=True, mask_kind="none", mask_row_broadcast=False, interpret=False)
    fn = launch.kernel_module(kern, False).h2o_colsum_kernel
    compiled_keys(fn)  # skips where Triton keeps no device caches
    counts = []
    for n in (1000, 1100, 1234, 77):
        q, k, v = _qkv(103, 1, 2, 2, n, n + 7, 64, 64, dtype=torch.bfloat16, device=dev)
        h2o.forward(q, k, v, scale=0.125, causal="bottom_right")
        counts.append(len(compiled_keys(fn)))
    assert counts[1:] == counts[:1] * 3, f"compiled variants after each length: {counts}"


# =============================================================================================
# The other plans: one_kernel (row-parallel, score by atomics) and diag_cache (kernel 0 caches the
# base-2 scores of a set of tiles for the column pass), both layouts
# =============================================================================================

PLAN_CASES = [
    # id, plan kwargs
    ("one_kernel", dict(plan="one_kernel")),
    ("diag_balanced_K2", dict(plan="diag_cache", diagonals=2, cache="balanced")),
    ("diag_causal_K2", dict(plan="diag_cache", diagonals=2, cache="causal")),
]


def _plan_ok(plan_kw, causal):
    return not (plan_kw.get("cache") == "causal" and causal == "none")


def _check_plan(q, k, v, plan_kw, **kw):
    """One plan's kernels against the float64 reference (:func:`_check` with ``plan_kw``)."""
    return _check(q, k, v, plan_kw=plan_kw, **kw)


PLAN_SHAPES = [c for c in SHAPES if c[0] in ("ragged_none", "none_q>k", "top_left_q<k_unseen_keys", "top_left_q>k",
                                            "bottom_right_q<k", "bottom_right_q>k_empty_rows", "mqa_4_1_bottom_right",
                                            "single_query", "single_key")]


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
@pytest.mark.parametrize("case", PLAN_SHAPES, ids=[c[0] for c in PLAN_SHAPES])
def test_plans_fp32(case, plan):
    name, b, hq, hkv, n_q, n_k, d, dv, causal = case
    _, plan_kw = plan
    if not _plan_ok(plan_kw, causal):
        pytest.skip("the causal layout needs causal masking")
    plan_kw = dict(plan_kw)
    if plan_kw["plan"] == "diag_cache":
        q0 = torch.empty(1, 1, n_q, 1)
        plan_kw["diagonals"] = min(plan_kw["diagonals"], h2o.diagonal_count(q0, torch.empty(1, 1, n_k, 1), causal))
    q, k, v = _qkv(SHAPES.index(case), b, hq, hkv, n_q, n_k, d, dv)
    out, score, _ = _check_plan(q, k, v, plan_kw, causal=causal)
    if name == "bottom_right_q>k_empty_rows":
        assert (out[:, :, : n_q - n_k] == 0).all()


def _sizes(n_q, n_k, causal, cfg=None):
    return h2o.diagonal_count(torch.empty(1, 1, n_q, 1), torch.empty(1, 1, n_k, 1), causal, cfg)


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_diag_cache_every_k_both_layouts(causal):
    # every K in 0..count (count = 3 blocks of 16 here) for both layouts; K = 0 is two_kernel, bitwise
    n_q, n_k = (40, 45) if causal != "bottom_right" else (37, 45)
    q, k, v = _qkv(51, 1, 2, 1, n_q, n_k, 16, 16)
    count = _sizes(n_q, n_k, causal)
    assert count == 3
    scale = 0.3
    with launch.poison_outputs():
        base_out, base_score = h2o.forward(q, k, v, scale=scale, causal=causal, plan="two_kernel")
    for cache in h2o.CACHE_LAYOUTS:
        if cache == "causal" and causal == "none":
            continue
        for kk in range(count + 1):
            out, score, _ = _check_plan(q, k, v, dict(plan="diag_cache", diagonals=kk, cache=cache), causal=causal,
                                        scale=scale)
            if kk == 0:
                assert torch.equal(score, base_score) and torch.equal(out, base_out)
            else:
                # the cached s' is what kernel 1 would recompute: the column sums match two_kernel to rounding
                assert _rel(score, base_score) < 1e-6
                assert _rel(out, base_out) < 1e-6


def test_diag_cache_every_k_non_square_grid():
    # Nq != Nk with more key blocks than query blocks and the reverse (n = max of the two)
    for n_q, n_k in ((20, 70), (70, 20)):
        q, k, v = _qkv(52, 1, 2, 2, n_q, n_k, 16, 16)
        count = _sizes(n_q, n_k, "none")
        assert count == 5
        for kk in range(count + 1):
            _check_plan(q, k, v, dict(plan="diag_cache", diagonals=kk, cache="balanced"))


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
def test_plans_gqa_fp16(plan):
    q, k, v = _qkv(53, 2, 4, 2, 67, 53, 64, 48, dtype=torch.float16)
    _check_plan(q, k, v, plan[1], causal="bottom_right")


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
def test_plans_bf16(plan):
    q, k, v = _qkv(54, 1, 2, 1, 40, 37, 32, 32, dtype=torch.bfloat16)
    _check_plan(q, k, v, plan[1], causal="top_left")


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
@pytest.mark.parametrize("causal", ["none", "top_left"])
def test_plans_large_scores_keep_the_max(plan, causal):
    if not _plan_ok(plan[1], causal):
        pytest.skip("the causal layout needs causal masking")
    q, k, v = _qkv(55, 1, 2, 2, 45, 50, 32, 32)
    scale = 30 * 32 ** -0.5
    assert ((q @ k.mT).double() * scale * math.log2(math.e)).max() > 128
    _check_plan(q, k, v, plan[1], causal=causal, scale=scale)


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
@pytest.mark.parametrize("row", [True, False], ids=["rowbcast", "full"])
@pytest.mark.parametrize("kind", ["bool_keep", "bool_drop", "additive"])
def test_plans_mask_kinds(kind, row, plan):
    b, hq, hkv, n_q, n_k = 2, 2, 1, 37, 50
    q, k, v = _qkv(56, b, hq, hkv, n_q, n_k, 16, 16)
    gen = torch.Generator().manual_seed(57)
    shape = (b, 1, 1, n_k) if row else (b, hq, n_q, n_k)
    if kind == "additive":
        mask = torch.randn(*shape, generator=gen)
        mask[mask < -1.0] = -math.inf
        mask[(mask > 1.2)] = F32_MIN
    else:
        mask = torch.rand(*shape, generator=gen) > 0.3
    causal = "bottom_right" if row or plan[1].get("cache") == "causal" else "none"
    _check_plan(q, k, v, plan[1], mask=mask, mask_kind=kind, causal=causal)


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
def test_plans_fully_masked_rows_and_batches(plan):
    b, h, n_q, n_k = 2, 2, 37, 50
    q, k, v = _qkv(58, b, h, h, n_q, n_k, 16, 16)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., 41:] = False
    keep[1] = False  # no row of batch 1 sees a key
    out, score, _ = _check_plan(q, k, v, plan[1], mask=keep, mask_kind="bool_keep", causal="top_left")
    assert (score[1] == 0).all() and (out[1] == 0).all()


def _eager64(q, k, v, *, scale, causal="none", mask=None, mask_kind="none", causal_fill=-math.inf,
             causal_fill_mode="replace"):
    """Eager PyTorch in float64, NaN rows included: the data mask, then the causal mask (-inf, or
    a finite fill replacing or added to the entries above the diagonal), softmax, column sums."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    s = scale * q.double() @ kk.transpose(-1, -2)
    if mask_kind == "bool_keep":
        s = s.masked_fill(~mask, -math.inf)
    elif mask_kind == "bool_drop":
        s = s.masked_fill(mask, -math.inf)
    elif mask_kind == "additive":
        s = s + mask.double()
    n_q, n_k = s.shape[-2:]
    if causal != "none":
        off = n_k - n_q if causal == "bottom_right" else 0
        above = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + off
        s = s.masked_fill(above, causal_fill) if causal_fill_mode == "replace" else s + torch.where(
            above, causal_fill, 0.0).double()
    p = torch.softmax(s, -1)
    return p @ v.double().repeat_interleave(group, 1), p.sum(-2)


NAN_PLANS = [("two_kernel", dict(plan="two_kernel")), ("one_kernel", dict(plan="one_kernel")),
             ("diag_balanced_K2", dict(plan="diag_cache", diagonals=2, cache="balanced")),
             ("diag_causal_K1", dict(plan="diag_cache", diagonals=1, cache="causal"))]


def _nan_cases():
    b, hq = 2, 2
    keep = torch.rand(b, 1, 1, 19, generator=torch.Generator().manual_seed(5)) > 0.3
    keep[1] = False  # batch 1: no row sees a key
    rows = torch.ones(b, hq, 21, 19, dtype=torch.bool)
    rows[0, 1, 7] = False  # one row of one head sees no key
    bias = torch.zeros(b, hq, 21, 19)
    bias[1, 0, 0] = -math.inf
    bias[0, 0, :, 5] = torch.finfo(torch.float32).min  # finite: a value, no empty row
    return [
        # id, Nq, Nk, causal, mask, mask_kind, causal fill, mode
        ("bottom_right_q>k", 21, 19, "bottom_right", None, "none", -math.inf, "replace"),
        ("bottom_right_q<k", 19, 21, "bottom_right", None, "none", -math.inf, "replace"),
        ("padding_batch", 21, 19, "top_left", keep, "bool_keep", -math.inf, "replace"),
        ("bool_drop_row", 21, 19, "bottom_right", ~rows, "bool_drop", -math.inf, "replace"),
        ("additive_row", 21, 19, "none", bias, "additive", -math.inf, "replace"),
        ("finite_causal_add", 21, 19, "top_left", rows, "bool_keep", torch.finfo(torch.float32).min, "add"),
        ("finite_causal_replace", 21, 19, "top_left", rows, "bool_keep", -1e4, "replace"),
    ]


@pytest.mark.parametrize("plan", NAN_PLANS, ids=[p[0] for p in NAN_PLANS])
@pytest.mark.parametrize("case", _nan_cases(), ids=[c[0] for c in _nan_cases()])
def test_nan_rows_follow_eager(case, plan):
    # nan_rows (what the op asks for): a row with no visible key is NaN in eager's softmax, so is
    # every column sum of its (batch, head); out's row is 0 (documented), the rest as eager.
    # Without out, two_kernel's kernel 0 is the statistics-only pass: checked too
    _, n_q, n_k, causal, mask, mask_kind, fill, mode = case
    _, plan_kw = plan
    if fill != -math.inf and plan_kw["plan"] != "two_kernel":
        pytest.skip("a finite causal fill runs with two_kernel only")
    if plan_kw.get("cache") == "causal" and causal == "none":
        pytest.skip("the causal layout needs causal masking")
    q, k, v = _qkv(71, 2, 2, 1, n_q, n_k, 16, 24)
    kw = dict(scale=0.25, causal=causal, mask=mask, mask_kind=mask_kind, causal_fill=fill, causal_fill_mode=mode)
    want_out, want = _eager64(q, k, v, **kw)
    for need_out in (True, False) if plan_kw["plan"] == "two_kernel" else (True,):
        h2o.clear_workspaces()
        with launch.poison_outputs():
            out, score = h2o.forward(q, k, v, need_out=need_out, nan_rows=True, **plan_kw, **kw)
        assert torch.equal(score.isnan(), want.isnan())
        ok = ~want.isnan()
        assert _rel(score[ok], want[ok]) < 1e-4
        if need_out:
            nan_rows = want_out.isnan().any(-1)
            assert (out[nan_rows] == 0).all() and not out.isnan().any()
            assert _rel(out[~nan_rows], want_out[~nan_rows]) < 1e-4
    if not want.isnan().any():  # nothing to mark: the same as without nan_rows
        h2o.clear_workspaces()
        _, plain = h2o.forward(q, k, v, **plan_kw, **kw)
        assert torch.equal(plain, score) or plan_kw["plan"] == "one_kernel"


def test_empty_rows_possible():
    f = h2o.empty_rows_possible
    assert f("bottom_right", "none") and f("bottom_right", "none", n_q=5, n_k=4)
    assert not f("bottom_right", "none", n_q=4, n_k=4) and not f("top_left", "none") and not f("none", "none")
    assert not f("bottom_right", "none", causal_fill_kind="replace", n_q=5, n_k=4)
    assert f("none", "bool_keep") and f("none", "bool_drop") and f("none", "additive")
    assert not f("none", "bool_keep", mask_fill=-1e4) and f("none", "additive", mask_fill=-1e4)
    # the one_kernel variant with the NaN marking only where a row can be empty
    names = [h2o.kernels_for(plan="one_kernel", causal=c, mask_kind="none", mask_row_broadcast=False,
                             need_out=True, interpret=True, nan_rows=True)[0].name
             for c in ("top_left", "bottom_right")]
    assert "_nanrows" not in names[0] and "_nanrows" in names[1]


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
def test_plans_need_out_false(plan):
    q, k, v = _qkv(59, 2, 4, 2, 37, 50, 32, 32)
    _, score, _ = _check_plan(q, k, v, plan[1], causal="bottom_right", need_out=False)
    with launch.poison_outputs():
        out, without_v = h2o.forward(q, k, None, scale=32 ** -0.5, causal="bottom_right", need_out=False, **plan[1])
    assert out is None and torch.allclose(without_v, score, rtol=1e-6, atol=1e-7)


def test_two_kernel_need_out_false_runs_the_statistics_only_pass():
    # without out, kernel 0 is the statistics-only row pass (no V): its LSE differs from the
    # attention forward's only by rounding
    q, k, v = _qkv(60, 1, 2, 2, 37, 50, 32, 32)
    _, with_out, _ = _check_plan(q, k, v, {}, causal="top_left")
    _, without, _ = _check_plan(q, k, v, {}, causal="top_left", need_out=False)
    assert _rel(without, with_out) < 1e-6
    kerns = h2o.kernels_for(plan="two_kernel", causal="top_left", mask_kind="none", mask_row_broadcast=False,
                            need_out=False, interpret=True)
    assert kerns[0].name.startswith("h2o_fwd_causal_noout") and "V_head" not in kerns[0].source


def test_one_kernel_explicit_configs_and_rerun():
    q, k, v = _qkv(61, 1, 2, 2, 50, 45, 32, 32)
    for cfg in h2o.candidate_configs(head_dim=32, dtype=q.dtype, device=q.device, plan="one_kernel"):
        _check_plan(q, k, v, dict(plan="one_kernel"), causal="top_left", config=cfg)
    # score is zeroed inside forward: a second call does not add to the first
    _, s1 = h2o.forward(q, k, v, scale=0.2, plan="one_kernel")
    _, s2 = h2o.forward(q, k, v, scale=0.2, plan="one_kernel")
    assert torch.allclose(s1, s2, rtol=1e-6, atol=1e-7)


def test_diag_cache_tiles_32_and_fwd_config():
    q, k, v = _qkv(62, 1, 2, 2, 70, 75, 32, 32)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32}
    count = _sizes(70, 75, "top_left", cfg)
    assert count == 3
    for cache in h2o.CACHE_LAYOUTS:
        _check_plan(q, k, v, dict(plan="diag_cache", diagonals=2, cache=cache, fwd_config={"num_warps": 2}),
                    causal="top_left", config=cfg)


# --- the cached tiles: written by kernel 0, read by kernel 1 -----------------------------------


def _base2_scores(q, k, scale, causal):
    """s' = scale·log2(e)·q·k, -inf above the causal diagonal, float64 [B, H, Nq, Nk]."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.double() @ kk.mT) * scale * math.log2(math.e)
    n_q, n_k = q.shape[2], k.shape[2]
    if causal != "none":
        off = 0 if causal == "top_left" else n_k - n_q
        hidden = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + off
        s = s.masked_fill(hidden, -math.inf)
    return s


@pytest.mark.parametrize("cache,causal", [("balanced", "none"), ("balanced", "top_left"), ("causal", "bottom_right")])
def test_diag_cache_writes_exactly_the_cached_tiles(cache, causal):
    n_q, n_k, t, kk = 37, 45, 16, 2
    q, k, v = _qkv(63, 1, 2, 1, n_q, n_k, 16, 16)
    scale = 0.4
    h2o.clear_workspaces()
    with launch.poison_outputs():
        h2o.forward(q, k, v, scale=scale, causal=causal, plan="diag_cache", diagonals=kk, cache=cache)
    nbytes = h2o.workspace_bytes(q, k, plan="diag_cache", diagonals=kk, cache=cache, causal=causal)
    (ws,) = [w for key, w in h2o._workspaces.items()]
    assert ws.numel() * 4 == nbytes
    n_slots = nbytes // (4 * 2 * t * t)
    tiles = h2o._tables(n_q, n_k, t, causal, kk, cache)[3]
    assert len(tiles) == n_slots
    want = _base2_scores(q, k, scale, causal)
    ws = ws.view(2, n_slots, t, t)
    for slot, (r, c) in enumerate(tiles):  # slots are the tiles in row-major order
        got = ws[:, slot]
        rows, cols = min(t, n_q - r * t), min(t, n_k - c * t)
        ref = want[0, :, r * t: r * t + rows, c * t: c * t + cols]
        assert not got.isnan().any(), f"tile {(r, c)} not written"
        part = got[:, :rows, :cols].double()
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(part), fin) and torch.allclose(part[fin], ref[fin], rtol=1e-5, atol=1e-5)
        assert (got[:, :, cols:] == -math.inf).all()  # keys past Nk are hidden


def test_diag_cache_column_pass_reads_the_cache(monkeypatch):
    # add 1 (base 2) to every cached s' between the kernels: exactly the cached tiles' P doubles
    n_q, n_k, t, kk, scale, causal = 40, 45, 16, 2, 0.3, "top_left"
    q, k, v = _qkv(64, 1, 2, 2, n_q, n_k, 16, 16)
    real = h2o._colsum_module

    class Tampered:
        def __init__(self, module):
            self.module = module

        def launch_colsum(self, *args, **kw):
            args[4].add_(1.0)  # ws (no mask in this call): q, k, lse, score, ws, row_tab, col_tab, n_slots
            return self.module.launch_colsum(*args, **kw)

    def tampered(*a):
        kernel, module = real(*a)
        return kernel, (Tampered(module) if a[4] else module)  # cache_ranges: the diag_cache column pass

    monkeypatch.setattr(h2o, "_colsum_module", tampered)
    h2o.clear_workspaces()
    _, score = h2o.forward(q, k, v, scale=scale, causal=causal, plan="diag_cache", diagonals=kk, cache="balanced")
    p = probabilities(q, k, scale=scale, causal=causal)
    weight = torch.ones(n_q, n_k, dtype=torch.float64)
    for r, c in h2o._tables(n_q, n_k, t, causal, kk, "balanced")[3]:
        weight[r * t:(r + 1) * t, c * t:(c + 1) * t] = 2.0
    assert _rel(score, (p * weight).sum(-2)) < 1e-5


def test_workspace_reused_across_calls():
    q, k, v = _qkv(65, 1, 2, 2, 37, 45, 16, 16)
    h2o.clear_workspaces()
    kw = dict(scale=0.3, causal="top_left", plan="diag_cache", diagonals=2)
    h2o.forward(q, k, v, cache="balanced", **kw)
    (first,) = h2o._workspaces.values()
    ptr = first.data_ptr()
    for seed in (66, 67):
        q2, k2, v2 = _qkv(seed, 1, 2, 2, 37, 45, 16, 16)
        _, score = h2o.forward(q2, k2, v2, cache="balanced", **kw)
        assert _rel(score, reference(q2, k2, scale=0.3, causal="top_left")[1]) < 1e-4
        assert len(h2o._workspaces) == 1 and next(iter(h2o._workspaces.values())).data_ptr() == ptr
    # another size gets its own; the cache stays bounded
    for n in range(5):
        qq, kk_, vv = _qkv(68, 1, 2, 2, 37 + 16 * n, 45, 16, 16)
        h2o.forward(qq, kk_, vv, cache="balanced", **kw)
    assert len(h2o._workspaces) <= h2o._WS_KEEP


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_device_tables_equal_the_host_tables(causal):
    # a traced diag_cache call (the kernels handed to Inductor) computes its layout tables with
    # tensor ops on the device; they must be the host tables the kernels are tested with, for
    # every K of both layouts on square, tall and wide grids with ragged edges
    import itertools

    t = 16
    for n_q, n_k in itertools.product([1, 16, 17, 40, 64, 100], repeat=2):
        n = max(launch.cdiv(n_q, t), launch.cdiv(n_k, t))
        for cache in ("balanced",) + (("causal",) if causal != "none" else ()):
            for kk in range(n + 1):
                row_tab, col_tab, _, _ = h2o._tables(n_q, n_k, t, causal, kk, cache)
                rows, cols = h2o._device_tables(torch.device("cpu"), n_q, n_k, t, causal, kk, cache)
                assert rows.dtype == cols.dtype == torch.int32
                assert (rows.tolist(), cols.tolist()) == (row_tab, col_tab), (n_q, n_k, cache, kk)


def test_workspace_bytes():
    q, k = torch.empty(2, 4, 64, 32), torch.empty(2, 2, 64, 32)
    for plan in ("two_kernel", "one_kernel"):
        assert h2o.workspace_bytes(q, k, plan=plan, diagonals=0, cache="balanced") == 0
    assert h2o.workspace_bytes(q, k, plan="diag_cache", diagonals=0, cache="balanced") == 0
    # 4 blocks of 16: balanced K caches K tiles per query block
    assert h2o.workspace_bytes(q, k, plan="diag_cache", diagonals=3, cache="balanced") == 2 * 4 * 12 * 16 * 16 * 4
    # causal layout, top-left: query blocks 0..K-1 cache 1 + 2 + ... + K tiles
    assert h2o.workspace_bytes(q, k, plan="diag_cache", diagonals=3, cache="causal") == 2 * 4 * 6 * 16 * 16 * 4
    with pytest.raises(ValueError, match="diagonals"):
        h2o.workspace_bytes(q, k, plan="diag_cache", diagonals=5, cache="balanced")


# --- layouts (pure Python) ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_balanced_layout_is_the_cyclic_diagonals(n):
    for kk in range(n + 1):
        tiles = h2o.cached_tiles(n, kk, "balanced", False)
        assert tiles == [(r, c) for r in range(n) for c in range(n) if (c - r) % n < kk]
        bal = h2o.program_tiles(n, kk, "balanced", False)
        # every query block writes K tiles, every key block reads K: balanced
        assert all(w == kk for _, w in bal["rows"]) and all(rd == kk and rc == n - kk for rc, rd in bal["cols"])
        for line in range(n):  # at most two contiguous ranges per query block and per key block
            assert len(h2o._ranges([c for r, c in tiles if r == line])) <= 2
            assert len(h2o._ranges([r for r, c in tiles if c == line])) <= 2


@pytest.mark.parametrize("n", [1, 4, 8, 16])
def test_causal_layout_balance(n):
    # square top-left grid: query block r visits r + 1 tiles, key block c visits n - c
    for kk in range(n + 1):
        tiles = h2o.cached_tiles(n, kk, "causal", "top_left")
        assert tiles == [(r, c) for r in range(min(kk, n)) for c in range(r + 1)]
        assert len(tiles) == kk * (kk + 1) // 2
        bal = h2o.program_tiles(n, kk, "causal", True)
        rows, cols = bal["rows"], bal["cols"]
        assert [v for v, _ in rows] == [r + 1 for r in range(n)]  # kernel 0 visits what it did
        assert [w for _, w in rows] == [r + 1 if r < kk else 0 for r in range(n)]
        # kernel 1: key block c recomputes n - max(c, K) tiles and reads max(K - c, 0)
        assert cols == [(n - max(c, kk), max(kk - c, 0)) for c in range(n)]
        # the longest column pass recomputes n - K tiles (was n); kernel 0's longest row (n tiles,
        # no writes) is unchanged while K (1 + w) <= n, w the cost of a tile write relative to a tile
        assert max(rc for rc, _ in cols) == n - kk
        if 2 * kk <= n:
            assert max(v + w for v, w in rows) == n
        for line in range(n):  # one contiguous range per query block and per key block
            assert len(h2o._ranges([c for r, c in tiles if r == line])) <= 1
            assert len(h2o._ranges([r for r, c in tiles if c == line])) <= 1


def test_cached_tiles_bottom_right_and_rectangular():
    # 2 query blocks, 4 key blocks, bottom-right: query block 0 sees key blocks 0..2, block 1 all
    assert h2o.cached_tiles((2, 4), 1, "causal", "bottom_right") == [(0, 0), (0, 1), (0, 2)]
    assert h2o.cached_tiles((2, 4), 4, "causal", "bottom_right") == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                                     (1, 2), (1, 3)]
    # balanced on a 3 x 5 grid: cyclic diagonals modulo 5
    assert h2o.cached_tiles((3, 5), 2, "balanced", "none") == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 2), (2, 3)]


def test_plan_errors():
    q, k, v = _qkv(69, 1, 2, 2, 40, 40, 16, 16)
    with pytest.raises(ValueError, match="plan must be one of"):
        h2o.forward(q, k, v, scale=1.0, plan="three_kernel")
    with pytest.raises(ValueError, match="cache must be one of"):
        h2o.forward(q, k, v, scale=1.0, plan="diag_cache", diagonals=1, cache="diagonal")
    for bad in (-1, 4, 1.5, True):
        with pytest.raises(ValueError, match="diagonals must be an int in 0..3"):
            h2o.forward(q, k, v, scale=1.0, plan="diag_cache", diagonals=bad)
    with pytest.raises(ValueError, match="needs causal masking"):
        h2o.forward(q, k, v, scale=1.0, plan="diag_cache", diagonals=1, cache="causal")
    with pytest.raises(ValueError, match="BLOCK_M == BLOCK_N"):
        h2o.forward(q, k, v, scale=1.0, plan="diag_cache", diagonals=1, config={"BLOCK_M": 16, "BLOCK_N": 32})
    with pytest.raises(ValueError, match="fwd_config"):
        h2o.forward(q, k, v, scale=1.0, plan="diag_cache", diagonals=1, fwd_config={"BLOCK_M": 32})
    with pytest.raises(ValueError, match="mask_fill must be finite or -inf"):
        h2o.forward(q, k, v, scale=1.0, plan="one_kernel", mask=torch.ones(40, 40, dtype=torch.bool),
                    mask_kind="bool_keep", mask_fill=math.inf)
    with pytest.raises(ValueError, match="needs v"):
        h2o.forward(q, k, None, scale=1.0, plan="one_kernel")
    with pytest.raises(ValueError, match="cache must be one of"):
        h2o.cached_tiles(4, 1, "rows", False)
    with pytest.raises(ValueError, match="causal masking"):
        h2o.cached_tiles(4, 1, "causal", False)


@pytest.mark.parametrize("plan", PLAN_CASES, ids=[p[0] for p in PLAN_CASES])
def test_plans_empty_sizes(plan):
    q, k, v = torch.randn(2, 2, 0, 32), torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 16)
    kw = dict(plan[1], diagonals=0) if plan[1]["plan"] == "diag_cache" else plan[1]
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, scale=0.1, causal="top_left", **kw)
    assert out.shape == (2, 2, 0, 16) and (score == 0).all()
    q, k, v = torch.randn(1, 2, 7, 32), torch.randn(1, 2, 0, 32), torch.randn(1, 2, 0, 16)
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, scale=0.1, causal="top_left", **kw)
    assert score.shape == (1, 2, 0) and (out == 0).all()


def test_plan_kernels_render_and_do_not_specialize_lengths():
    names = set()
    for causal in (False, True):
        for kind in ("none", "bool_keep", "additive"):
            for need_out in (False, True):
                for one, ranges in ((True, 0), (False, 0), (False, 1), (False, 2)):
                    kern = h2o.fwd_kernel(causal=causal, mask_kind=kind, mask_row_broadcast=False, need_out=need_out,
                                          one_kernel=one, cache_ranges=ranges, interpret=False)
                    names.add(kern.name)
                    src = kern.source
                    assert ("tl.atomic_add" in src) == one and ("WS_seg" in src) == (ranges > 0)
                    assert ("V_head" in src) == need_out
                    fn = launch.kernel_module(kern, False).h2o_fwd_kernel
                    nospec = {p.name for p in fn.params if p.do_not_specialize}
                    assert nospec == {"N_Q", "N_K", "CAUSAL_OFFSET", "ROW_BASE"} | ({"N_SLOTS"} if ranges else set())
            for ranges in (1, 2):
                kern = h2o.colsum_kernel(causal=causal, mask_kind=kind, mask_row_broadcast=False, interpret=False,
                                         cache_ranges=ranges)
                assert "_colsum_cached" in kern.source
                names.add(kern.name)
    assert len(names) == 2 * 3 * (2 * 4 + 2)
    with pytest.raises(ValueError):
        h2o.fwd_kernel(causal=False, mask_kind="none", mask_row_broadcast=False, need_out=True, one_kernel=True,
                       cache_ranges=1, interpret=True)


def test_plan_config_tables():
    for plan in ("one_kernel", "diag_cache"):
        for dev in ("sm90", "cuda"):
            for bucket in (64, 128, 256):
                for size in (2, 4):
                    cands = h2o._TABLE_PLANS[plan][(dev, bucket, size)]
                    assert cands
                    for c in cands:
                        launch.check_config(c)
                        assert c["num_warps"] in (1, 2, 4, 8) and c["num_stages"] >= 1
                        if plan == "diag_cache":
                            assert c["BLOCK_M"] == c["BLOCK_N"]
        for c in h2o.candidate_configs(head_dim=80, dtype=torch.float16, device="cpu", plan=plan):
            assert c["num_stages"] == 1 and c["BLOCK_M"] <= 32 and c["BLOCK_N"] <= 32


def test_cached_quantity_float32_scores_vs_fp16_exponentials():
    # docs/math.md, "Caching tiles between the kernels": caching the float32 s' gives what a
    # recompute gives; caching fp16 exponentials exp2(s' - m_running) (with the running max per
    # row and tile, rescaled by exp2(m_running - LSE) in kernel 1) rounds every P to 11 bits and
    # flushes the small ones to 0 — at 30-sigma logits whole columns lose their (tiny) mass
    gen = torch.Generator().manual_seed(70)
    n, d, t = 256, 32, 32
    q, k = torch.randn(2, n, d, generator=gen), torch.randn(2, n, d, generator=gen)
    for mult in (1.0, 30.0):
        qk_scale = d ** -0.5 * mult * math.log2(math.e)
        ref = torch.softmax((q.double() @ k.double().mT) * (d ** -0.5 * mult), -1).sum(-2)
        s2 = (q @ k.mT) * qk_scale  # float32 s', as both kernels compute it
        m = torch.full((2, n), -math.inf)
        l = torch.zeros(2, n)
        m_at = []
        for j in range(0, n, t):  # kernel 0's online softmax over key tiles
            m_new = torch.maximum(m, s2[..., j:j + t].amax(-1))
            l = l * torch.exp2(m - m_new) + torch.exp2(s2[..., j:j + t] - m_new[..., None]).sum(-1)
            m = m_new
            m_at.append(m.clone())
        lse = m + torch.log2(l)
        cached_s = torch.exp2(s2 - lse[..., None]).sum(-2)
        fp16 = torch.cat([(torch.exp2(s2[..., j:j + t] - m_at[i][..., None]).half().float()
                           * torch.exp2(m_at[i] - lse)[..., None]).sum(-2) for i, j in enumerate(range(0, n, t))], -1)
        e32, e16 = _rel(cached_s, ref), _rel(fp16, ref)
        assert e32 < 3e-6 and e16 > 4 * e32, (mult, e32, e16)
        worst16 = ((fp16.double() - ref).abs() / ref).max().item()
        worst32 = ((cached_s.double() - ref).abs() / ref).max().item()
        assert worst32 < 1e-3
        if mult == 30.0:
            assert worst16 > 0.5  # some key's whole score is lost to fp16 underflow


# --- GPU: every plan at real sizes (the lead runs these) ----------------------------------------

GPU_PLAN_CASES = [
    ("one_kernel", dict(plan="one_kernel")),
    ("diag_balanced_K4", dict(plan="diag_cache", diagonals=4, cache="balanced")),
    ("diag_causal_K8", dict(plan="diag_cache", diagonals=8, cache="causal")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("plan", GPU_PLAN_CASES, ids=[p[0] for p in GPU_PLAN_CASES])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_plans_match_reference(case, plan):
    _, dtype, b, hq, hkv, n_q, n_k, d, causal, mask_spec = case
    plan_kw = dict(plan[1])
    if plan_kw.get("cache") == "causal" and causal == "none":
        plan_kw["cache"] = "balanced"
    dev = torch.device("cuda")
    q, k, v = _qkv(104, b, hq, hkv, n_q, n_k, d, d, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(105)
    mask, mask_kind = None, "none"
    if mask_spec == "keypad":
        keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
        keep[0, ..., n_k - 300:] = False
        keep[1] = False
        mask, mask_kind = keep.to(dev), "bool_keep"
    elif mask_spec == "bias":
        mask, mask_kind = torch.randn(b, hq, n_q, n_k, generator=gen).to(dev), "additive"
    kw = dict(scale=d ** -0.5, causal=causal, mask=mask, mask_kind=mask_kind)
    if "diagonals" in plan_kw:
        plan_kw["diagonals"] = min(plan_kw["diagonals"], h2o.diagonal_count(q, k, causal))
    h2o.clear_workspaces()
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, **plan_kw, **kw)
    ref_out, ref_score = reference(q, k, v, **kw)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert not score.isnan().any() and _rel(score, ref_score) < tol
    assert not out.isnan().any() and _rel(out, ref_out) < tol
    assert (score[ref_score == 0] == 0).all()
    _, s_none = h2o.forward(q, k, None, need_out=False, **plan_kw, **kw)
    assert _rel(s_none, ref_score) < tol


# --------------------------------------------------------------------------------------------
# Finite causal fills (transformers' eager finfo.min causal mask): two_kernel, no data mask
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,n_q,n_k", [("top_left", 37, 37), ("bottom_right", 21, 50), ("top_left", 50, 21),
                                            ("bottom_right", 45, 19)])
@pytest.mark.parametrize("fill,mode,magnitude", [
    (F32_MIN, "add", 1.0),     # transformers' eager causal mask: tiles above skipped (the bound holds)
    (-1e4, "replace", 30.0),   # large logits, the bound still holds (|s| <= ~400 against 1.4e4)
    (-5.0, "replace", 1.0),    # a small fill: hidden keys carry weight, the bound fails, every tile visited
    (-3.0, "add", 1.0),
    # (bottom_right with Nq > Nk: rows with no visible key, the bound never holds, every tile visited)
])
@pytest.mark.parametrize("need_out", [True, False])
def test_finite_causal_fill(causal, n_q, n_k, fill, mode, magnitude, need_out):
    q, k, v = _qkv(11 + n_q, 2, 4, 2, n_q, n_k, 16, 8)
    q = q * magnitude
    scale = 16 ** -0.5
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v if need_out else None, scale=scale, causal=causal, need_out=need_out,
                                 causal_fill=fill, causal_fill_mode=mode)
    ref_out, ref_score = reference(q, k, v, scale=scale, causal=causal, causal_fill=fill, causal_fill_mode=mode)
    assert torch.isfinite(score).all()
    assert _rel(score, ref_score) < 1e-4, _rel(score, ref_score)
    if need_out:
        assert _rel(out, ref_out) < 1e-4
    else:
        assert out is None
    # rows with no visible key (bottom_right with Nq > Nk) spread their weight over every key
    if causal == "bottom_right" and n_q > n_k:
        assert (score > 0).all()


def test_finite_causal_fill_rejected_where_unsupported():
    q, k, v = _qkv(1, 1, 2, 2, 8, 8, 8, 8)
    # the row kernels (one_kernel, diag_cache's kernel 0) never visit the tiles above the diagonal
    with pytest.raises(ValueError, match="two_kernel"):
        h2o.forward(q, k, v, scale=0.3, causal="top_left", plan="one_kernel", causal_fill=-1e4)
    with pytest.raises(ValueError, match="two_kernel"):
        h2o.forward(q, k, v, scale=0.3, causal="top_left", plan="one_kernel", causal_fill=-1e4,
                    mask=torch.ones(8, 8, dtype=torch.bool), mask_kind="bool_keep", mask_fill=-1e4)
    with pytest.raises(ValueError, match="two_kernel"):
        h2o.forward(q, k, v, scale=0.3, causal="top_left", plan="diag_cache", diagonals=1, causal_fill=-1e4)
    # no causal masking: the fill applies to nothing (the -inf variant runs)
    out, score = h2o.forward(q, k, v, scale=0.3, causal="none", causal_fill=-1e4)
    torch.testing.assert_close(score, h2o.forward(q, k, v, scale=0.3, causal="none")[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fill,mode", [(F32_MIN, "add"), (-3.0, "replace")])
@pytest.mark.parametrize("causal,n_q,n_k", [("top_left", 1000, 1000), ("bottom_right", 300, 1100)])
def test_gpu_finite_causal_fill(dtype, fill, mode, causal, n_q, n_k):
    dev = torch.device("cuda")
    q, k, v = _qkv(5, 2, 8, 2, n_q, n_k, 128, 128, dtype=dtype, device=dev)
    scale = 128 ** -0.5
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, scale=scale, causal=causal, causal_fill=fill, causal_fill_mode=mode)
    ref_out, ref_score = reference(q.cpu(), k.cpu(), v.cpu(), scale=scale, causal=causal, causal_fill=fill,
                                   causal_fill_mode=mode)
    assert _rel(score.cpu(), ref_score) < TOL[dtype]
    assert _rel(out.cpu(), ref_out) < TOL[dtype]


# --------------------------------------------------------------------------------------------
# Finite fills of a boolean data mask (masked_fill(~pad, finfo.min), where(keep, s, -3)): every
# plan; and a finite causal fill beside a data mask (two_kernel). Hidden entries are scores like
# any other, as in eager: a row whose keys are all hidden spreads its weight uniformly, a partly
# hidden row gives its hidden keys exp(fill - max) (0 only where that underflows).
# --------------------------------------------------------------------------------------------

FILL_PLANS = [("two_kernel", dict(plan="two_kernel"))] + PLAN_CASES


def _fill_reference(q, k, v, **kw):
    """``(out or None, score, P)`` in float64 from the attention reference, which takes every fill
    (``mask_fill``, ``causal_fill``): the probabilities through the identity as v, as
    ``patterns/h2o_reference.py`` computes them."""
    b, hkv, n_k = k.shape[:3]
    eye = torch.eye(n_k, dtype=torch.float64).expand(b, hkv, n_k, n_k)
    p, _ = attention_reference(q, k, eye, **kw)
    out = attention_reference(q, k, v, **kw)[0] if v is not None else None
    return out, p.sum(-2), p


def _check_fill(q, k, v, plan_kw, *, need_out=True, tol=None, **kw):
    """One plan's kernels (outputs and a fresh workspace poisoned) against the float64 reference
    with fills; returns ``(out, score, reference score, reference P)``."""
    tol = TOL[q.dtype] if tol is None else tol
    plan_kw = dict(plan_kw)
    if plan_kw.get("plan") == "diag_cache":
        if plan_kw.get("cache") == "causal" and kw.get("causal", "none") == "none":
            plan_kw["cache"] = "balanced"
        plan_kw["diagonals"] = min(plan_kw["diagonals"], h2o.diagonal_count(q, k, kw.get("causal", "none")))
    h2o.clear_workspaces()
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v if need_out else None, need_out=need_out, **plan_kw, **kw)
    ref_out, ref_score, p = _fill_reference(q, k, v, **kw)
    b, hq, n_q = q.shape[:3]
    assert score.shape == (b, hq, k.shape[2]) and torch.isfinite(score).all()
    err = _rel(score, ref_score)
    assert err < tol, f"score: relative error {err:.3g} >= {tol}"
    assert (score[ref_score == 0] == 0).all(), "keys no query sees must score 0"
    if need_out:
        assert not out.isnan().any()
        e = _rel(out, ref_out)
        assert e < tol, f"out: relative error {e:.3g} >= {tol}"
    else:
        assert out is None
    return out, score, ref_score, p


def _padding(b, n_k, seed):
    """Key padding ``[B, 1, 1, Nk]`` (True = visible): batch 0 padded at the end and one hole,
    batch 1 (and any further) entirely hidden."""
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., n_k - 9:] = False
    keep[0, ..., 3] = False
    keep[1:] = False
    return keep


@pytest.mark.parametrize("plan", FILL_PLANS, ids=[p[0] for p in FILL_PLANS])
@pytest.mark.parametrize("fill", [F32_MIN, -3.0, 2.0], ids=["finfo_min", "minus3", "plus2"])
@pytest.mark.parametrize("causal,n_q,n_k", [("none", 37, 50), ("top_left", 50, 37), ("bottom_right", 45, 19)])
def test_mask_fill_padding(plan, fill, causal, n_q, n_k):
    """Key padding with a finite fill, a batch whose keys are all hidden (bottom_right with Nq > Nk:
    rows the causal mask empties too), N not a multiple of any block; with and without out."""
    q, k, v = _qkv(80 + n_q, 2, 4, 2, n_q, n_k, 16, 8)
    keep = _padding(2, n_k, 81)
    kw = dict(scale=0.25, causal=causal, mask=keep, mask_kind="bool_keep", mask_fill=fill)
    out, score, ref, p = _check_fill(q, k, v, plan[1], **kw)
    _, without, _, _ = _check_fill(q, k, v, plan[1], need_out=False, **kw)
    assert _rel(without, score) < 1e-6
    if causal == "none":
        # batch 1: every key hidden, every row uniform over the keys (eager: fill - fill = 0)
        assert torch.allclose(score[1], torch.full_like(score[1], n_q / n_k), rtol=1e-5)
    if fill == -3.0:
        # the hidden keys of batch 0 carry weight: computed, not assumed 0
        assert (p[0, :, :, n_k - 9:] > 1e-4).any() and (score[0, :, n_k - 9:] > 0).all()
    if fill == 2.0:
        # a fill above most scores: the 10 hidden keys of 50 take far more than their share
        assert p[0, :, -1, n_k - 9:].sum(-1).min() > 0.3


@pytest.mark.parametrize("plan", FILL_PLANS, ids=[p[0] for p in FILL_PLANS])
@pytest.mark.parametrize("kind", ["bool_keep", "bool_drop"])
@pytest.mark.parametrize("fill", [F32_MIN, -3.0], ids=["finfo_min", "minus3"])
def test_mask_fill_full_mask_with_hidden_rows(plan, kind, fill):
    """A full ``[B, Hq, Nq, Nk]`` mask with rows and whole heads hidden, GQA, top-left causal
    beside it (the causal mask wins above the diagonal: -inf, tiles skipped)."""
    b, hq, hkv, n_q, n_k = 2, 4, 2, 37, 41
    q, k, v = _qkv(82, b, hq, hkv, n_q, n_k, 16, 16)
    gen = torch.Generator().manual_seed(83)
    keep = torch.rand(b, hq, n_q, n_k, generator=gen) > 0.4
    keep[0, 1, 5] = False  # a row with every key hidden
    keep[1, 2] = False  # a head with every key hidden
    mask = keep if kind == "bool_keep" else ~keep
    _check_fill(q, k, v, plan[1], scale=0.25, causal="top_left", mask=mask, mask_kind=kind, mask_fill=fill)


@pytest.mark.parametrize("plan", FILL_PLANS, ids=[p[0] for p in FILL_PLANS])
@pytest.mark.parametrize("fill", [F32_MIN, -3.0], ids=["finfo_min", "minus3"])
def test_mask_fill_large_logits(plan, fill):
    """Logits scaled by 30 (exp2 of an unshifted score overflows): the row max is kept; a row
    whose keys are all hidden is still uniform."""
    q, k, v = _qkv(84, 1, 2, 2, 45, 50, 32, 32)
    scale = 30 * 32 ** -0.5
    assert ((q @ k.mT).double() * scale * math.log2(math.e)).max() > 128
    keep = torch.rand(1, 1, 45, 50, generator=torch.Generator().manual_seed(85)) > 0.5
    keep[..., 7, :] = False
    _, score, _, p = _check_fill(q, k, v, plan[1], scale=scale, causal="none", mask=keep, mask_kind="bool_keep",
                                 mask_fill=fill)
    assert torch.allclose(p[0, :, 7], torch.full_like(p[0, :, 7], 1 / 50))


@pytest.mark.parametrize("plan", FILL_PLANS, ids=[p[0] for p in FILL_PLANS])
def test_mask_fill_fp16(plan):
    """fp16 inputs with fp16's finfo.min (a row of it is uniform) and a small fill."""
    q, k, v = _qkv(86, 2, 4, 2, 67, 53, 32, 32, dtype=torch.float16)
    keep = _padding(2, 53, 87)
    for fill in (torch.finfo(torch.float16).min, -3.0):
        _check_fill(q, k, v, plan[1], scale=32 ** -0.5, causal="bottom_right", mask=keep, mask_kind="bool_keep",
                    mask_fill=fill)


def test_mask_fill_kernels_are_the_variants_that_run():
    """kernels_for names the fill variants every plan runs; the fill is a runtime value (one module
    serves every finite fill) and applies to boolean masks only."""
    kw = dict(causal="top_left", mask_kind="bool_drop", mask_row_broadcast=True, interpret=True, mask_fill=-1e4)
    two = h2o.kernels_for(plan="two_kernel", need_out=True, **kw)
    assert [kk.name for kk in two] == ["attention_fwd_causal_maskdropfill_rowbcast_interp",
                                       "h2o_colsum_causal_maskdropfill_rowbcast_interp"]
    assert "mask_fill" in two[1].source and "Stats_head" in two[1].source
    noout = h2o.kernels_for(plan="two_kernel", need_out=False, **kw)
    assert noout[0].name == "h2o_fwd_causal_maskdropfill_rowbcast_noout_interp" and "log2_l" in noout[0].source
    assert h2o.kernels_for(plan="one_kernel", need_out=True, **kw)[0].name == \
        "h2o_onekernel_causal_maskdropfill_rowbcast_interp"
    diag = h2o.kernels_for(plan="diag_cache", diagonals=1, cache="causal", need_out=True, **kw)
    assert [kk.name for kk in diag] == ["h2o_fwd_causal_maskdropfill_rowbcast_cache1_interp",
                                        "h2o_colsum_causal_maskdropfill_rowbcast_cache1_interp"]
    assert h2o.kernels_for(plan="diag_cache", diagonals=1, cache="causal", need_out=True,
                           **dict(kw, mask_fill=-5.0)) == diag
    # an additive mask ignores mask_fill (as the attention kernels do)
    add = h2o.kernels_for(plan="two_kernel", need_out=True, **dict(kw, mask_kind="additive"))
    assert "fill" not in add[1].name
    # one compiled kernel serves every fill value: the fill is not a specialised argument
    q, k, v = _qkv(88, 1, 2, 2, 20, 20, 16, 16)
    keep = _padding(1, 20, 0)
    before = len(render.rendered_kernels())
    for fill in (-1e4, -2.5):
        _check_fill(q, k, v, {}, scale=0.3, mask=keep, mask_kind="bool_keep", mask_fill=fill)
    assert len(render.rendered_kernels()) <= before + 2  # the first call's two variants at most


@pytest.mark.parametrize("kind,mask_fill", [("bool_keep", -math.inf), ("bool_keep", F32_MIN), ("bool_keep", -3.0),
                                            ("additive", -math.inf)],
                         ids=["pad_inf", "pad_finfo_min", "pad_minus3", "additive"])
@pytest.mark.parametrize("fill,mode", [(F32_MIN, "add"), (-3.0, "replace"), (-2.0, "add")])
@pytest.mark.parametrize("causal,n_q,n_k", [("top_left", 37, 37), ("bottom_right", 45, 19)])
def test_finite_causal_fill_with_a_data_mask(kind, mask_fill, fill, mode, causal, n_q, n_k):
    """A finite causal fill beside a data mask (padding, with a -inf or finite fill; an additive
    mask with -inf and finfo.min entries): two_kernel, every query block of the column pass
    visited (no bound with a data mask), the causal fill applied after the mask as eager does."""
    q, k, v = _qkv(90 + n_q, 2, 4, 2, n_q, n_k, 16, 8)
    if kind == "additive":
        gen = torch.Generator().manual_seed(91)
        mask = torch.randn(2, 1, n_q, n_k, generator=gen)
        mask[mask < -1.0] = -math.inf
        mask[mask > 1.2] = F32_MIN
        mask[1, 0, 4] = -math.inf  # a row the mask empties: the causal fill cannot add to -inf
    else:
        mask = _padding(2, n_k, 92)
    kw = dict(scale=0.25, causal=causal, mask=mask, mask_kind=kind, mask_fill=mask_fill, causal_fill=fill,
              causal_fill_mode=mode)
    _, score, _, _ = _check_fill(q, k, v, {}, **kw)
    _, without, _, _ = _check_fill(q, k, v, {}, need_out=False, **kw)
    assert _rel(without, score) < 1e-6
    names = [kk.name for kk in h2o.kernels_for(plan="two_kernel", causal=causal, mask_kind=kind,
                                               mask_row_broadcast=kind != "additive", need_out=True,
                                               interpret=True, mask_fill=mask_fill, causal_fill=fill,
                                               causal_fill_mode=mode)]
    assert names[0].startswith("attention_fwd_causal" + ("add" if mode == "add" else "fill"))
    assert "SkipHidden" not in h2o.kernels_for(plan="two_kernel", causal=causal, mask_kind=kind,
                                               mask_row_broadcast=False, need_out=True, interpret=True,
                                               causal_fill=fill, causal_fill_mode=mode)[1].source


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("plan", FILL_PLANS, ids=[p[0] for p in FILL_PLANS])
@pytest.mark.parametrize("fill", ["finfo_min", -3.0])
def test_gpu_mask_fill(dtype, plan, fill):
    dev = torch.device("cuda")
    b, n_q, n_k = 2, 1000, 1100
    q, k, v = _qkv(93, b, 8, 2, n_q, n_k, 128, 128, dtype=dtype, device=dev)
    keep = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
    keep[0, ..., n_k - 300:] = False
    keep[1] = False
    value = torch.finfo(dtype).min if fill == "finfo_min" else fill
    kw = dict(scale=128 ** -0.5, causal="bottom_right", mask=keep.to(dev), mask_kind="bool_keep", mask_fill=value)
    plan_kw = dict(plan[1])
    if "diagonals" in plan_kw:
        plan_kw["diagonals"] = min(8, h2o.diagonal_count(q, k, "bottom_right"))
    h2o.clear_workspaces()
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, **plan_kw, **kw)
    ref_out, ref_score, _ = _fill_reference(q.cpu(), k.cpu(), v.cpu(), **dict(kw, mask=keep))
    assert not score.isnan().any() and _rel(score.cpu(), ref_score) < TOL[dtype]
    assert not out.isnan().any() and _rel(out.cpu(), ref_out) < TOL[dtype]
    _, s_none = h2o.forward(q, k, None, need_out=False, **plan_kw, **kw)
    assert _rel(s_none.cpu(), ref_score) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_fill", [-math.inf, -3.0])
def test_gpu_finite_causal_fill_with_padding(dtype, mask_fill):
    dev = torch.device("cuda")
    b, n = 2, 1000
    q, k, v = _qkv(94, b, 8, 2, n, n, 128, 128, dtype=dtype, device=dev)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keep[0, ..., :200] = False  # left padding: the first rows see no key but the filled ones
    kw = dict(scale=128 ** -0.5, causal="top_left", mask=keep, mask_kind="bool_keep", mask_fill=mask_fill,
              causal_fill=F32_MIN, causal_fill_mode="add")
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, **dict(kw, mask=keep.to(dev)))
    ref_out, ref_score, _ = _fill_reference(q.cpu(), k.cpu(), v.cpu(), **kw)
    assert _rel(score.cpu(), ref_score) < TOL[dtype]
    assert _rel(out.cpu(), ref_out) < TOL[dtype]
