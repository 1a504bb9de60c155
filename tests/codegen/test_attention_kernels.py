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

from fuser.codegen import attention, launch
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
    dout=None, tol=None, seed=0,
):
    """Forward (and backward in each mode) against the reference; returns (out, lse, grads by mode)."""
    dtype = q.dtype
    tol = TOL[dtype] if tol is None else tol
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kw = dict(scale=scale, causal=causal, mask=mask, mask_kind=mask_kind)
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
        assert lse.shape == ref_lse.shape and lse.dtype == torch.float32 and lse.is_contiguous()
        assert not lse.isnan().any()
        empty = torch.isneginf(ref_lse)
        assert torch.isposinf(lse[empty]).all(), "rows with no visible key must store LSE = +inf"
        assert torch.isfinite(lse[~empty]).all()
        # a row whose every visible score carries a finfo.min bias has LSE = finfo.min + O(1),
        # which base 2 cannot hold in fp32: the kernel saturates it at -FLT_MAX (out and grads
        # stay exact, the backward recomputes the same saturated scores)
        saturated = ~empty & (ref_lse < -1e38)
        assert (lse[saturated] < -1e38).all()
        normal = ~empty & ~saturated
        if normal.any():
            lse_err = (lse[normal].double() / LOG2E - ref_lse[normal]).abs().max().item()
            assert lse_err < (1e-4 if dtype == torch.float32 else 2e-3), f"lse error {lse_err:.3g}"
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
    # Row 5 of batch 0 has LSE = finfo.min + O(1): fp32 cannot hold log2(l) beside it, so the
    # backward's P = exp2(s - LSE) is off there by the factor l (a documented limitation shared
    # by fused kernels that store one LSE). Such rows (e.g. fully padded queries) get no upstream
    # gradient in practice; give them none here, and then every gradient is exact.
    dout = torch.randn(b, h, n_q, 32, generator=gen)
    dout[0, :, 5] = 0
    out, lse, grads = _check(q, k, v, mask=bias, mask_kind="additive", dout=dout)
    assert (out[0, :, 3] == 0).all()


def test_additive_key_padding_low_precision_mask():
    # row-broadcast additive mask in another float dtype than the inputs
    b, h, n_q, n_k = 2, 2, 33, 47
    q, k, v = _qkv(26, b, h, h, n_q, n_k, 32, 32)
    bias = torch.zeros(b, 1, 1, n_k, dtype=torch.float16)
    bias[0, ..., 30:] = torch.finfo(torch.float16).min
    bias[1, ..., :5] = -math.inf
    bias[1, ..., 10:12] = 1.5
    _check(q, k, v, mask=bias, mask_kind="additive", causal="bottom_right")


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
                                assert len(ks) == (2 if training else 1)
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
    lse_err = (lse.double() / LOG2E - ref_lse.detach()).abs().max().item()
    assert lse_err < 1e-2
    for mode in BWD_MODES:
        with launch.poison_outputs():
            grads = attention.backward(dout, q, k, v, out, lse, bwd_mode=mode, **kw)
        for name, g, r, base in zip("qkv", grads, ref_grads, base_grads):
            assert not g.isnan().any(), f"d{name} NaN ({mode})"
            e = _rel(g, r)
            assert ok(e, base), f"d{name} ({mode}): error {e:.3g} vs sdpa {base:.3g}"


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


def test_default_config_falls_back_when_out_of_resources():
    class OutOfResources(Exception):
        pass

    tried = []

    def run(cfg):
        tried.append(cfg["n"])
        if cfg["n"] < 2:
            raise OutOfResources("shared memory")

    configs = [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}]
    launch.launch_first_fitting(("test-key",), configs, run)
    assert tried == [0, 1, 2]
    tried.clear()
    launch.launch_first_fitting(("test-key",), configs, run)  # remembered
    assert tried == [2]
    with pytest.raises(OutOfResources):  # an explicit config is not replaced
        launch.launch_first_fitting(("other-key",), [{"n": 0}], run)
    with pytest.raises(ValueError):  # other errors are not retried
        launch.launch_first_fitting(("third-key",), configs, lambda cfg: (_ for _ in ()).throw(ValueError()))
