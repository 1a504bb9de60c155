"""NaN propagation of the attention-KL, H2O and KDA kernels against eager PyTorch in float64.

Eager PyTorch is the oracle: a NaN (or an inf that eager turns into NaN) reaching the scores or
the gates must give NaN exactly where eager's float64 ops give NaN, forward and backward. Each
case places the NaN where a NaN-dropping construct of the kernels meets it (a ``p > 0`` guard
that is False for NaN, tile skipping that never reads a NaN row's weights), and compares the NaN
entries (and the finite rest, within tolerance) with eager ops written here: the float64
references in patterns/ guard empty rows and are not the NaN oracle. The documented deviation
(a softmax row with no visible key gives 0, not NaN) is not exercised.

On CPU the kernels run in Triton's interpreter; the ``gpu`` parametrization runs the same small
cases compiled.
"""

from __future__ import annotations

import math

import pytest
from _kernel_checks import rel_err
import torch
import torch.nn.functional as F

from fuser.codegen import attention_kl, h2o, kda_bwd, launch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FMIN = torch.finfo(torch.float32).min
NAN = math.nan


def _same_nans(got, want, what):
    assert torch.equal(got.isnan(), want.isnan()), (
        f"{what}: NaN entries differ from eager: eager NaN, kernel not: {(want.isnan() & ~got.isnan()).sum().item()}; "
        f"kernel NaN, eager not: {(got.isnan() & ~want.isnan()).sum().item()}")
    ok = ~want.isnan()
    if ok.any():
        assert rel_err(got[ok].double(), want[ok].double()) < 1e-3, what


# ---------------------------------------------------------------------------------------------
# Attention-KL: KL(softmax(S1) || softmax(S2)) per row, eager as F.kl_div(log_target=True)
# ---------------------------------------------------------------------------------------------


def _kl_eager(q1, k1, q2, k2, *, scale1, scale2, causal="none", mask=None, mask_kind="none",
              mask_fill1=-math.inf, mask_fill2=-math.inf, causal_fill1=-math.inf, causal_fill2=-math.inf,
              causal_fill_mode="replace", zero_hidden=False):
    """The eager graph the pattern matches: fills by torch.where (replace) or added, then
    F.kl_div(log_softmax(S2), log_softmax(S1), log_target=True, reduction="none").sum(-1)
    (hidden terms zeroed by masked_fill first with zero_hidden)."""
    s1 = (q1 @ k1.mT) * scale1
    s2 = (q2 @ k2.mT) * scale2
    n_q, n_k = s1.shape[-2:]
    i = torch.arange(n_q, device=s1.device)[:, None]
    j = torch.arange(n_k, device=s1.device)[None, :]
    hidden = torch.zeros(n_q, n_k, dtype=torch.bool, device=s1.device)
    if mask_kind == "additive":
        s1, s2 = s1 + mask.double(), s2 + mask.double()
    elif mask_kind in ("bool_keep", "bool_drop"):
        hid = ~mask if mask_kind == "bool_keep" else mask
        s1, s2 = torch.where(hid, mask_fill1, s1), torch.where(hid, mask_fill2, s2)
        hidden = hidden | hid
    if causal != "none":
        above = j > i + (0 if causal == "top_left" else n_k - n_q)
        hidden = hidden | above
        if causal_fill_mode == "replace":
            s1, s2 = torch.where(above, causal_fill1, s1), torch.where(above, causal_fill2, s2)
        else:
            s1, s2 = torch.where(above, s1 + causal_fill1, s1), torch.where(above, s2 + causal_fill2, s2)
    term = F.kl_div(F.log_softmax(s2, -1), F.log_softmax(s1, -1), log_target=True, reduction="none")
    if zero_hidden:
        term = term.masked_fill(hidden, 0)
    return term.sum(-1)


