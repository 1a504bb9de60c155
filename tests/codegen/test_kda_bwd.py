"""KDA backward (codegen/kda_bwd.py + templates/kda_bwd.py.jinja) against torch.autograd through the
float64 token recurrence (patterns/kda_reference.recurrent).

The hand-derived float64 ``reference_backward`` is checked first (it validates the derivation of
docs/math.md, "KDA backward"), then the kernels: in Triton's interpreter on CPU at small, ragged
sizes (T = 37 with chunks of 16, K = 24, V = 40), and on the GPU (``gpu``) in bfloat16. Every
output is allocated poisoned (NaN), so an element a kernel fails to write shows up.
"""

from __future__ import annotations

import pytest
from _kernel_checks import KDA_LEAD_LAYOUTS, kda_lead_inputs, kda_lead_layout, rel_err
import torch
import torch.nn.functional as F

from fuser.codegen import kda_bwd, kda_chunk, kda_recurrent, launch
from fuser.patterns import kda_reference

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(seed, nq, group, t, kd, vd, *, scalar_gate=False, h0=True, dht=True, strong=False, raw_k=False,
            gscale=1.0, device="cpu"):
    """Float32 inputs of the kernel interface (q, k [NQ, T, K]; v, do [N, T, V]; g; beta [N, T];
    the states [N, K, V] or None): l2-normalised k unless ``raw_k``, gates -softplus(randn) times
    ``gscale``, with ``strong`` about a fifth of them lowered by 30."""
    gen = torch.Generator().manual_seed(seed)
    n = nq * group
    q = torch.randn(nq, t, kd, generator=gen)
    k = torch.randn(nq, t, kd, generator=gen)
    k = k * 0.4 if raw_k else F.normalize(k, dim=-1)
    v = torch.randn(n, t, vd, generator=gen)
    gshape = (n, t) if scalar_gate else (n, t, kd)
    g = -F.softplus(torch.randn(*gshape, generator=gen)) * gscale
    if strong:
        g = g - 30.0 * (torch.rand(*gshape, generator=gen) < 0.2)
    beta = torch.rand(n, t, generator=gen)
    do = torch.randn(n, t, vd, generator=gen)
    s0 = torch.randn(n, kd, vd, generator=gen) if h0 else None
    ds = torch.randn(n, kd, vd, generator=gen) if dht else None
    return [None if x is None else x.to(device) for x in (q, k, v, g, beta, do, s0, ds)]


def _autograd(q, k, v, g, beta, do, s0, ds, *, scale, scalar_gate):
    """The gradients of ``<o, do> + <final state, ds>`` by torch.autograd through the float64
    recurrence (the kernel layout mapped to the reference's [B=1, T, H, *] one)."""
    f = torch.float64
    leaves = [x.detach().to(f).requires_grad_() for x in (q, k, v, g, beta)]
    lq, lk, lv, lg, lb = leaves
    ls0 = None if s0 is None else s0.detach().to(f).requires_grad_()
    n, t = lv.shape[:2]
    gg = lg[..., None].expand(n, t, lq.shape[-1]) if scalar_gate else lg
    o, s_final = kda_reference.recurrent(
        lq.transpose(0, 1)[None], lk.transpose(0, 1)[None], lv.transpose(0, 1)[None], gg.transpose(0, 1)[None],
        lb.transpose(0, 1)[None], scale=scale, initial_state=None if ls0 is None else ls0[None],
        output_final_state=True)
    loss = (o[0].transpose(0, 1) * do.to(f)).sum()
    if ds is not None:
        loss = loss + (s_final[0] * ds.to(f)).sum()
    grads = torch.autograd.grad(loss, leaves + ([ls0] if ls0 is not None else []))
    return list(grads) + ([] if ls0 is not None else [None])


def _compare(got, want, tol, what=""):
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, f"{what}{name}: expected None"
            continue
        assert a.shape == b.shape, f"{what}{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{what}{name}: non-finite (an unwritten, poisoned element?)"
        err = rel_err(a, b)
        assert err < tol, f"{what}{name}: relative error {err:.3g} >= {tol}"


