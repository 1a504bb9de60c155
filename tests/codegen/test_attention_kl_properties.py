"""Property test: the attention-KL kernels equal the float64 reference on random shapes and
variants (ragged sizes, GQA per side, D1 != D2, causal alignments, masks, fills of hidden entries
per side, the hidden entries' KL terms zeroed or not, split-K, both backward modes, frozen or
trainable teacher), forward rows and statistics-driven gradients."""

from __future__ import annotations

import math

import torch
from _kernel_checks import random_mask, rel_err as _rel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.codegen import attention_kl as kernels
from fuser.codegen import launch
from fuser.patterns.attention_kl_reference import reference

ALL = (True, True, True, True)
FROZEN = (False, False, True, True)


@st.composite
def problems(draw):
    hkv1, hkv2 = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    return dict(
        b=draw(st.sampled_from([1, 2])), h=4, hkv1=hkv1, hkv2=hkv2,
        nq=draw(st.integers(1, 60)), nk=draw(st.integers(1, 60)),
        d1=draw(st.sampled_from([16, 24, 40])), d2=draw(st.sampled_from([16, 32, 40])),
        scale1=draw(st.sampled_from([0.3, 0.125, -0.2])), scale2=draw(st.sampled_from([0.25, 0.5])),
        causal=draw(st.sampled_from(["none", "top_left", "bottom_right"])),
        mask_kind=draw(st.sampled_from(["none", "bool_keep", "bool_drop", "additive"])),
        row_mask=draw(st.booleans()), split_k=draw(st.sampled_from([1, 2, 3])),
        bwd_mode=draw(st.sampled_from(["two_kernel", "atomic_dq"])), needs=draw(st.sampled_from([ALL, FROZEN])),
        seed=draw(st.integers(0, 2**31 - 1)),
        fills=draw(st.sampled_from(FILLS)),
        causal_fill_mode=draw(st.sampled_from(["replace", "add"])),
        zero_hidden=draw(st.booleans()),
    )


MIN32 = torch.finfo(torch.float32).min
# Per-side fills of hidden entries (natural units; -inf hides; finfo.min saturates), as (mask
# fill, causal fill) pairs (teacher, student). Consistent per side: a fill combination under
# which side 1 keeps mass where side 2's fill is ~1e38 lower has a KL of ~1e38 (ill-posed).
FILLS = [
    (None, None),
    ((-2.0, -3.0), None),
    ((-math.inf, -1.0), None),
    (None, (-1.0, -2.0)),
    ((-2.0, -3.0), (-1.0, -2.0)),
    ((-math.inf, -1.0), (-1.0, -2.0)),
    ((MIN32, MIN32 * 0.5), None),
    (None, (MIN32 * 0.3, MIN32)),
    ((MIN32 * 0.5, MIN32 * 0.5), (MIN32, MIN32)),
]


def _fill_kwargs(p) -> dict:
    """The fills that apply to the drawn variant (a mask fill needs a boolean mask, a causal
    fill a causal mode), and zero_hidden."""
    kw = {"causal_fill_mode": p["causal_fill_mode"], "zero_hidden": p["zero_hidden"]}
    mask_fill, causal_fill = p["fills"]
    if mask_fill is not None and p["mask_kind"] in ("bool_keep", "bool_drop"):
        kw["mask_fill1"], kw["mask_fill2"] = mask_fill
    if causal_fill is not None and p["causal"] != "none":
        kw["causal_fill1"], kw["causal_fill2"] = causal_fill
    return kw


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_kernels_equal_reference(p):
    g = torch.Generator().manual_seed(p["seed"])
    q1 = torch.randn(p["b"], p["h"], p["nq"], p["d1"], generator=g)
    k1 = torch.randn(p["b"], p["hkv1"], p["nk"], p["d1"], generator=g)
    q2 = torch.randn(p["b"], p["h"], p["nq"], p["d2"], generator=g)
    k2 = torch.randn(p["b"], p["hkv2"], p["nk"], p["d2"], generator=g)
    mask = random_mask(p["mask_kind"], (p["b"], 1, 1, p["nk"]), (1, p["h"], p["nq"], p["nk"]), p["row_mask"], g)
    kw = dict(scale1=p["scale1"], scale2=p["scale2"], causal=p["causal"], mask=mask, mask_kind=p["mask_kind"],
              **_fill_kwargs(p))
    with launch.poison_outputs():
        rows, lse1, lse2, delta = kernels.forward(q1, k1, q2, k2, split_k=p["split_k"], **kw)
    leaves = [x.double().requires_grad_(need) for x, need in zip((q1, k1, q2, k2), p["needs"])]
    ref = reference(*leaves, **kw)["rows"]
    assert not torch.isnan(rows).any()
    assert (rows - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
    g_rows = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    with launch.poison_outputs():
        grads = kernels.backward(g_rows.float(), q1, k1, q2, k2, lse1, lse2, delta, needs_grad=p["needs"],
                                 bwd_mode=p["bwd_mode"], **kw)
    wanted = [x for x in leaves if x.requires_grad]
    want = iter(torch.autograd.grad((ref * g_rows).sum(), wanted, allow_unused=True))
    for got, need in zip(grads, p["needs"]):
        if not need:
            assert got is None
            continue
        exp = next(want)
        exp = torch.zeros_like(got, dtype=torch.float64) if exp is None else exp
        assert not torch.isnan(got).any()
        if exp.norm() > 1e-6:
            assert _rel(got, exp) < 5e-4
        else:  # e.g. one visible key: both softmaxes are 1 there, dS = 0 exactly
            assert got.abs().max() < 1e-5