def _kl_case(name):
    """(q1, k1, q2, k2, kwargs): one NaN (or +inf) that reaches the scores. In the backward a NaN
    row's P (NaN statistics) met the guard ``p1 > 0`` (False for NaN: dS1 = 0 instead of NaN),
    where p1 underflowed to 0 beside the row's NaN (eager: 0 * NaN = NaN), and hidden entries of
    a NaN row (-inf - NaN) gave NaN where eager's where/masked_fill passes no gradient."""
    b, h, n_q, n_k, d = 1, 2, 21, 37, 16
    gen = torch.Generator().manual_seed(7)
    q1, k1, q2, k2 = (torch.randn(b, h, n, d, generator=gen) for n in (n_q, n_k, n_q, n_k))
    keep = torch.ones(1, 1, n_q, n_k, dtype=torch.bool)
    keep[..., 30:] = False
    keep[..., 2, :] = False  # a row all hidden: uniform over the fills, finite
    bias = torch.zeros(1, 1, n_q, n_k)
    bias[..., 30:] = FMIN  # finite: eager's kl_div stays finite there
    if name == "plain_q1":  # no mask: the ragged key tile's guard
        q1[0, 1, 5, 3] = NAN
        return q1, k1, q2, k2, {}
    if name == "bool_fill_q1":
        q1[0, 1, 5, 3] = NAN
        return q1, k1, q2, k2, dict(mask=keep, mask_kind="bool_keep", mask_fill1=FMIN, mask_fill2=FMIN)
    if name == "bool_fill_zero_hidden_k1":
        k1[0, 1, 9, 3] = NAN
        return q1, k1, q2, k2, dict(mask=keep, mask_kind="bool_keep", mask_fill1=FMIN, mask_fill2=FMIN,
                                    zero_hidden=True)
    if name == "causal_add_k2":  # the student's NaN key column: every row NaN on side 2
        k2[0, 1, 9, 3] = NAN
        return q1, k1, q2, k2, dict(causal="top_left", causal_fill1=FMIN, causal_fill2=FMIN, causal_fill_mode="add")
    if name == "causal_add_zero_hidden_q2":
        q2[0, 1, 5, 3] = NAN
        return q1, k1, q2, k2, dict(causal="top_left", causal_fill1=-1e4, causal_fill2=-1e4, causal_fill_mode="add",
                                    zero_hidden=True)
    if name == "additive_mask_nan":
        bias[0, 0, 4, 7] = NAN
        return q1, k1, q2, k2, dict(mask=bias, mask_kind="additive")
    if name == "additive_mask_inf":  # +inf: eager's softmax row is NaN (inf - inf)
        bias[0, 0, 4, 7] = math.inf
        return q1, k1, q2, k2, dict(mask=bias, mask_kind="additive")
    raise KeyError(name)


