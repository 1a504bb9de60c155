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
           tol=None):
    """Kernels (outputs poisoned) against the reference; returns (out, score, reference score)."""
    dtype = q.dtype
    tol = TOL[dtype] if tol is None else tol
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kw = dict(scale=scale, causal=causal, mask=mask, mask_kind=mask_kind)
    with launch.poison_outputs():
        out, score = h2o.forward(q, k, v, need_out=need_out, config=config, **kw)
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
    # compiled kernels: the lengths and the causal offset are never specialised (no divisibility
    # or ==1 specialisation: one compile per dtype and config)
    kern = h2o.colsum_kernel(causal=True, mask_kind="bool_keep", mask_row_broadcast=False, interpret=False)
    fn = launch.kernel_module(kern, False).h2o_colsum_kernel
    nospec = {p.name for p in fn.params if p.do_not_specialize}
    assert nospec == {"N_Q", "N_K", "CAUSAL_OFFSET"}


def test_rejects_unsupported():
    q, k, v = _qkv(33, 1, 2, 2, 8, 8, 32, 32)
    with pytest.raises(ValueError, match="mask_fill.*supported"):
        h2o.forward(q, k, v, scale=1.0, mask=torch.ones(8, 8, dtype=torch.bool), mask_kind="bool_keep",
                    mask_fill=-1e4)
    with pytest.raises(ValueError, match="causal_fill.*supported"):
        h2o.forward(q, k, v, scale=1.0, causal="top_left", causal_fill=F32_MIN)
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