# ---------------------------------------------------------------------------------------------
# The derivation: float64 reference_backward against autograd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nq,group,t,kd,vd,chunk,scalar_gate,h0,dht,strong", [
    (1, 1, 16, 4, 4, 4, False, False, False, False),
    (2, 2, 37, 8, 5, 16, False, True, True, False),    # T not a multiple of the chunk, GVA
    (1, 3, 23, 6, 7, 64, False, True, False, False),   # one partial chunk, group 3
    (2, 1, 37, 5, 3, 7, True, False, True, False),     # scalar gate, odd chunk
    (1, 2, 40, 6, 4, 16, False, True, True, True),     # gates near -30
    (1, 1, 40, 6, 4, 16, True, True, True, True),
])
def test_reference_backward_matches_autograd(nq, group, t, kd, vd, chunk, scalar_gate, h0, dht, strong):
    q, k, v, g, beta, do, s0, ds = _inputs(t + kd, nq, group, t, kd, vd, scalar_gate=scalar_gate, h0=h0, dht=dht,
                                           strong=strong)
    scale = kd ** -0.5
    f = torch.float64
    want = _autograd(q, k, v, g, beta, do, s0, ds, scale=scale, scalar_gate=scalar_gate)
    got = kda_bwd.reference_backward(q.to(f), k.to(f), v.to(f), g.to(f), beta.to(f), do, scale=scale,
                                     initial_state=s0, d_final_state=ds, scalar_gate=scalar_gate, chunk=chunk)
    assert all(x is None or x.dtype == f for x in got)
    _compare(got, want, 1e-9)


# ---------------------------------------------------------------------------------------------
# The kernels, in the interpreter (CPU)
# ---------------------------------------------------------------------------------------------

CASES = [
    # id, NQ, group, T, K, V, chunk, options
    ("gva2_state_dfinal", 1, 2, 37, 24, 40, 16, dict(h0=True, dht=True)),
    ("scalar_gate", 2, 1, 37, 24, 40, 16, dict(scalar_gate=True, h0=True, dht=False)),
    ("no_state_strong_gates", 1, 1, 37, 24, 40, 16, dict(h0=False, dht=False, strong=True)),
    ("chunk64_partial_strong", 1, 2, 37, 24, 40, 64, dict(h0=True, dht=True, strong=True)),
    ("chunk32_raw_k", 1, 1, 37, 24, 40, 32, dict(h0=False, dht=True, raw_k=True)),
    ("scalar_gate_gva_strong", 1, 2, 21, 16, 16, 16, dict(scalar_gate=True, h0=True, dht=True, strong=True)),
    # sub-blocks whose cumulative gate spans a little less than 30 (the diagonal through the
    # reference rows, factors up to ~e^30) next to ones that span more (pairwise): see below
    ("decay_near_30", 1, 2, 37, 24, 40, 16, dict(h0=True, dht=True, gscale=2.0)),
    # several chunks of 64 / 32, the last partial (every sub-block position of a full chunk)
    ("chunk64_two_chunks_gva", 1, 2, 100, 24, 40, 64, dict(h0=True, dht=True)),
    ("scalar_gate_chunk32_strong", 1, 1, 70, 24, 40, 32, dict(scalar_gate=True, h0=True, dht=True, strong=True)),
]


def test_decay_near_30_mixes_both_diagonal_paths():
    """The case decay_near_30 has 16-row sub-blocks on both sides of the span 30 at which the
    kernels' diagonal sub-blocks switch from the reference-row dots to the pairwise tile (per K
    block of 16, as kda_bwd_intra2 decides with the interpreter's BLOCK_K; reference row 16 b)."""
    case = next(c for c in CASES if c[0] == "decay_near_30")
    _, nq, group, t, kd, vd, chunk, opts = case
    g = _inputs(hash(case[0]) % 1000, nq, group, t, kd, vd, **opts)[3]
    spans = []
    for c0 in range(0, t, 16):
        cg = g[:, c0:c0 + 16].cumsum(1)
        for kb in range(0, kd, 16):
            blk = cg[..., kb:kb + 16]
            spans += torch.maximum((blk - blk[:, :1]).abs().amax(dim=(1, 2)),
                                   (blk - blk[:, -1:]).abs().amax(dim=(1, 2))).tolist()
    assert any(s <= 30 for s in spans) and any(s > 30 for s in spans), spans


