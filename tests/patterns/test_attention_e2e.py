"""End to end through ``torch.compile(backend="fuser")``: outputs and gradients against a
float64 reference / eager, training and inference, static and dynamic shapes, real models.

On the CPU the fused kernels run in Triton's interpreter; sizes are small and ragged."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser import testing
from fuser.report import collecting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(shape_q, shape_kv, dtype=torch.float32, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g).to(dtype).requires_grad_(requires_grad)
    k = torch.randn(*shape_kv, generator=g).to(dtype).requires_grad_(requires_grad)
    v = torch.randn(*shape_kv, generator=g).to(dtype).requires_grad_(requires_grad)
    return q, k, v


def _check(fn, args, dtype=torch.float32, tol=None, expect_fused=1):
    """fn compiled with fuser vs fn in float64 eager: forward and gradients."""
    tol = tol or (1e-4 if dtype == torch.float32 else 2e-2)
    torch._dynamo.reset()
    with collecting() as rep:
        out = torch.compile(fn, backend="fuser")(*args)
    assert len(rep.fused) == expect_fused, str(rep)
    ref_args = [a.detach().double().requires_grad_(a.requires_grad) if torch.is_tensor(a) and a.is_floating_point() else a
                for a in args]
    ref = fn(*ref_args)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < tol
    grad = torch.randn_like(ref)
    diff = [a for a in args if torch.is_tensor(a) and a.requires_grad]
    if not diff:
        return rep
    got = torch.autograd.grad(out, diff, grad.to(out.dtype))
    want = torch.autograd.grad(ref, [a for a in ref_args if torch.is_tensor(a) and a.requires_grad], grad)
    for g1, g2 in zip(got, want):
        assert not torch.isnan(g1).any()
        assert _rel(g1, g2) < tol * 3
    return rep


def causal_attn(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    n_q, n_k = s.shape[-2:]
    hide = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(hide, float("-inf")), dim=-1) @ v


def plain_attn(q, k, v):
    return F.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3, dim=-1) @ v


@pytest.mark.parametrize("fn", [causal_attn, plain_attn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_matches_reference(fn, dtype):
    q, k, v = _inputs((2, 3, 37, 24), (2, 3, 37, 24), dtype)
    _check(fn, (q, k, v), dtype)


def test_bottom_right_causal_nq_lt_nk():
    def f(q, k, v):
        s = q @ k.mT * 0.2
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2])
        return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v

    q, k, v = _inputs((1, 2, 19, 16), (1, 2, 45, 16))
    rep = _check(f, (q, k, v))
    assert rep.fused[0].summary["causal"] == "bottom_right"


def test_padding_mask_with_a_fully_masked_batch_row():
    q, k, v = _inputs((2, 2, 21, 16), (2, 2, 21, 16))
    keep = torch.rand(2, 1, 1, 21) > 0.3
    keep[1] = False  # batch row 1: no visible key at all -> 0, not NaN

    def f(q, k, v, keep):
        return torch.softmax((q @ k.mT).masked_fill(~keep, float("-inf")), -1) @ v

    torch._dynamo.reset()
    out = torch.compile(f, backend="fuser")(q, k, v, keep)
    assert not torch.isnan(out).any() and torch.all(out[1] == 0)
    ref = f(q.double(), k.double(), v.double(), keep)
    assert _rel(out[0], ref[0]) < 1e-4
    g = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(not torch.isnan(x).any() for x in g)


def test_gqa_bias_and_bnhd_layout():
    b, n, hq, hkv, d = 2, 33, 4, 2, 16
    x = torch.randn(b, n, (hq + 2 * hkv) * d, requires_grad=True)
    bias = torch.randn(1, hq, n, n)

    def f(x, bias):
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(b, n, hq, d).transpose(1, 2)
        k = k.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        v = v.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        o = torch.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, dim=-1) @ v
        return o.transpose(1, 2).reshape(b, n, hq * d)

    rep = _check(f, (x, bias))
    assert rep.fused[0].summary["gqa_group"] == 2


def test_inference_stores_no_lse_and_dynamic_shapes_do_not_recompile():
    torch._dynamo.reset()
    counts = {"graphs": 0}

    def f(q, k, v):
        return causal_attn(q, k, v)

    with torch.no_grad():
        _, result = testing.fuse(f, *_inputs((1, 2, 16, 16), (1, 2, 16, 16), requires_grad=False))
        assert result.matches[0].bindings["need_lse"] is False
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="fuser", dynamic=True)
        from torch._dynamo.utils import counters

        counters.clear()
        for n in (17, 23, 40):  # not 16 = D: duck sizing would tie N to D
            q, k, v = _inputs((1, 2, n, 16), (1, 2, n, 16), requires_grad=False)
            out = compiled(q, k, v)
            assert _rel(out, causal_attn(q.double(), k.double(), v.double())) < 1e-4
        counts["graphs"] = counters["stats"]["unique_graphs"]
    assert counts["graphs"] == 1


def test_explain_report_lists_kernels_and_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_DEBUG_DIR", str(tmp_path))
    q, k, v = _inputs((1, 2, 16, 16), (1, 2, 16, 16))

    def f(q, k, v):
        p = torch.softmax(q @ k.mT, -1)
        return causal_attn(q, k, v), p @ v, p  # second attention returns its weights

    rep = fuser.explain(f, q, k, v)
    assert len(rep.fused) == 1 and len(rep.rejected) == 1
    assert "also used outside" in rep.rejected[0].reason
    text = str(rep)
    assert "attention" in text and "causal=top_left" in text and "not fused (1)" in text
    assert rep.kernels and all(os.path.exists(kk.path) for kk in rep.kernels)
    assert all("@triton.jit" in kk.source for kk in rep.kernels)
    assert {os.path.basename(kk.path) for kk in rep.kernels} <= set(os.listdir(tmp_path))


def test_unknown_option_is_a_clear_error():
    q, k, v = _inputs((1, 1, 8, 16), (1, 1, 8, 16))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown fuser option 'fuser.autotun'"):
        torch.compile(plain_attn, backend="fuser", options={"fuser.autotun": True})(q, k, v)


def test_forced_atomic_dq_backward():
    q, k, v = _inputs((1, 2, 29, 16), (1, 2, 29, 16))
    torch._dynamo.reset()
    f = torch.compile(causal_attn, backend="fuser", options={"fuser.plan": "attention.backward=atomic_dq"})
    out = f(q, k, v)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = causal_attn(*ref_in)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g.float()), torch.autograd.grad(ref, ref_in, g)):
        assert _rel(a, b) < 3e-4


def test_example_model_trains_like_eager():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq=32)
    idx = torch.randint(0, 64, (2, 24))
    rep = fuser.explain(model, idx)
    assert len(rep.fused) == 2 and all(m.summary["gqa_group"] == 2 and m.summary["causal"] == "top_left" for m in rep.fused)
    compiled = torch.compile(model, backend="fuser")
    out_f = compiled(idx)
    gf = torch.autograd.grad(out_f.square().mean(), list(model.parameters()))
    out_e = model(idx)
    ge = torch.autograd.grad(out_e.square().mean(), list(model.parameters()))
    assert _rel(out_f, out_e) < 1e-4
    assert max(_rel(a, b) for a, b in zip(gf, ge)) < 1e-3


@pytest.mark.slow
def test_quickstart_runs():
    import subprocess

    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "interpreter" in r.stdout and "kernel module" in r.stdout


def test_autotune_plan_runs_on_the_interpreter():
    """fuser.autotune on the CPU: the plumbing runs (the interpreter takes the first config)."""
    q, k, v = _inputs((1, 2, 21, 16), (1, 2, 21, 16))
    rep = fuser.explain(causal_attn, q, k, v, options={"fuser.autotune": True})
    (m,) = rep.fused
    assert m.plan.name == "fuser[backward=autotune]"
    assert {kk.name for kk in m.kernels} >= {"attention_bwd_causal_interp", "attention_bwd_causal_atomicdq_interp"}
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = causal_attn(*ref_in)
    assert _rel(rep.output, ref) < 1e-4
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(rep.output, (q, k, v), g.float()), torch.autograd.grad(ref, ref_in, g)):
        assert _rel(a, b) < 3e-4


def test_detached_scores_give_gradients_to_v_only():
    q, k, v = _inputs((1, 2, 19, 16), (1, 2, 19, 16))

    def f(q, k, v):
        return torch.softmax((q @ k.mT * 0.3).detach(), -1) @ v

    torch._dynamo.reset()
    with collecting() as rep:
        out = torch.compile(f, backend="fuser")(q, k, v)
    assert len(rep.fused) == 1
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = f(*ref_in)
    assert _rel(out, ref) < 1e-4
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), g.float(), allow_unused=True)
    want = torch.autograd.grad(ref, ref_in, g, allow_unused=True)
    assert got[0] is None and got[1] is None and want[0] is None
    assert _rel(got[2], want[2]) < 1e-4


def test_einsum_on_bnhd_operands_writing_bnhd():
    """Issue 7: einsum on [B, N, H, D] operands (and a P V einsum writing [B, N, H, D])."""
    def fn(q, k, v):
        s = torch.einsum("bnhd,bmhd->bhnm", q, k) * 0.3
        return torch.einsum("bhnm,bmhd->bnhd", s.softmax(-1), v)

    _check(fn, _inputs((2, 13, 3, 8), (2, 13, 3, 8)))


def test_a_data_mask_is_tested_on_every_call_not_at_compile_time():
    """One compiled graph (dynamic sizes) served a causal mask as data, then a mask whose upper
    triangle is visible, then left padding, then biases and a hidden key below the diagonal,
    then another length: the run-time test of the mask (codegen/attention.py
    mask_tiles_skippable) decides per call whether the tiles above the diagonal are skipped and
    whether the tiles below it may go without the mask, so every call equals eager, forward
    and backward."""
    def attend(q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask, dim=-1) @ v

    fmin = torch.finfo(torch.float32).min

    def causal(n):
        return torch.zeros(1, 1, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), fmin)

    def visible_upper(n):
        m = causal(n)
        m[..., : n // 3, n - 5:] = 0.0
        return m

    def left_padded(n):
        m = causal(n).expand(2, 1, n, n).clone()
        m[1, :, :, :6] = fmin
        return m

    def changed_below(n):  # far below the diagonal, on every tile size the kernels use
        m = causal(n)
        m[..., n - 1, :8] = 3.0
        m[..., n - 2, 1] = fmin
        m[..., n // 2 + 4, 2] = -2.0
        return m

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="fuser", dynamic=True)
    with collecting() as rep:
        for n, build in ((40, causal), (40, visible_upper), (40, left_padded), (40, changed_below), (57, causal),
                         (57, visible_upper), (57, changed_below)):
            q, k, v = _inputs((2, 2, n, 16), (2, 2, n, 16), seed=n)
            mask = build(n)
            out = compiled(q, k, v, mask)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = attend(*leaves, mask.double())
            assert _rel(out, ref) < 1e-4, (n, build.__name__)
            g = torch.randn_like(ref)
            got = torch.autograd.grad(out, (q, k, v), g.float())
            want = torch.autograd.grad(ref, leaves, g)
            assert max(_rel(a, b) for a, b in zip(got, want)) < 1e-4, (n, build.__name__)
    assert rep.fused and all(m.summary["mask"].startswith("additive") for m in rep.fused), str(rep)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_module_says_why_it_is_not_fused(need_weights):
    """nn.MultiheadAttention reaches the graph as one opaque call: nothing to fuse, but explain()
    says so and names the spellings that are fused (users should not have to read our code)."""
    import fuser

    m = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 8, 16)

    def f(x):
        return m(x, x, x, need_weights=need_weights)[0]

    torch._dynamo.reset()
    rep = fuser.explain(f, x)
    assert not rep.fused
    (r,) = [r for r in rep.rejected if r.pattern == "attention"]
    assert "nn.MultiheadAttention" in r.reason and "scaled_dot_product_attention" in r.reason
    torch.testing.assert_close(rep.output, f(x))


@pytest.mark.parametrize("cut", ["after_softmax", "before_softmax", "after_scores"])
def test_graph_break_inside_attention_says_why_it_is_not_fused(cut):
    """A graph break between q kᵀ and P V leaves two graphs, neither holding a whole attention:
    the output is eager's, and explain() names the cut (one near-miss, in the graph that holds the
    softmax) instead of saying nothing."""
    import fuser

    def f(q, k, v, m):
        s = q @ k.transpose(-1, -2)
        if cut == "after_scores":
            torch._dynamo.graph_break()
        s = s * 0.25 + m
        if cut == "before_softmax":
            torch._dynamo.graph_break()
        p = s.softmax(-1)
        if cut == "after_softmax":
            torch._dynamo.graph_break()
        return p @ v

    q, k, v = _inputs((1, 2, 24, 16), (1, 2, 24, 16), requires_grad=False)
    m = torch.zeros(24, 24)
    torch._dynamo.reset()
    rep = fuser.explain(f, q, k, v, m, options={"fuser.interpret": True})
    assert not rep.fused
    (r,) = rep.rejected
    assert r.pattern == "attention" and "only within one captured graph" in r.reason
    assert ("graph ends" if cut == "after_softmax" else "graph begins") in r.reason
    assert "TORCH_LOGS=graph_breaks" in r.reason
    torch.testing.assert_close(rep.output, f(q, k, v, m))


def test_softmax_returned_without_scores_is_no_near_miss():
    """A classifier's softmax over logits that leaves the graph is not an attention cut: no
    near-miss (explain() must not cry wolf)."""
    import fuser

    lin = torch.nn.Linear(16, 5)
    w = torch.nn.Parameter(torch.randn(5, 16))

    for f in (lambda x: lin(x).softmax(-1), lambda x: (x @ w.t()).softmax(-1)):
        torch._dynamo.reset()
        rep = fuser.explain(f, torch.randn(2, 3, 16))
        assert not rep.rejected and not rep.fused
