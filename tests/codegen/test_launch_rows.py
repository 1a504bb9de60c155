"""Launches with more rows (batch × heads) than one CUDA grid holds (``launch.MAX_GRID_ROWS``).

CUDA caps a launch grid's second axis at 65535; every template puts its rows (B·H, or the KDA
value rows) there, takes ``ROW_BASE`` and reads its row as ``tl.program_id(1) + ROW_BASE``, and
``launch.jit_call`` splits a launch with more rows into slices. Triton's interpreter has no such
limit, so these tests lower ``MAX_GRID_ROWS`` to 4 and run every kernel family with 6 rows (a
full slice and a partial one) against float64 eager, forward and backward; the GPU test runs the
real limit (B·H = 65600).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuser import report
from fuser.codegen import launch



def blog_loop(q, k, v, g, beta):
    """The kernel blogs' KDA loop ([B, H, T, K], o by index writes, the final state returned)."""
    b, h, t_len, kd = q.shape
    s = q.new_zeros(b, h, kd, v.shape[-1])
    o = torch.empty_like(v)
    for t in range(t_len):
        s = s * g[:, :, t][..., None].exp()
        v_hat = (k[:, :, t][..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, :, t][..., None] * k[:, :, t], v[:, :, t] - v_hat)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t] * kd ** -0.5, s)
    return o, s


def _mark_rows(Out, N_COLS, ROW_BASE):
    row = tl.program_id(1) + ROW_BASE
    col = tl.program_id(0)
    tl.store(Out + row * N_COLS + col, row * 100 + col)


def _no_rows(Out):
    tl.store(Out + tl.program_id(0), 1.0)


@pytest.fixture
def small_grid(monkeypatch):
    monkeypatch.setattr(launch, "MAX_GRID_ROWS", 4)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_every_row_runs_once_in_slices(small_grid, rows):
    out = torch.full((rows, 3), -1, dtype=torch.int32)
    calls = []

    def spy(grid):
        calls.append(tuple(grid))
        return kernel[grid]

    with launch.launching(True):
        kernel = triton.jit(_mark_rows)  # interpreted: made inside the interpreter's mode
        launcher = launch.jit_call(kernel)
        launcher.launcher = type("Spy", (), {"__getitem__": lambda self, g: spy(g)})()
        launcher[(3, rows)](out, 3)
    want = torch.arange(rows, dtype=torch.int32)[:, None] * 100 + torch.arange(3, dtype=torch.int32)
    assert torch.equal(out, want)
    assert calls == [(3, min(4, rows - b)) for b in range(0, rows, 4)]


def test_a_kernel_without_rows_is_launched_as_it_is():
    kernel = triton.jit(_no_rows)
    assert launch.jit_call(kernel) is kernel


def _compiled(fn, plan=None):
    torch._dynamo.reset()
    options = {"fuser.interpret": True}
    if plan:
        options["fuser.plan"] = plan
    return torch.compile(fn, backend="fuser", options=options)


def _check(fn, args, grads, plan=None, pattern=None, tol=1e-4):
    f = _compiled(fn, plan)
    with report.collecting() as rep:
        got = f(*args)
    got = got if isinstance(got, tuple) else (got,)
    ref_in = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    want = fn(*ref_in)
    want = want if isinstance(want, tuple) else (want,)
    assert [m.pattern for m in rep.fused] == [pattern], rep.fused
    for a, b in zip(got, want):
        assert _rel(a, b) < tol
    if grads:
        gen = torch.Generator().manual_seed(7)
        douts = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
        g = torch.autograd.grad(got, [args[i] for i in grads], [d.to(x.dtype) for d, x in zip(douts, got)])
        gw = torch.autograd.grad(want, [ref_in[i] for i in grads], douts)
        for a, b in zip(g, gw):
            assert _rel(a, b) < 10 * tol