def _run(q, k, v, g, beta, do, s0, ds, *, scalar_gate, chunk, **kw):
    with launch.poison_outputs():
        return kda_bwd.backward(q, k, v, g, beta, do, scale=q.shape[-1] ** -0.5, initial_state=s0, d_final_state=ds,
                                scalar_gate=scalar_gate, chunk=chunk, **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernels_float32(case):
    _, nq, group, t, kd, vd, chunk, opts = case
    scalar_gate = opts.get("scalar_gate", False)
    ins = _inputs(hash(case[0]) % 1000, nq, group, t, kd, vd, **opts)
    got = _run(*ins, scalar_gate=scalar_gate, chunk=chunk)
    assert all(x is None or (x.dtype == torch.float32 and x.device == ins[0].device) for x in got)
    want = _autograd(*ins, scale=kd ** -0.5, scalar_gate=scalar_gate)
    _compare(got, want, 1e-4)


def test_kernels_float16_mixed_dtypes_and_strides():
    """q, k, v, do in float16 with g, beta kept float32, q and v non-contiguous (K-major q, a slice
    of v): the kernels read the strides, compute in float32."""
    nq, group, t, kd, vd = 1, 2, 37, 24, 40
    q, k, v, g, beta, do, s0, ds = _inputs(7, nq, group, t, kd, vd)
    q, k, v, do = (x.half() for x in (q, k, v, do))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)          # strides (T·K, 1, T)
    v = torch.cat([v, v], dim=-1)[..., :vd]                      # row stride 2V
    assert not q.is_contiguous() and not v.is_contiguous()
    got = _run(q, k, v, g, beta, do, s0.half(), ds, scalar_gate=False, chunk=16)
    want = _autograd(q, k, v, g, beta, do, s0.half(), ds, scale=kd ** -0.5, scalar_gate=False)
    _compare(got, want, 1e-3)  # the inputs are the same fp16 values: only float32 compute error


@pytest.mark.parametrize("layout,scalar_gate,broadcast", [("bthf", False, False), ("bhtf", False, False),
                                                         ("three", False, False), ("bthf", True, True)],
                         ids=["bthf", "bhtf", "three", "bthf-scalar-broadcast"])
def test_lead_dim_inputs(layout, scalar_gate, broadcast):
    """q, k, v, g, beta and dO with lead dims (``_kernel_checks.kda_lead_layout``): [B, H, T, *]
    views of FLA's [B, T, H, *] (B = 2, two stride groups: read in place), [B, H, T, *], lead dims
    in three groups (copied); GQA (Hv = 2 Hq), a window from t0 = 3 of longer tensors, T = 37 in
    chunks of 16, K = 12, V = 10; with broadcast, g and beta shared by the heads (stride 0)."""
    views, flat = kda_lead_inputs(40, layout, t=37, scalar_gate=scalar_gate, broadcast=broadcast)
    lead_v = views[2].shape[:-2]
    gen = torch.Generator().manual_seed(41)
    do_flat = torch.randn(flat[2].shape[0], 40, 10, generator=gen)
    do = kda_lead_layout(do_flat, tuple(lead_v), layout, 3, 37)
    assert (kda_recurrent.input_rows(do, 2)[0] is do) == KDA_LEAD_LAYOUTS[layout]
    ds = torch.randn(flat[2].shape[0], 12, 10, generator=gen)
    with launch.poison_outputs():
        got = kda_bwd.backward(*views[:5], do, scale=0.3, initial_state=views[5], d_final_state=ds,
                               scalar_gate=scalar_gate, chunk=16)
    want = _autograd(*flat[:5], do.reshape(do_flat[:, 3:40].shape), flat[5], ds, scale=0.3, scalar_gate=scalar_gate)
    # broadcast g, beta: the launcher's dg, dbeta are per row ([N, T]), as for the flat copies
    _compare(got, want, 1e-4, f"{layout}: ")


OUT_CASES = [
    # id, layout of the inputs and the outs, group, scalar gate, h0, dtypes of (dq, dk, dv, dg, dbeta)
    ("bthf_fp32", "bthf", 1, False, True, (torch.float32,) * 5),          # dk4 in dk itself
    ("bthf_gva_fp32", "bthf", 2, False, True, (torch.float32,) * 5),      # dq, dk summed into out
    ("bthf_half_qkv", "bthf", 1, False, False, (torch.float16,) * 3 + (torch.float32,) * 2),  # dk4 scratch
    ("bhtf_scalar_gate", "bhtf", 1, True, False, (torch.float32,) * 5),
    ("three_fp32", "three", 1, False, True, (torch.float32,) * 5),        # every out through a temporary
    ("three_gva_scalar_half", "three", 2, True, True, (torch.float16,) * 5),
]