KL_CASES = ["plain_q1", "bool_fill_q1", "bool_fill_zero_hidden_k1", "causal_add_k2", "causal_add_zero_hidden_q2",
            "additive_mask_nan", "additive_mask_inf"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", KL_CASES)
def test_attention_kl_nan_is_nan_where_eager_is(name, device):
    q1, k1, q2, k2, extra = _kl_case(name)
    q1, k1, q2, k2 = (t.to(device) for t in (q1, k1, q2, k2))
    if "mask" in extra:
        extra["mask"] = extra["mask"].to(device)
    kw = dict(scale1=16 ** -0.5, scale2=16 ** -0.5, **extra)
    leaves = [t.detach().double().requires_grad_() for t in (q1, k1, q2, k2)]
    want = _kl_eager(*leaves, **kw)
    assert want.isnan().any()
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(device)
    want_grads = torch.autograd.grad((want * g.double()).sum(), leaves)
    for split_k in (1, 3):
        with launch.poison_outputs():
            rows, lse1, lse2, delta = attention_kl.forward(q1, k1, q2, k2, split_k=split_k, **kw)
        _same_nans(rows, want.detach(), f"{name}: rows (split_k={split_k})")
    for mode in ("two_kernel", "atomic_dq"):
        with launch.poison_outputs():
            got = attention_kl.backward(g, q1, k1, q2, k2, lse1, lse2, delta, bwd_mode=mode, **kw)
        for what, a, b in zip(("dq1", "dk1", "dq2", "dk2"), got, want_grads):
            _same_nans(a, b, f"{name}: {what} ({mode})")


# ---------------------------------------------------------------------------------------------
# H2O: column sums of softmax(S); a NaN row is NaN at every key, hidden ones included
# ---------------------------------------------------------------------------------------------


def _h2o_eager(q, k, v, *, scale, causal="none", mask=None, mask_kind="none", causal_fill=-math.inf,
               causal_fill_mode="replace"):
    group = q.shape[1] // k.shape[1]
    s = scale * q.double() @ k.double().repeat_interleave(group, 1).mT
    if mask_kind == "additive":
        s = s + mask.double()
    n_q, n_k = s.shape[-2:]
    if causal != "none":
        off = n_k - n_q if causal == "bottom_right" else 0
        above = torch.arange(n_k, device=s.device)[None, :] > torch.arange(n_q, device=s.device)[:, None] + off
        if causal_fill_mode == "replace":
            s = s.masked_fill(above, causal_fill)
        else:
            s = s + torch.where(above, causal_fill, 0.0).double()
    p = torch.softmax(s, -1)
    return p @ v.double().repeat_interleave(group, 1), p.sum(-2)


H2O_PLANS = [("two_kernel", dict(plan="two_kernel")), ("one_kernel", dict(plan="one_kernel")),
             ("diag_balanced_K2", dict(plan="diag_cache", diagonals=2, cache="balanced")),
             ("diag_causal_K1", dict(plan="diag_cache", diagonals=1, cache="causal"))]
H2O_CASES = [
    # id, causal, NaN place, causal fill, mode
    ("top_left_q_row", "top_left", "q", -math.inf, "replace"),
    ("bottom_right_q_row", "bottom_right", "q", -math.inf, "replace"),
    ("top_left_additive_nan", "top_left", "mask", -math.inf, "replace"),
    ("top_left_fill_add_q_row", "top_left", "q", FMIN, "add"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan", H2O_PLANS, ids=[p[0] for p in H2O_PLANS])
@pytest.mark.parametrize("case", H2O_CASES, ids=[c[0] for c in H2O_CASES])
def test_h2o_nan_row_is_nan_in_every_column(case, plan, device):
    """An early row's NaN (q row 2, or a NaN entry of an additive mask in it) makes every column
    sum of its (batch, head) NaN in eager; the causal loops skip the key tiles past the row's
    block, whose columns still get its NaN (before: only the visited columns did)."""
    _, causal, where, fill, mode = case
    _, plan_kw = plan
    if fill != -math.inf and plan_kw["plan"] != "two_kernel":
        pytest.skip("a finite causal fill runs with two_kernel only")
    n = 45
    gen = torch.Generator().manual_seed(71)
    q, k, v = (torch.randn(1, hh, n, d, generator=gen) for hh, d in ((2, 16), (1, 16), (1, 24)))
    kw = dict(scale=0.25, causal=causal, causal_fill=fill, causal_fill_mode=mode)
    if where == "q":
        q[0, 1, 2, 3] = NAN
    else:
        bias = torch.zeros(1, 2, n, n)
        bias[0, 0, 2, 1] = NAN
        kw.update(mask=bias, mask_kind="additive")
    want_out, want = _h2o_eager(q, k, v, **kw)
    head = 1 if where == "q" else 0  # the NaN row's head: every column NaN, the other head finite
    assert want[0, head].isnan().all() and not want[0, 1 - head].isnan().any()
    q, k, v = (t.to(device) for t in (q, k, v))
    if "mask" in kw:
        kw["mask"] = kw["mask"].to(device)
    for need_out in (True, False) if plan_kw["plan"] == "two_kernel" else (True,):
        h2o.clear_workspaces()
        with launch.poison_outputs():
            out, score = h2o.forward(q, k, v, need_out=need_out, **plan_kw, **kw)
        _same_nans(score.cpu(), want, f"score (need_out={need_out})")
        if need_out:
            _same_nans(out.cpu(), want_out, "out")


# ---------------------------------------------------------------------------------------------
# KDA backward: no NaN-dropping site was found (its gate clamps, tl.minimum(x, 30) and the span
# tests, drop a NaN only where the same NaN enters the product through another factor); a NaN
# input's gradients are NaN at least wherever eager's are (the chunked form may spread a NaN over its
# chunk, a documented deviation: this test checks the one direction)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["g", "v", "beta"])
def test_kda_backward_keeps_every_nan_of_eager(where, device):
    from fuser.patterns import kda_reference

    gen = torch.Generator().manual_seed(5)
    n, t, kd, vd = 2, 37, 24, 20
    q = torch.randn(1, t, kd, generator=gen)
    k = F.normalize(torch.randn(1, t, kd, generator=gen), dim=-1)
    v = torch.randn(n, t, vd, generator=gen)
    g = -F.softplus(torch.randn(n, t, kd, generator=gen))
    beta = torch.rand(n, t, generator=gen)
    do = torch.randn(n, t, vd, generator=gen)
    s0 = torch.randn(n, kd, vd, generator=gen)
    ds = torch.randn(n, kd, vd, generator=gen)
    if where == "beta":
        beta[1, 21] = NAN
    else:
        dict(g=g, v=v)[where][1, 21, 3] = NAN
    leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta, s0)]
    lq, lk, lv, lg, lb, ls0 = leaves
    o, s = kda_reference.recurrent(lq.transpose(0, 1)[None], lk.transpose(0, 1)[None], lv.transpose(0, 1)[None],
                                   lg.transpose(0, 1)[None], lb.t()[None], scale=0.5, initial_state=ls0[None],
                                   output_final_state=True)
    loss = (o[0].transpose(0, 1) * do.double()).sum() + (s[0] * ds.double()).sum()
    want = torch.autograd.grad(loss, leaves)
    args = [x.to(device) for x in (q, k, v, g, beta, do)]
    with launch.poison_outputs():
        got = kda_bwd.backward(*args, scale=0.5, initial_state=s0.to(device), d_final_state=ds.to(device), chunk=16)
    assert any(b.isnan().any() for b in want)
    for what, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        lost = b.isnan() & ~a.cpu().isnan()
        assert not lost.any(), f"{where}: {what}: {lost.sum().item()} entries NaN in eager, finite in the kernel"