def _rand(*shape, grad=False, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(grad)


def causal_gqa(q, k, v):
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_attention_forward_and_backward_in_row_slices(small_grid):
    # 6 query rows, 2 kv rows: the dq/forward launches split 4 + 2
    q = _rand(2, 3, 37, 16, grad=True, seed=1)
    k, v = _rand(2, 1, 37, 16, grad=True, seed=2), _rand(2, 1, 37, 16, grad=True, seed=3)
    _check(causal_gqa, (q, k, v), (0, 1, 2), plan="attention.impl=fuser", pattern="attention")


def test_attention_forward_and_backward_in_row_slices_with_more_kv_rows(small_grid):
    # 6 kv rows too: the dk/dv launch splits as well
    q, k, v = (_rand(3, 2, 21, 16, grad=True, seed=s) for s in (4, 5, 6))
    _check(causal_gqa, (q, k, v), (0, 1, 2), plan="attention.impl=fuser", pattern="attention")


def attention_kl(q1, k1, q2, k2):
    s1 = q1 @ k1.transpose(-2, -1) * q1.shape[-1] ** -0.5
    s2 = q2 @ k2.transpose(-2, -1) * q2.shape[-1] ** -0.5
    return F.kl_div(F.log_softmax(s2, -1), F.log_softmax(s1, -1), reduction="none", log_target=True).sum(-1).mean()


@pytest.mark.parametrize("split", ["1", "2"])
def test_attention_kl_forward_and_backward_in_row_slices(small_grid, split):
    q1, k1 = _rand(2, 3, 40, 16, seed=7), _rand(2, 3, 40, 16, seed=8)
    q2, k2 = _rand(2, 3, 40, 8, grad=True, seed=9), _rand(2, 3, 40, 8, grad=True, seed=10)
    _check(attention_kl, (q1, k1, q2, k2), (2, 3), plan=f"attention_kl.split_k={split}", pattern="attention_kl")


def h2o(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    return p @ v, p.sum(-2)


def test_h2o_in_row_slices(small_grid):
    q, k, v = (_rand(2, 3, 33, 16, seed=s) for s in (11, 12, 13))
    with torch.no_grad():
        _check(h2o, (q, k, v), (), plan="h2o.impl=fuser", pattern="h2o")


def _kda_inputs(b, h, t, kd, vd, grad):
    q, k = (F.normalize(_rand(b, h, t, kd, seed=s), dim=-1).detach().requires_grad_(grad) for s in (14, 15))
    v = _rand(b, h, t, vd, grad=grad, seed=16)
    g = (-torch.rand(b, h, t, kd, generator=torch.Generator().manual_seed(17)) * 0.5).requires_grad_(grad)
    beta = torch.rand(b, h, t, generator=torch.Generator().manual_seed(18)).requires_grad_(grad)
    return q, k, v, g, beta


@pytest.mark.parametrize("plan", ["kda.plan=recurrent", "kda.plan=parallel", "kda.plan=chunk",
                                  "kda.plan=chunk,kda.save=workspaces"])
def test_kda_forward_and_backward_in_row_slices(small_grid, plan):
    args = _kda_inputs(2, 3, 9, 16, 24, grad=True)
    _check(blog_loop, args, (0, 1, 2, 3, 4), plan=plan, pattern="kda", tol=2e-4)


def test_the_symbolic_kda_rule_keeps_the_opaque_op_past_the_grid(small_grid):
    # traced with symbolic lead dims, the chunk plan hands its kernels to Inductor only while the
    # rows fit one launch (a guard); past it the opaque op slices them (the tests above)
    from fuser.patterns import kda_ops

    v = torch.empty(2, 9, 3, 24)  # [B, T, HV, V]: 6 value rows
    q = torch.empty(2, 9, 3, 16)
    assert "value rows" in kda_ops._symbolic_sizes(q, v, [1, 1, 1, 1, 1], 0, 9)
    assert kda_ops._symbolic_sizes(q[:1], v[:1], [1, 1, 1, 1, 1], 0, 9) is None


@pytest.mark.gpu
def test_more_rows_than_a_cuda_grid_holds():
    # B·H = 65600 > 65535: the forward and backward of causal attention, at CUDA's real limit
    b, h = 4100, 16
    q, k, v = (torch.randn(b, h, 40, 32, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    torch._dynamo.reset()
    f = torch.compile(causal_gqa_cuda, backend="fuser", options={"fuser.plan": "attention.impl=fuser"})
    with report.collecting() as rep:
        out = f(q, k, v)
    assert [m.pattern for m in rep.fused] == ["attention"]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = causal_gqa_cuda(*ref_in)
    assert _rel(out, ref) < 2e-3 and not math.isnan(out.float().sum().item())
    for a, b_ in zip(grads, torch.autograd.grad(ref, ref_in, dout.float())):
        assert _rel(a, b_) < 2e-2


def causal_gqa_cuda(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v