@pytest.mark.parametrize("case", OUT_CASES, ids=[c[0] for c in OUT_CASES])
def test_out_written_in_place(case):
    """``out=(dq, dk, dv, dg, dbeta)``: the gradients written into the caller's tensors, views in
    the layouts of ``_kernel_checks.kda_lead_layout`` (a window t0 = 3 of longer, NaN-poisoned
    tensors; "three": lead dims in three stride groups, written through a temporary and copied),
    in their own dtypes; ``backward`` returns them themselves; every element of them is written
    and matches autograd through the float64 recurrence; the memory around them (the rest of
    the time axis, padding) keeps its NaN. T = 37 in chunks of 16, K = 12, V = 10."""
    _, layout, group, scalar_gate, h0, dtypes = case
    views, flat = kda_lead_inputs(50, layout, t=37, group=group, scalar_gate=scalar_gate, h0=h0)
    lead_q, lead_v = tuple(views[0].shape[:-2]), tuple(views[2].shape[:-2])
    n, kd, vd = flat[2].shape[0], 12, 10
    gen = torch.Generator().manual_seed(51)
    do_flat = torch.randn(n, 40, vd, generator=gen)
    do = kda_lead_layout(do_flat, lead_v, layout, 3, 37)
    ds = torch.randn(n, kd, vd, generator=gen)
    feats = ((lead_q, kd), (lead_q, kd), (lead_v, vd), (lead_v, None if scalar_gate else kd), (lead_v, None))
    outs = []
    for (lead, feat), dtype in zip(feats, dtypes):
        rows = 1
        for d in lead:
            rows *= d
        nan = torch.full((rows, 42, *(() if feat is None else (feat,))), float("nan"), dtype=dtype)
        outs.append(kda_lead_layout(nan, lead, layout, 3, 37))
    bases = [x._base if x._base is not None else x for x in outs]
    with launch.poison_outputs():
        got = kda_bwd.backward(*views[:5], do, scale=0.3, initial_state=views[5], d_final_state=ds,
                               scalar_gate=scalar_gate, chunk=16, out=tuple(outs))
    assert all(a is b for a, b in zip(got[:5], outs))
    assert (got[5] is None) == (not h0)
    want = _autograd(*flat[:5], do.reshape(do_flat[:, 3:40].shape), flat[5], ds, scale=0.3, scalar_gate=scalar_gate)
    flat_got = [x.reshape(w.shape) for x, w in zip(got[:5], want[:5])] + [got[5]]
    tol = 1e-4 if all(d == torch.float32 for d in dtypes) else 2e-3
    _compare(flat_got, want, tol, f"{case[0]}: ")
    for name, x, base in zip(NAMES, outs, bases):
        written = torch.zeros(base.shape, dtype=torch.bool)
        written.as_strided(x.shape, x.stride(), x.storage_offset()).fill_(True)
        assert base[~written].isnan().all(), f"{case[0]}: {name} written outside out"


@pytest.mark.parametrize("change,match", [
    (dict(out=[torch.zeros(1, 5, 8)] * 4), "five tensors"),
    (dict(dq=torch.zeros(1, 6, 8)), r"out's dq must be \[1, 5, 8\]"),
    (dict(dv=torch.zeros(3, 5, 8)), r"out's dv must be .*prod\(lead\) = 2"),
    (dict(dg=torch.zeros(2, 5)), "out's dg must be"),
    (dict(dbeta=torch.zeros(2, 5, dtype=torch.float64)), "out's dbeta must be float32, float16 or bfloat16"),
    (dict(dk=torch.zeros(1, 5, 8, device="meta")), "out's dk is on meta"),
    (dict(dv=torch.zeros(1, 5, 8).expand(2, 5, 8)), "out's dv overlaps itself"),
    (dict(dq=[[0.0]]), "out's dq must be a torch.Tensor"),
])
def test_bad_out(change, match):
    args = [torch.zeros(1, 5, 8), torch.zeros(1, 5, 8), torch.zeros(2, 5, 8), torch.zeros(2, 5, 8),
            torch.zeros(2, 5), torch.zeros(2, 5, 8)]
    out = change.pop("out", None)
    if out is None:
        grads = dict(dq=torch.zeros(1, 5, 8), dk=torch.zeros(1, 5, 8), dv=torch.zeros(2, 5, 8),
                     dg=torch.zeros(2, 5, 8), dbeta=torch.zeros(2, 5))
        grads.update(change)
        out = tuple(grads.values())
    with pytest.raises(ValueError, match=match):
        kda_bwd.backward(*args, scale=1.0, chunk=16, out=out)


