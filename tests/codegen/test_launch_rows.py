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
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuser import report
from fuser.codegen import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patterns"))
from test_kda import blog_loop  # noqa: E402  (the kernel blogs' loop: [B, H, T, K], o by index writes)


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


def test_attention_atomic_dq_in_row_slices(small_grid):
    q, k, v = (_rand(2, 3, 21, 16, grad=True, seed=s) for s in (23, 24, 25))
    _check(causal_gqa, (q, k, v), (0, 1, 2), plan="attention.impl=fuser,attention.backward=atomic_dq",
           pattern="attention")


def masked(q, k, v, mask):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return torch.softmax(s + mask, -1) @ v


def test_attention_with_a_data_mask_in_row_slices(small_grid):
    # an additive mask given as data: its rows are tested on the device (attention_mask_rows_kernel)
    q, k, v = (_rand(2, 3, 33, 16, grad=True, seed=s) for s in (26, 27, 28))
    n = 33
    mask = torch.zeros(2, 1, n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    _check(masked, (q, k, v, mask), (0, 1, 2), plan="attention.impl=fuser", pattern="attention")


def attention_kl(q1, k1, q2, k2):
    s1 = q1 @ k1.transpose(-2, -1) * q1.shape[-1] ** -0.5
    s2 = q2 @ k2.transpose(-2, -1) * q2.shape[-1] ** -0.5
    return F.kl_div(F.log_softmax(s2, -1), F.log_softmax(s1, -1), reduction="none", log_target=True).sum(-1).mean()


def attention_kl_gqa(q1, k1, q2, k2):
    k1, k2 = k1.repeat_interleave(q1.shape[1] // k1.shape[1], 1), k2.repeat_interleave(q2.shape[1] // k2.shape[1], 1)
    return attention_kl(q1, k1, q2, k2)


@pytest.mark.parametrize("split", ["1", "2"])
@pytest.mark.parametrize("bwd", ["two_kernel", "atomic_dq"])
def test_attention_kl_forward_and_backward_in_row_slices(small_grid, split, bwd):
    q1, k1 = _rand(2, 3, 40, 16, seed=7), _rand(2, 3, 40, 16, seed=8)
    q2, k2 = _rand(2, 3, 40, 8, grad=True, seed=9), _rand(2, 3, 40, 8, grad=True, seed=10)
    _check(attention_kl, (q1, k1, q2, k2), (2, 3), plan=f"attention_kl.split_k={split},attention_kl.backward={bwd}",
           pattern="attention_kl")


def test_attention_kl_both_sides_trained_with_grouped_kv_in_row_slices(small_grid):
    # teacher gradients too (the side-1 kernels); 6 query rows over 2 kv rows per side
    q1, q2 = _rand(2, 3, 29, 16, grad=True, seed=19), _rand(2, 3, 29, 8, grad=True, seed=20)
    k1, k2 = _rand(2, 1, 29, 16, grad=True, seed=21), _rand(2, 1, 29, 8, grad=True, seed=22)
    _check(attention_kl_gqa, (q1, k1, q2, k2), (0, 1, 2, 3), plan="attention_kl.backward=two_kernel",
           pattern="attention_kl")


def h2o(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    return p @ v, p.sum(-2)


@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel", "diag_cache"])
def test_h2o_in_row_slices(small_grid, plan):
    q, k, v = (_rand(2, 3, 33, 16, seed=s) for s in (11, 12, 13))
    with torch.no_grad():
        _check(h2o, (q, k, v), (), plan=f"h2o.impl=fuser,h2o.plan={plan}", pattern="h2o")


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


def gqa_loop(q, k, v, g, beta):
    """KDA with grouped value heads: q, k (and the gate) shared by 3 value heads each."""
    hv = v.shape[1]
    q, k, g = (x.repeat_interleave(hv // x.shape[1], 1) for x in (q, k, g))
    return blog_loop(q, k, v, g, beta)


@pytest.mark.parametrize("plan", ["kda.plan=recurrent", "kda.plan=chunk"])
def test_kda_grouped_value_heads_in_row_slices(small_grid, plan):
    q, k, _, g, _ = _kda_inputs(2, 1, 9, 16, 24, grad=True)
    _, _, v, _, beta = _kda_inputs(2, 3, 9, 16, 24, grad=True)
    _check(gqa_loop, (q, k, v, g, beta), (0, 1, 2, 3, 4), plan=plan, pattern="kda", tol=2e-4)


def _symbolic_rows(upper=None):
    """A fake [B, 9, 3, 24] value tensor (B=2 at trace time, symbolic; ``upper``: its bound)
    and the shape environment it lives in."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv, StatelessSymbolicContext,
                                                       StrictMinMaxConstraint)
    from torch.utils._sympy.value_ranges import ValueRanges

    env = ShapeEnv()
    bound = None if upper is None else StrictMinMaxConstraint(vr=ValueRanges(2, upper), warn_only=False)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * 3,
                                   constraint_sizes=[bound, None, None, None])
    mode = FakeTensorMode(shape_env=env)
    v = mode.from_tensor(torch.empty(2, 9, 3, 24), symbolic_context=ctx)
    q = mode.from_tensor(torch.empty(2, 9, 3, 16), symbolic_context=ctx)
    return env, q, v


def test_the_symbolic_kda_rule_inlines_only_rows_that_fit_one_grid(small_grid, monkeypatch):
    # 3 value heads per batch entry, 4 rows a grid: the batch may be 1 at most
    from fuser.patterns import kda_ops

    def rule(q, v):
        return kda_ops._symbolic_sizes(q, v, [1, 1, 1, 1, 1], 0, 9)

    # concrete sizes: 6 rows do not fit, 3 do
    assert "rows may exceed" in rule(torch.empty(2, 9, 3, 16), torch.empty(2, 9, 3, 24))
    assert rule(torch.empty(1, 9, 3, 16), torch.empty(1, 9, 3, 24)) is None
    # a dim unbounded above (torch.compile's dynamic dims) and B >= 2: 3·B > 4 is proven, no guard
    env, q, v = _symbolic_rows()
    assert "rows may exceed" in rule(q, v) and not env.guards
    # with 7 rows a grid, 3·B <= 7 holds at B=2 but not for every B: decided with a guard, the only one
    monkeypatch.setattr(launch, "MAX_GRID_ROWS", 7)
    env, q, v = _symbolic_rows()
    assert rule(q, v) is None
    assert [re.sub(r"s\d+", "B", str(g.expr)) for g in env.guards] == ["3*B <= 7"]
    # a bound the user gave: no guard (it would contradict the bound), decided from the range
    env, q, v = _symbolic_rows(upper=100)
    assert "rows may exceed" in rule(q, v) and not env.guards
    # inside fuser.export's check (no recompile to fall back on): no guard either
    env, q, v = _symbolic_rows()
    with launch.without_size_guards():
        assert "rows may exceed" in rule(q, v)
    assert not env.guards


def test_at_most_proves_from_bounds_and_guards_only_unbounded_dims():
    assert launch.at_most(5, 5) and not launch.at_most(6, 5)
    env, _, v = _symbolic_rows(upper=1000)
    assert launch.at_most(v.shape[0], 1000) and not launch.at_most(v.shape[0], 999) and not env.guards
    env, _, v = _symbolic_rows()
    assert launch.at_most(v.shape[0] * 3, 65535) and len(env.guards) == 1


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


def _cuda_kda(b):
    return [x.detach().cuda().requires_grad_() for x in _kda_inputs(b, 3, 9, 16, 24, grad=False)]


def _cuda_kl(b):
    return [_rand(b, 3, 37, 16, seed=s).cuda().requires_grad_(s > 2) for s in (1, 2, 3, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["kda", "kda_recurrent", "attention_kl"])
def test_a_dynamic_batch_past_the_rows_guard_compiles_again_and_launches_in_slices(monkeypatch, case):
    # 7 rows a grid, 3 heads: batch 2 (6 rows) is traced with symbolic rows and its kernels are
    # inlined behind the guard 3*B <= 7; batch 3 (9 rows) fails the guard, Dynamo compiles again,
    # and that graph keeps the opaque op, which launches its rows in slices of 7
    monkeypatch.setattr(launch, "MAX_GRID_ROWS", 7)
    fn, make, plan = {"kda": (blog_loop, _cuda_kda, "kda.plan=chunk"),
                      "kda_recurrent": (blog_loop, _cuda_kda, "kda.plan=recurrent"),
                      "attention_kl": (attention_kl, _cuda_kl, "attention_kl.split_k=1,attention_kl.backward=two_kernel")}[case]
    torch._dynamo.reset()
    f = torch.compile(fn, backend="fuser", options={"fuser.plan": plan})
    launches = []
    for b in (2, 3):
        args = make(b)
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        with report.collecting() as rep:
            got = f(*args)
        launches += [m.launch for m in rep.fused]
        got = got if isinstance(got, tuple) else (got,)
        ref_in = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
        want = fn(*ref_in)
        want = want if isinstance(want, tuple) else (want,)
        for a, w in zip(got, want):
            assert _rel(a, w) < 2e-3
        trained = [i for i, a in enumerate(args) if a.requires_grad]
        douts = [torch.randn_like(w) for w in want]
        g = torch.autograd.grad(got, [args[i] for i in trained], [d.to(x.dtype) for d, x in zip(douts, got)])
        gw = torch.autograd.grad(want, [ref_in[i] for i in trained], douts)
        for a, w in zip(g, gw):
            assert _rel(a, w) < 2e-2
    # the first graph inlined with symbolic rows (no launch note); batch 3 failed its guard and
    # compiled again: opaque with symbolic sizes (sliced when it runs), or with static sizes
    # inlined as one traced launch per slice
    assert len(launches) == 2 and launches[0] == "" and launches[1] in ("", "symbolic sizes"), launches