def test_out_with_no_tokens_is_zeroed():
    q, k, v, g, beta, do, s0, ds = _inputs(1, 1, 2, 0, 8, 8)
    outs = tuple(torch.empty(x.shape) for x in (q, k, v, g, beta))
    got = kda_bwd.backward(q, k, v, g, beta, do, scale=1.0, initial_state=s0, d_final_state=ds, chunk=16, out=outs)
    assert all(a is b for a, b in zip(got[:5], outs))
    # K = 0: nothing to compute; every gradient is 0, written into out
    q, k, v, g, beta, do, s0, ds = _inputs(2, 1, 1, 5, 0, 4)
    outs = tuple(torch.full(x.shape, float("nan")) for x in (q, k, v, g, beta))
    got = kda_bwd.backward(q, k, v, g, beta, do, scale=1.0, chunk=16, out=outs)
    assert all(a is b and (a == 0).all() for a, b in zip(got[:5], outs))


def test_bfloat16_scratch():
    """``config={"scratch": "bfloat16"}`` (the GPU default for 16-bit inputs): W, KG, QG and the
    chunk states held in bfloat16, on float32 inputs here; gates near -30."""
    nq, group, t, kd, vd = 1, 2, 37, 24, 40
    ins = _inputs(13, nq, group, t, kd, vd, strong=True)
    got = _run(*ins, scalar_gate=False, chunk=16, config={"scratch": "bfloat16"})
    want = _autograd(*ins, scale=kd ** -0.5, scalar_gate=False)
    _compare(got, want, 1e-2)


def test_saved_chunk_states_skip_the_recompute():
    """``saved={"chunk_states": S}`` (the state before each chunk, from the float64 chunked forward
    here) gives the same gradients as the recompute."""
    nq, group, t, kd, vd, chunk = 1, 1, 37, 24, 40, 16
    q, k, v, g, beta, do, s0, ds = _inputs(11, nq, group, t, kd, vd)
    states = []
    st = s0.double()
    for c0 in range(0, t, chunk):
        states.append(st)
        sl = slice(c0, min(c0 + chunk, t))
        _, st = kda_reference.chunked(q[:, sl].transpose(0, 1)[None], k[:, sl].transpose(0, 1)[None],
                                      v[:, sl].transpose(0, 1)[None], g[:, sl].transpose(0, 1)[None],
                                      beta[:, sl].transpose(0, 1)[None], scale=kd ** -0.5, initial_state=st[None],
                                      output_final_state=True, chunk=chunk)
        st = st[0]
    saved = {"chunk_states": torch.stack(states, 1).float()}
    got = _run(q, k, v, g, beta, do, s0, ds, scalar_gate=False, chunk=chunk, saved=saved)
    want = _autograd(q, k, v, g, beta, do, s0, ds, scale=kd ** -0.5, scalar_gate=False)
    _compare(got, want, 1e-4)


def _forward_saved(q, k, v, g, beta, s0, *, scalar_gate, chunk, **kw):
    """The chunked forward's ``saved`` dict (``save_for_backward=True``), its outputs poisoned first."""
    with launch.poison_outputs():
        return kda_chunk.forward(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=s0, output_final_state=True,
                                 scalar_gate=scalar_gate, chunk=chunk, save_for_backward=True, **kw)[2]


SAVED_CASES = ["gva2_state_dfinal", "scalar_gate_gva_strong", "chunk64_partial_strong", "decay_near_30",
               "scalar_gate_chunk32_strong"]


@pytest.mark.parametrize("prep", kda_chunk.PREP_VARIANTS)
@pytest.mark.parametrize("case", SAVED_CASES)
def test_saved_forward_workspaces_skip_the_recompute(case, prep):
    """``saved`` = the chunked forward's dict (either kernel-1 variant: each writes G, X and A_kk
    for it): kda_bwd_prep's recomputation is replaced by the forward's workspaces, with and without
    its chunk states; the gradients still match autograd through the float64 recurrence (ragged T,
    grouped heads, strong gates on both diagonal paths, scalar gates)."""
    _, nq, group, t, kd, vd, chunk, opts = next(c for c in CASES if c[0] == case)
    scalar_gate = opts.get("scalar_gate", False)
    ins = _inputs(hash(case) % 1000, nq, group, t, kd, vd, **opts)
    q, k, v, g, beta, do, s0, ds = ins
    saved = _forward_saved(q, k, v, g, beta, s0, scalar_gate=scalar_gate, chunk=chunk, config={"prep": prep})
    assert set(kda_bwd.WORKSPACE_KEYS) <= set(saved)
    want = _autograd(*ins, scale=kd ** -0.5, scalar_gate=scalar_gate)
    _compare(_run(*ins, scalar_gate=scalar_gate, chunk=chunk, saved=saved), want, 1e-4, "with states: ")
    without = {key: x for key, x in saved.items() if key != "states"}
    _compare(_run(*ins, scalar_gate=scalar_gate, chunk=chunk, saved=without), want, 1e-4, "without states: ")


def _saved_small():
    q, k, v, g, beta, do, s0, ds = _inputs(2, 1, 2, 21, 8, 8)
    return (q, k, v, g, beta, do), _forward_saved(q, k, v, g, beta, None, scalar_gate=False, chunk=16)


@pytest.mark.parametrize("change,match", [
    (lambda s: s.pop("xm"), r"not \['xm'\]"),
    (lambda s: s.update(w=s["w"][:, :-1]), r"saved\['w'\] must be a tensor of shape"),
    (lambda s: s.update(a_kk=s["a_kk"].double()), r"saved\['a_kk'\] must be a float32"),
    (lambda s: s.update(u=s["u"].transpose(1, 2).contiguous().transpose(1, 2)), r"saved\['u'\] must be contiguous"),
    (lambda s: s.update(chunk=32), "chunk=32"),
    (lambda s: s.update(chunk_states=s["states"]), "both 'chunk_states' and 'states'"),
])
def test_bad_saved_workspaces(change, match):
    (q, k, v, g, beta, do), saved = _saved_small()
    change(saved)
    with pytest.raises(ValueError, match=match):
        kda_bwd.backward(q, k, v, g, beta, do, scale=1.0, chunk=16, saved=saved)


def test_per_kernel_config_keys():
    """prep, intra1 and intra2 each take their own BLOCK_K / BLOCK_V / num_warps / num_stages
    (``BLOCK_K_intra2``, ...); a shared key given alone sets all three, as before those keys."""
    cpu = torch.device("cpu")
    cfg = kda_bwd._config({"num_warps": 2, "BLOCK_K_intra2": 32}, cpu)
    assert [cfg[f"num_warps_{k}"] for k in kda_bwd.PARALLEL] == [2, 2, 2]
    assert (cfg["BLOCK_K_prep"], cfg["BLOCK_K_intra1"], cfg["BLOCK_K_intra2"]) == (16, 16, 32)
    with pytest.raises(ValueError, match="power of two"):
        kda_bwd._config({"BLOCK_V_prep": 24}, cpu)
    with pytest.raises(ValueError, match="num_stages_intra1"):
        kda_bwd._config({"num_stages_intra1": 0}, cpu)
    nq, group, t, kd, vd, chunk = 1, 2, 37, 24, 40, 16
    ins = _inputs(19, nq, group, t, kd, vd)
    got = _run(*ins, scalar_gate=False, chunk=chunk, config={"BLOCK_K_intra2": 32, "BLOCK_V_intra1": 32,
                                                             "BLOCK_K_prep": 32, "BLOCK_V_intra2": 64})
    want = _autograd(*ins, scale=kd ** -0.5, scalar_gate=False)
    _compare(got, want, 1e-4)


@pytest.mark.parametrize("scalar_gate", [False, True])
def test_unfused_sequential_passes(scalar_gate):
    """``fuse_sequential=False``: kda_bwd_states and kda_bwd_dstates as two launches (the default
    runs them as one, kda_bwd_seq), the same gradients."""
    nq, group, t, kd, vd, chunk = 1, 2, 37, 24, 40, 16
    ins = _inputs(23, nq, group, t, kd, vd, scalar_gate=scalar_gate)
    got = _run(*ins, scalar_gate=scalar_gate, chunk=chunk, config={"fuse_sequential": False})
    want = _autograd(*ins, scale=kd ** -0.5, scalar_gate=scalar_gate)
    _compare(got, want, 1e-4)


def test_empty_sequence():
    q, k, v, g, beta, do, s0, ds = _inputs(1, 1, 1, 0, 8, 8)
    dq, dk, dv, dg, dbeta, dh0 = _run(q, k, v, g, beta, do, s0, ds, scalar_gate=False, chunk=16)
    assert dq.shape == (1, 0, 8) and dg.shape == (1, 0, 8) and dbeta.shape == (1, 0)
    torch.testing.assert_close(dh0, ds)  # T = 0: the final state is the initial state


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(2, 5, 8)), "q and k"),
    (dict(v=torch.zeros(2, 6, 8)), "v must be"),
    (dict(g=torch.zeros(2, 5)), "g must be"),
    (dict(beta=torch.zeros(2, 5, 1)), "beta must be"),
    (dict(do=torch.zeros(2, 5, 4)), "do"),
    (dict(initial_state=torch.zeros(2, 8, 4)), "initial_state must be"),
    (dict(d_final_state=torch.zeros(2, 4, 8)), "d_final_state must be"),
    (dict(v=torch.zeros(2, 5, 8, dtype=torch.float64)), "float32, float16 or bfloat16"),
    (dict(chunk=24), "chunk must be one of"),
    (dict(config={"BLOCK_K": 24}), "power of two"),
    (dict(config={"BLOCK_Q": 16}), "unknown KDA backward config"),
    (dict(config={"num_stages": 0}), "num_stages"),
    (dict(config={"scratch": "float16"}), "scratch"),
    (dict(config={"fuse_sequential": 1}), "fuse_sequential"),
    (dict(saved={"chunk_states": torch.zeros(2, 2, 8, 8)}), "chunk_states"),
    (dict(saved={"state": None}), "unknown keys"),
])
def test_bad_inputs(change, match):
    args = dict(q=torch.zeros(1, 5, 8), k=torch.zeros(1, 5, 8), v=torch.zeros(2, 5, 8), g=torch.zeros(2, 5, 8),
                beta=torch.zeros(2, 5), do=torch.zeros(2, 5, 8), initial_state=None, d_final_state=None, chunk=16)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        kda_bwd.backward(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"),
                         args.pop("do"), scale=1.0, **args)


def test_rendered_variants():
    for sg in (False, True):
        kernel = kda_bwd.bwd_kernel(scalar_gate=sg, interpret=False)
        assert kernel.name == "kda_bwd" + ("_scalar" if sg else "")
        for fn in ("kda_bwd_prep", "kda_bwd_prep_saved", "kda_bwd_states", "kda_bwd_dstates", "kda_bwd_seq",
                   "kda_bwd_intra1", "kda_bwd_intra2"):
            assert f"def {fn}(" in kernel.source
    for dev in ("sm90", "cuda"):
        for cfg in kda_bwd._TABLE[dev]:
            launch.check_config(cfg)


# ---------------------------------------------------------------------------------------------
# GPU (bfloat16)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("scalar_gate", [False, True])
@pytest.mark.parametrize("chunk", [64, 32])
def test_gpu_bfloat16(scalar_gate, chunk):
    nq, group, t, kd, vd = 2, 2, 301, 128, 96
    ins = _inputs(5, nq, group, t, kd, vd, scalar_gate=scalar_gate, strong=True, device="cuda")
    q, k, v, g, beta, do, s0, ds = ins
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    got = _run(q, k, v, g, beta, do, s0, ds, scalar_gate=scalar_gate, chunk=chunk)
    want = _autograd(*(None if x is None else x.cpu() for x in (q, k, v, g, beta, do, s0, ds)), scale=kd ** -0.5,
                     scalar_gate=scalar_gate)
    _compare([None if x is None else x.cpu() for x in got], want, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("prep,dots,scalar_gate", [("pairs", "float32", False), ("strips", "float32", False),
                                                   ("pairs", "bfloat16", False), ("strips", "bfloat16", False),
                                                   ("strips", "float32", True), ("pairs", "bfloat16", True)])
def test_gpu_saved_forward_workspaces(prep, dots, scalar_gate):
    """The backward on the chunked forward's workspaces (both kernel-1 variants, both dots dtypes:
    with bfloat16 dots W, U, Kd, Qg, A_qk arrive in bfloat16) against autograd in float64, strong
    gates, ragged T, grouped heads, bf16 inputs."""
    nq, group, t, kd, vd = 2, 2, 301, 128, 96
    ins = _inputs(5, nq, group, t, kd, vd, scalar_gate=scalar_gate, strong=True, device="cuda")
    q, k, v, g, beta, do, s0, ds = ins
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    config = {"prep": prep, **({"BLOCK_K1": 32} if prep == "strips" and dots == "bfloat16" else {})}
    saved = _forward_saved(q, k, v, g, beta, s0, scalar_gate=scalar_gate, chunk=64, dots=dots, config=config)
    got = _run(q, k, v, g, beta, do, s0, ds, scalar_gate=scalar_gate, chunk=64, saved=saved)
    want = _autograd(*(None if x is None else x.cpu() for x in (q, k, v, g, beta, do, s0, ds)), scale=kd ** -0.5,
                     scalar_gate=scalar_gate)
    _compare([None if x is None else x.cpu() for x in got], want, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kd,vd,config", [
    (256, 64, None),                                             # K > 128: the unfused passes, 8 warps
    (64, 96, {"fuse_sequential": False, "BLOCK_K_intra2": 64, "num_warps_intra2": 8, "BLOCK_V_intra1": 64}),
    (128, 128, {"BLOCK_VS": 32, "num_warps_state": 8}),          # fused, one program per SM
])
def test_gpu_configs(kd, vd, config):
    nq, group, t = 1, 2, 301
    ins = _inputs(29, nq, group, t, kd, vd, strong=True, device="cuda")
    q, k, v, g, beta, do, s0, ds = ins
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    got = _run(q, k, v, g, beta, do, s0, ds, scalar_gate=False, chunk=64, config=config)
    want = _autograd(*(None if x is None else x.cpu() for x in (q, k, v, g, beta, do, s0, ds)), scale=kd ** -0.5,
                     scalar_gate=False)
    _compare([None if x is None else x.cpu() for x in got], want, 2e-2)


@pytest.mark.gpu
def test_gpu_new_length_does_not_recompile():
    from _kernel_checks import compiled_keys

    ins = _inputs(3, 1, 1, 100, 64, 64, device="cuda")
    _run(*ins, scalar_gate=False, chunk=64)
    _, mod = kda_bwd._module(False, False)
    fns = [getattr(mod, name) for name in ("kda_bwd_prep", "kda_bwd_seq", "kda_bwd_intra1", "kda_bwd_intra2")]
    before = [compiled_keys(fn) for fn in fns]
    ins = _inputs(3, 1, 1, 171, 64, 64, device="cuda")
    _run(*ins, scalar_gate=False, chunk=64)
    assert [compiled_keys(fn) for fn in fns] == before


@pytest.mark.gpu
@pytest.mark.parametrize("scratch", ["auto", "float32"])
def test_gpu_benchmark_shape(scratch, capsys):
    """The comparison shape of the brief (B=1, T=4096, H=16, K=V=128, chunk 64, bf16): the
    gradients against the float64 reference_backward (itself checked against autograd above), and
    the backward's time printed (``pytest -s``; FLA's chunk_kda fwd+bwd is 2.92 ms on an H100)."""
    import triton.testing

    nq, t, kd, vd = 16, 4096, 128, 128
    q, k, v, g, beta, do, s0, ds = _inputs(17, nq, 1, t, kd, vd, device="cuda")
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    kw = dict(scale=kd ** -0.5, initial_state=s0, d_final_state=ds, chunk=64, config={"scratch": scratch})
    got = kda_bwd.backward(q, k, v, g, beta, do, **kw)
    want = kda_bwd.reference_backward(q, k, v, g, beta, do, scale=kd ** -0.5, initial_state=s0, d_final_state=ds,
                                      chunk=64)
    _compare(got, want, 2e-2)
    ms = triton.testing.do_bench(lambda: kda_bwd.backward(q, k, v, g, beta, do, **kw), warmup=10, rep=50)
    with capsys.disabled():
        print(f"\nKDA backward B=1 T=4096 H=16 K=V=128 bf16 scratch={scratch}: {ms:.3f} ms")
