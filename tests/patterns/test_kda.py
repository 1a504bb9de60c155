"""The KDA pattern: the spellings of the unrolled recurrence it fuses (each checked against eager
and the float64 reference), and the near-misses it declines with a reason.

Shapes are small (the CPU runs the kernels in Triton's interpreter); T is not a multiple of any
block, K and V are not powers of two.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser.patterns import kda_reference
from fuser.testing import assert_declines, assert_fuses, fuse, run_rewritten

B, H, T, K, V = 2, 2, 5, 12, 20


def _inputs(layout="bthk", dtype=torch.float32, hv=H, seed=0, t=T, k=K, v=V, scalar_gate=False):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    if layout == "bthk":
        q, kk = rnd(B, t, H, k), F.normalize(rnd(B, t, H, k), dim=-1)
        vv = rnd(B, t, hv, v)
        g = -F.softplus(rnd(B, t, hv) if scalar_gate else rnd(B, t, hv, k))
        beta = torch.rand(B, t, hv, generator=gen)
    else:
        q, kk = rnd(B, H, t, k), F.normalize(rnd(B, H, t, k), dim=-1)
        vv = rnd(B, hv, t, v)
        g = -F.softplus(rnd(B, hv, t) if scalar_gate else rnd(B, hv, t, k))
        beta = torch.rand(B, hv, t, generator=gen)
    return tuple(x.to(dtype) for x in (q, kk, vv, g, beta))


def _run(fn, *args):
    graphs, result = fuse(fn, *args)
    return run_rewritten(graphs, *args), result


def _close(got, want, tol=2e-4):
    got, want = got.double(), want.double()
    err = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.3g}"


def _check(fn, *args, tol=2e-4, **expected):
    """``fn`` fused once with the ``expected`` summary, its outputs equal to eager's."""
    assert_fuses(fn, *args, pattern="kda", **expected)
    got, _ = _run(fn, *args)
    want = fn(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        _close(a, b, tol)
    return got


# -- spellings -----------------------------------------------------------------------------------

def blog_loop(q, k, v, g, beta):
    """The kernel blogs' loop: [B, H, T, K], einsum, o written by index, the final state returned."""
    b, h, t_len, kd = q.shape
    s = q.new_zeros(b, h, kd, v.shape[-1], dtype=torch.float32)
    o = torch.empty_like(v)
    for t in range(t_len):
        s = s * g[:, :, t][..., None].exp()
        v_hat = (k[:, :, t][..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, :, t][..., None] * k[:, :, t], v[:, :, t] - v_hat)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t] * kd ** -0.5, s)
    return o, s


def fla_naive(q, k, v, g, beta, initial_state, scale):
    """FLA's naive reference, written from its math: [B, T, H, K], float32 upcast, q and k repeated to
    the value heads, an initial state, the final state returned."""
    dtype = v.dtype
    group = v.shape[2] // q.shape[2]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q.repeat_interleave(group, dim=2) * scale
    k = k.repeat_interleave(group, dim=2)
    s = initial_state.float()
    o = torch.zeros_like(v)
    for i in range(q.shape[1]):
        q_i, k_i, v_i, g_i, b_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        s = s * g_i[..., None].exp()
        s = s + torch.einsum("bhk,bhv->bhkv", b_i[..., None] * k_i, v_i - (k_i[..., None] * s).sum(-2))
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q_i, s)
    return o.to(dtype), s


def test_blog_loop():
    args = _inputs("bhtk")
    o, s = _check(blog_loop, *args, steps=T, outputs="o, state", initial_state="zeros", scale=K ** -0.5,
                  gate="per key channel", assembly="index writes into a buffer")
    # and the float64 reference of the recurrence (FLA's layout)
    q, k, v, g, beta = (x.transpose(1, 2) for x in args)
    want_o, want_s = kda_reference.recurrent(q, k, v, g, beta, output_final_state=True)
    _close(o.transpose(1, 2), want_o)
    _close(s, want_s)


def test_fla_naive_gva_initial_state():
    q, k, v, g, beta = _inputs("bthk", hv=2 * H)
    h0 = torch.randn(B, 2 * H, K, V)
    _check(fla_naive, q, k, v, g, beta, h0, K ** -0.5, steps=T, outputs="o, state", initial_state="s")


def test_layout_through_transposes_and_a_stack():
    def loop(q, k, v, g, beta):  # [B, T, H, *] in, heads-first inside
        q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
        beta = beta.transpose(1, 2)
        s = torch.zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
        outs = []
        for t in range(q.shape[2]):
            s = s * torch.exp(g[:, :, t]).unsqueeze(-1)
            v_hat = torch.einsum("bhk,bhkv->bhv", k[:, :, t], s)
            s = s + k[:, :, t][..., :, None] * (beta[:, :, t][..., None] * (v[:, :, t] - v_hat))[..., None, :]
            outs.append((q[:, :, t].unsqueeze(-2) @ s).squeeze(-2) * 0.5)
        return torch.stack(outs, dim=1)

    _check(loop, *_inputs("bthk"), steps=T, outputs="o", assembly="torch.stack", scale=0.5)


def test_l2_normalised_qk_and_sigmoid_beta():
    def loop(q, k, v, g, b):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = b.sigmoid()
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.zeros_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t, :, :, None].exp()
            kv = (k[:, t, :, :, None] * s).sum(-2)
            s = s + torch.einsum("bhk,bhv->bhkv", k[:, t] * beta[:, t, :, None], v[:, t] - kv)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    q, k, v, g, b = _inputs("bthk")
    _check(loop, q, k, v, g, torch.randn(B, T, H), steps=T, outputs="o", scale=1.0)


def scalar_gate_loop(q, k, v, g, beta):
    """The gated delta rule ([B, T, H, K]): one decay per head and token."""
    s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        v_hat = (k[:, t][..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t], v[:, t] - v_hat)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
    return o, s


def test_scalar_gate():
    _check(scalar_gate_loop, *_inputs("bthk", scalar_gate=True), steps=T, gate="scalar per head")


def test_fp32_state_with_half_inputs():
    def loop(q, k, v, g, beta):
        s = torch.zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1], dtype=torch.float32)
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            q_t, k_t, v_t = q[:, t].float(), k[:, t].float(), v[:, t].float()
            s = s * g[:, t].float().exp()[..., None]
            v_hat = (k_t[..., None] * s).sum(-2)
            s = s + (beta[:, t].float()[..., None] * k_t)[..., None] * (v_t - v_hat)[..., None, :]
            o[:, t] = (q_t[..., None] * s).sum(-2)
        return o, s

    o, s = _check(loop, *_inputs("bthk", dtype=torch.float16), tol=2e-3, dtype="float16")
    assert o.dtype == torch.float16 and s.dtype == torch.float32


def test_dynamo_matches_t_1024():
    # the repeat rule is iterative: a 1024-step chain is one match (its trace time: benchmarks/kda.py)
    args = _inputs("bhtk", t=1024, k=4, v=4)
    graphs, result = fuse(blog_loop, *args)
    ms = [m for m in result.matches if m.pattern == "kda"]
    assert len(ms) == 1 and ms[0].summary["steps"] == 1024
    assert ms[0].fused


def test_training_gradients_match_eager():
    args = [x.clone().requires_grad_(x.dim() == 4) for x in _inputs("bhtk")]
    (o, s), _ = _run(blog_loop, *args)
    loss = o.square().sum() + s.sum()
    grads = torch.autograd.grad(loss, [a for a in args if a.requires_grad])
    ref = [x.detach().clone().requires_grad_(x.requires_grad) for x in args]
    o2, s2 = blog_loop(*ref)
    want = torch.autograd.grad(o2.square().sum() + s2.sum(), [a for a in ref if a.requires_grad])
    for a, b in zip(grads, want):
        _close(a, b, 1e-3)


def _segment(s, q, k, v, g, beta):
    """One segment of a streamed sequence: continues the state ``s`` over ``[B, T, H, *]`` inputs."""
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = s * g[:, t][..., None].exp()
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                             v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
    return o, s


def two_segments(q, k, v, g, beta, q2, k2, v2, g2, beta2):
    """Two loops over two segments, the state handed from one to the next (chunked prefill)."""
    s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
    o1, s = _segment(s, q, k, v, g, beta)
    o2, s = _segment(s, q2, k2, v2, g2, beta2)
    return o1, o2, s


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_two_loops_chained_through_the_state_are_two_matches(train):
    """The second loop's initial state is the first loop's final state: each loop is a chain of its
    own (the second's h0 the first op's state output), forward and gradients equal to eager's.
    Before, the chain ran on into the second loop and both were declined ("step 5 differs")."""
    args = [x.clone().requires_grad_(train) for x in _inputs("bthk") + _inputs("bthk", seed=1, t=3)]
    graphs, result = fuse(two_segments, *args)
    fused = [m for m in result.matches if m.pattern == "kda" and m.fused]
    assert [m.summary["steps"] for m in fused] == [T, 3] and not result.rejected
    assert fused[0].summary["initial_state"] == "zeros" and fused[0].summary["outputs"] == "o, state"
    assert fused[1].summary["initial_state"] != "zeros"
    got = run_rewritten(graphs, *args)
    ref = [x.detach().double().requires_grad_(train) for x in args]
    want = two_segments(*ref)
    for a, b in zip(got, want):
        _close(a, b)
    if train:
        gw = [torch.randn_like(w) for w in want]
        dg = torch.autograd.grad(got, args, [x.float() for x in gw])
        dw = torch.autograd.grad(want, ref, gw)
        for a, b in zip(dg, dw):
            _close(a, b, 1e-3)


def test_a_nan_at_the_last_token_leaves_earlier_outputs_exact_under_the_recurrent_plan():
    # README Limits: the chunked kernels may spread a later token's NaN to earlier tokens (0 * NaN in
    # a dot); the token loop does not, as eager does not
    q, k, v, g, beta = _inputs("bhtk")
    v = v.clone()
    v[:, :, -1] = float("nan")
    graphs, result = fuse(blog_loop, q, k, v, g, beta, options={"fuser.plan": "kda.plan=recurrent"})
    assert [m.pattern for m in result.matches if m.fused] == ["kda"]
    o, s = run_rewritten(graphs, q, k, v, g, beta)
    wo, ws = blog_loop(q, k, v, g, beta)
    assert torch.equal(o.isnan(), wo.isnan()) and torch.equal(s.isnan(), ws.isnan())
    _close(o[:, :, :-1], wo[:, :, :-1])


def test_a_scale_from_a_dynamic_head_dim_is_declined_naming_it():
    # dynamic=True makes K symbolic: the blog loop's K ** -0.5 is then no constant (the op takes one);
    # the decline names the symbolic scale (it said "not a selection x[:, t]")
    assert_declines(blog_loop, *_inputs("bhtk"), pattern="kda", dynamic=True,
                    reason=r"scaled inside the loop by .* symbolic size")


# found by an adversarial review (2026-12-07): with only q needing a gradient the fused op's final
# state required one (autograd.grad of it gave zeros where eager raises)
@pytest.mark.parametrize("plan", [None, "kda.plan=chunk,kda.save=workspaces"])
def test_the_final_state_needs_a_gradient_only_when_eagers_does(plan):
    args = list(_inputs("bhtk"))
    args[0] = args[0].clone().requires_grad_(True)  # q alone: the state never depends on it
    options = {"fuser.plan": plan} if plan else None
    graphs, result = fuse(blog_loop, *args, options=options)
    assert [m.pattern for m in result.matches if m.fused] == ["kda"]
    o, s = run_rewritten(graphs, *args)
    wo, ws = blog_loop(*args)
    assert (o.requires_grad, s.requires_grad) == (wo.requires_grad, ws.requires_grad) == (True, False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(s.sum(), args[0])
    _close(torch.autograd.grad(o.square().sum(), args[0])[0], torch.autograd.grad(wo.square().sum(), args[0])[0], 1e-3)
    args[2] = args[2].clone().requires_grad_(True)  # v too: now the state does
    o, s = run_rewritten(graphs, *args)
    assert s.requires_grad


@pytest.mark.parametrize("which", [1, 2, 3, 4], ids=["k", "v", "g", "beta"])
def test_the_final_state_keeps_its_gradient_when_one_of_its_inputs_needs_one(which):
    # the other side of the rule above: the state depends on k, v, g and beta; each alone needing a
    # gradient must give the state eager's gradient (not a non-differentiable output)
    args = list(_inputs("bhtk"))
    args[which] = args[which].clone().requires_grad_(True)
    graphs, result = fuse(blog_loop, *args)
    assert [m.pattern for m in result.matches if m.fused] == ["kda"]
    o, s = run_rewritten(graphs, *args)
    wo, ws = blog_loop(*args)
    assert s.requires_grad and ws.requires_grad
    _close(torch.autograd.grad(s.square().sum(), args[which])[0], torch.autograd.grad(ws.square().sum(), args[which])[0],
           1e-3)


@pytest.mark.parametrize("layout,scalar_gate,t_len", [("bhtk", False, 40), ("bthk", True, 37)])
def test_training_with_the_forward_workspaces_kept(layout, scalar_gate, t_len):
    """``kda.save=workspaces`` (chunk plan, gradients recorded): the rewrite emits fuser::kda_save,
    whose backward reads the forward's workspaces; the gradients (ragged T: chunks of 64 with a
    partial one, both gate kinds) equal eager's, and explain() says what is kept. The default
    plan keeps the inputs and says so."""
    args = [x.clone().requires_grad_(True) for x in _inputs(layout, t=t_len, scalar_gate=scalar_gate)]
    loop = blog_loop if layout == "bhtk" else scalar_gate_loop
    options = {"fuser.plan": "kda.plan=chunk,kda.save=workspaces"}
    graphs, result = fuse(loop, *args, options=options)
    (m,) = [m for m in result.matches if m.pattern == "kda" and m.fused]
    assert m.plan.params["save"] == "workspaces" and "keeps the forward's workspaces" in m.plan.note
    assert any(n.target is torch.ops.fuser.kda_save.default for gm, _ in graphs for n in gm.graph.nodes)
    out = run_rewritten(graphs, *args)
    o, s = out
    grads = torch.autograd.grad(o.square().sum() + s.sum(), args)
    ref = [x.detach().clone().requires_grad_(True) for x in args]
    wo, ws = loop(*ref)
    want = torch.autograd.grad(wo.square().sum() + ws.sum(), ref)
    for a, b in zip(grads, want):
        _close(a, b, 1e-3)
    _, default = fuse(loop, *args, options={"fuser.plan": "kda.plan=chunk"})
    (m,) = [m for m in default.matches if m.pattern == "kda" and m.fused]
    assert m.plan.params["save"] == "inputs" and "kda.save=workspaces keeps" in m.plan.note


def test_kept_workspaces_follow_eager_on_in_place_writes_sizes_and_grad_mode():
    """The assumptions of kda.save=workspaces, each against eager: (1) the workspaces belong to the
    inputs of the forward — an input written in place before the backward never gives a gradient
    other than eager's (the op saves the inputs beside the workspaces: autograd refuses); (2) sizes: a
    graph captured with dynamic shapes serves another batch and length of its buffers, workspaces
    shaped from the symbolic sizes; (3) grad mode: the graph run under no_grad still equals eager."""
    options = {"fuser.plan": "kda.plan=chunk,kda.save=workspaces"}
    args = [x.clone().requires_grad_(True) for x in _inputs("bthk", t=37, scalar_gate=True)]
    graphs, result = fuse(scalar_gate_loop, *args, options=options, dynamic=True)
    assert [m.plan.params.get("save") for m in result.matches if m.pattern == "kda" and m.fused] == ["workspaces"]

    def grads(run, xs):
        o, s = run(*xs)
        return torch.autograd.grad(o.square().sum() + s.sum(), xs)

    for b in (3, 1):  # another batch size than the capture's (B=2)
        xs = [x.detach()[:1].expand(b, *x.shape[1:]).clone().requires_grad_(True) for x in args]
        ref = [x.detach().clone().requires_grad_(True) for x in xs]
        for a, w in zip(grads(lambda *z: run_rewritten(graphs, *z), xs), grads(scalar_gate_loop, ref)):
            _close(a, w, 1e-3)
    # q written in place between the forward and the backward: eager's einsums saved their own
    # copies, so eager differentiates the forward it ran; the fused op saved q itself, so autograd
    # refuses (loud, never a different gradient; a known divergence, in the note)
    got = []
    for run in (lambda *z: run_rewritten(graphs, *z), scalar_gate_loop):
        xs = [x.detach().clone().requires_grad_(True) for x in args]
        o, s = run(*xs)
        with torch.no_grad():
            xs[0].add_(1.0)
        try:
            got.append(torch.autograd.grad(o.square().sum() + s.sum(), xs))
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc)
            got.append(None)
    fused, eager = got
    assert eager is not None
    if fused is not None:
        for a, w in zip(fused, eager):
            _close(a, w, 1e-3)
    with torch.no_grad():
        for a, w in zip(run_rewritten(graphs, *args), scalar_gate_loop(*args)):
            _close(a, w)


def test_keeping_workspaces_without_gradients_keeps_nothing():
    # no backward: the choice does not apply (as a backward choice for an inference-only match)
    args = _inputs("bhtk", t=20)
    graphs, result = fuse(blog_loop, *args, options={"fuser.plan": "kda.plan=chunk,kda.save=workspaces"})
    (m,) = [m for m in result.matches if m.pattern == "kda" and m.fused]
    assert "save" not in m.plan.params and "workspaces" not in m.plan.note
    assert not any(n.target is torch.ops.fuser.kda_save.default for gm, _ in graphs for n in gm.graph.nodes)


# -- near-misses -----------------------------------------------------------------------------------

def test_every_state_kept_is_declined():
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o, states = torch.empty_like(v), []
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
            states.append(s)
        return o, torch.stack(states)

    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="also used by")


def test_a_step_that_differs_is_declined():
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * (0.5 if t == 3 else 1.0), s)
        return o

    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="step 3 .*differs.*scale")


def test_undecayed_state_in_the_delta_is_declined():
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            v_hat = torch.einsum("bhk,bhkv->bhv", k[:, t], s)  # before the decay: another algorithm
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t], v[:, t] - v_hat)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="before its decay")


def _cast_loop(cast, buffer_dtype=None):
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.zeros_like(v, dtype=buffer_dtype)
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = cast(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
        return o
    return loop


# found by an adversarial review (2026-12-07): a cast between o_t and its write was dropped, so
# `o[:, t] = o_t.int()` (or `.bfloat16()` into a float32 buffer) returned the uncast values
@pytest.mark.parametrize("cast", [lambda x: x.to(torch.int32), lambda x: x.bfloat16(), lambda x: x.half()],
                         ids=["int32", "bfloat16", "float16"])
def test_a_cast_narrower_than_the_buffer_before_the_write_is_declined(cast):
    assert_declines(_cast_loop(cast), *_inputs("bthk"), pattern="kda", reason="cast to .* before it is written")


@pytest.mark.parametrize("cast,buffer_dtype", [(lambda x: x.float(), torch.bfloat16),
                                               (lambda x: x.bfloat16(), torch.bfloat16),
                                               (lambda x: x.half(), torch.float16)],
                         ids=["float-into-bf16", "bf16-into-bf16", "fp16-into-fp16"])
def test_a_cast_that_changes_no_written_value_is_fused(cast, buffer_dtype):
    _check(_cast_loop(cast, buffer_dtype), *_inputs("bthk"), tol=1e-2 if buffer_dtype else 2e-4)


@pytest.mark.parametrize("where", ["beta", "q", "k"])
def test_an_input_transformed_inside_the_loop_is_declined_with_a_reason(where):
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            q_t, k_t, b_t = q[:, t], k[:, t], beta[:, t]
            q_t, k_t, b_t = (q_t.exp() if where == "q" else q_t, k_t.exp() if where == "k" else k_t,
                             b_t.exp() if where == "beta" else b_t)
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t,
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q_t, s)
        return o

    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="computed inside the loop")


def _variant_loop(variant):
    """The blog loop with one change that makes it another recurrence (or a per-step input)."""
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            g_t, b_t, k_t, v_t = g[:, t][..., None], beta[:, t][..., None], k[:, t], v[:, t]
            s = s * ((-g_t).exp() if variant == "exp(-g)" else g_t.exp())
            b_t = b_t * b_t if variant == "beta squared" else b_t
            v_hat = torch.einsum("bhk,bhkv->bhv", k_t, s)
            delta = v_hat - v_t if variant == "delta flipped" else v_t - v_hat
            update = torch.einsum("bhk,bhv->bhkv", b_t * k_t, delta)
            s = s - update if variant == "update subtracted" else s + update
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    return loop


@pytest.mark.parametrize("variant,reason", [
    ("exp(-g)", "exp of an expression computed inside the loop.*before the loop"),
    ("beta squared", "multiplies 4 factors.*before the loop"),
    ("delta flipped", "is v̂ − v_t, the opposite sign"),
    ("update subtracted", "is subtracted from the decayed state"),
])
def test_a_step_of_another_recurrence_is_declined_with_a_reason(variant, reason):
    """Near-misses users write (or mistype): each says what differs instead of a silent decline, and
    the program still computes what eager does."""
    args = _inputs("bthk")
    rej = assert_declines(_variant_loop(variant), *args, pattern="kda", reason=reason)
    assert rej.location.startswith("test_kda.py")
    graphs, _ = fuse(_variant_loop(variant), *args)
    torch.testing.assert_close(run_rewritten(graphs, *args), _variant_loop(variant)(*args))


def test_the_chunked_form_is_declined_naming_the_loop_that_fuses():
    """A chunked (WY) loop, here the float64 reference's own, is another algorithm for the same
    recurrence: declined with a reason that names the per-token loop fuser matches (not a
    misleading one about its gate)."""
    def chunked(q, k, v, g, beta):
        return kda_reference.chunked(q, k, v, g, beta, chunk=4)[0]

    args = tuple(x.float() for x in _inputs("bthk", t=8))
    assert_declines(chunked, *args, pattern="kda", reason="chunked form.*Write the loop per token")


def test_a_buffer_from_the_caller_is_declined():
    def loop(q, k, v, g, beta, o):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return s

    args = _inputs("bthk")
    assert_declines(loop, *args, torch.empty_like(args[2]), pattern="kda", reason="did not create")


def test_state_updated_in_place_is_declined():
    def loop(q, k, v, g, beta, s):
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            s.mul_(g[:, t][..., None].exp())
            s.add_(torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s)))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    args = _inputs("bthk")
    h = torch.zeros(B, H, K, V)
    _, result = fuse(loop, *args, h)
    assert not [m for m in result.matches if m.pattern == "kda" and m.fused]
    got = loop(*args, h.clone())
    graphs, _ = fuse(loop, *args, h.clone())
    h2 = h.clone()
    torch.testing.assert_close(run_rewritten(graphs, *args, h2), got)


def test_float64_is_declined():
    args = _inputs("bhtk", dtype=torch.float64)
    assert_declines(blog_loop, *args, pattern="kda", reason="float64")


def test_reading_the_buffer_inside_the_loop_is_declined():
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.zeros_like(v)
        seen = []
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
            seen.append(o.sum())  # o half filled: the fused op would give the whole o here
        return o, torch.stack(seen)

    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="still filling it")


def test_dynamic_batch():
    args = _inputs("bthk")
    h0 = torch.randn(B, H, K, V)
    assert_fuses(fla_naive, *args, h0, 0.3, pattern="kda", dynamic=True, steps=T)


def _symbolic_batch_code(options: dict, base: list, train: bool, fn=scalar_gate_loop,
                         extra=lambda b: ()) -> tuple[list, str]:
    """``fn`` (default ``scalar_gate_loop``) compiled with ``backend="fuser"`` and ``options``, called
    at batch sizes 2, 3, 5, 4 of ``base`` (CUDA ``[1, T, H, *]`` inputs; v shifted per batch row;
    ``extra(b)``: more arguments for batch ``b``, not differentiated): Dynamo's
    automatic dynamic shapes recompile at the second with a symbolic batch. Each call equals eager
    (``train``: o, the state and the gradients of both; else under no_grad); the later sizes
    compile nothing, and the symbolic graph's code calls no opaque ``torch.ops.fuser`` op (its
    kernels launched by Inductor: the op's ``symbolic`` rule, codegen/launch.py ``fused_op``).
    Returns (the plans of the fused KDA matches, that graph's generated code)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    import fuser

    def step(f, xs, more):
        if not train:
            with torch.no_grad():
                return f(*xs, *more)
        o, s = f(*xs, *more)
        return (o, s, *torch.autograd.grad(o.square().sum() + s.sum(), xs))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fuser", options=options)
    codes_at = {}
    # Inductor's generated code of each call's compiles (torch's run_and_get_code resets Dynamo first;
    # the FX graph cache off: a cache hit would not show the code)
    with fuser.report.collecting() as rep, torch._inductor.config.patch(fx_graph_cache=False):
        for b in (2, 3, 5, 4):
            xs = [x[:1].expand(b, *x.shape[1:]).contiguous() for x in base]
            xs[2] = xs[2] + torch.arange(b, device="cuda").view(b, 1, 1, 1)
            xs = [x.requires_grad_(train) for x in xs]
            codes = []
            with mock.patch.object(GraphLowering, "save_output_code", codes.append):
                got = step(compiled, xs, extra(b))
            codes_at[b] = "\n".join(codes)
            want = step(fn, [x.detach().clone().requires_grad_(train) for x in xs], extra(b))
            for a, w in zip(got, want):
                _close(a, w, 2e-3)
    assert codes_at[5] == "" and codes_at[4] == "", "a later batch size recompiled"
    code = codes_at[3]  # the graph with the symbolic batch
    opaque = [line.strip() for line in code.splitlines() if "torch.ops.fuser" in line]
    assert not opaque, opaque[:4]
    return [m.plan.params["plan"] for m in rep.matches if m.pattern == "kda" and m.fused], code


@pytest.mark.gpu
@pytest.mark.parametrize("save", ["inputs", "workspaces"])
def test_a_dynamic_batch_keeps_the_kernels_inlined_on_gpu(save):
    """A training step whose batch changes: the chunk plan's forward and backward ops stay
    launched by Inductor with a symbolic batch (:func:`_symbolic_batch_code`)."""
    base = [x.cuda() for x in _inputs("bthk", t=70, k=32, v=48, scalar_gate=True)]
    plans, code = _symbolic_batch_code({"fuser.plan": f"kda.plan=chunk,kda.save={save}"}, base, train=True)
    assert plans == ["chunk", "chunk"]
    kernels = sorted({line.strip().split("(")[0] for line in code.splitlines() if line.strip().startswith("def kda_")})
    assert "def kda_chunk_prep_kernel" in kernels and any(k.startswith("def kda_bwd_") for k in kernels), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("kernels,k,v", [("split", 64, 200), ("fused", 32, 64), ("fused_h0", 32, 64)])
def test_a_dynamic_batch_keeps_the_parallel_plan_inlined_on_gpu(kernels, k, v):
    """Serving short sequences (T=8, under no_grad) whose batch changes: the parallel plan's
    kernels stay launched by Inductor with a symbolic batch (its config from K, V and T,
    ``codegen/kda_parallel._resolve``; :func:`_symbolic_batch_code`): the split kernels at V=200,
    the one-launch kernel at K=32, V=64 (its default there), with an initial state too (FLA's
    naive loop: no key split chosen from the batch)."""
    if kernels == "fused_h0":
        base = [x.cuda() for x in _inputs("bthk", t=8, k=k, v=v)]
        h0 = torch.randn(1, H, k, v, device="cuda")
        plans, code = _symbolic_batch_code({"fuser.plan": "kda.plan=parallel"}, base, train=False, fn=fla_naive,
                                           extra=lambda b: (h0.expand(b, -1, -1, -1).contiguous(), 0.3))
    else:
        base = [x.cuda() for x in _inputs("bthk", t=8, k=k, v=v, scalar_gate=True)]
        plans, code = _symbolic_batch_code({"fuser.plan": "kda.plan=parallel"}, base, train=False)
    assert plans == ["parallel", "parallel"]
    assert ("def kda_parallel_fused_kernel" in code) == (kernels != "split"), code[:2000]
    assert "def kda_parallel_" in code


def test_kda_layer_example():
    # the example a user copies: a naive KDA layer, one training step with backend="fuser", every
    # gradient compared with eager by the example itself
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "kda_layer.py")], capture_output=True,
                       text=True, timeout=1200, cwd=root, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "kda regions fused: 1" in r.stdout
    assert "one training step through the fused KDA loop matches eager" in r.stdout


@pytest.mark.parametrize("plan", ["recurrent", "chunk", "parallel"])
def test_each_plan_forced_matches_eager(plan):
    # T=40 (not a multiple of the chunk), K=20, V=36
    args = _inputs("bhtk", t=40, k=20, v=36)
    ms = assert_fuses(blog_loop, *args, pattern="kda", options={"fuser.plan": f"kda.plan={plan}"})
    assert ms[0].plan.params["plan"] == plan
    (o, s), _ = _run(blog_loop, *args)
    want_o, want_s = blog_loop(*args)
    _close(o, want_o)
    _close(s, want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 16])
def test_the_one_launch_parallel_kernel_compiled_matches_eager_on_gpu(t):
    """A small call (K=32, V=64, T <= 16) forced to the parallel plan: the table's default there is
    the one-launch kernel (codegen/kda_parallel ``FUSED``), launched by Inductor; with an initial
    state (FLA's naive reference) and without (the blog loop), o and the final state as eager's."""
    from torch._inductor.utils import run_and_get_code

    options = {"fuser.plan": "kda.plan=parallel"}
    args = [x.cuda() for x in _inputs("bhtk", t=t, k=32, v=64)]
    torch._dynamo.reset()
    (o, s), codes = run_and_get_code(torch.compile(blog_loop, backend="fuser", options=options), *args)
    want_o, want_s = blog_loop(*args)
    _close(o, want_o, 1e-4)
    _close(s, want_s, 1e-4)
    assert "def kda_parallel_fused_kernel" in "\n".join(codes)
    args = [x.cuda() for x in _inputs("bthk", t=t, k=32, v=64)]
    h0 = torch.randn(B, H, 32, 64, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(fla_naive, backend="fuser", options=options)
    (o, s), codes = run_and_get_code(compiled, *args, h0, 0.3)
    want_o, want_s = fla_naive(*args, h0, 0.3)
    _close(o, want_o, 1e-4)
    _close(s, want_s, 1e-4)
    assert "def kda_parallel_fused_kernel" in "\n".join(codes)


def test_planner_offers_chunk_up_to_k_256_and_parallel_up_to_t_64():
    _, small = fuse(blog_loop, *_inputs("bhtk", t=64, k=32, v=32))
    assert {c.params.get("plan") for c in small.matches[0].alternatives} == {"recurrent", "chunk", "parallel"}
    _, long = fuse(blog_loop, *_inputs("bhtk", t=70, k=32, v=32))  # past the parallel form's 64 steps
    assert {c.params.get("plan") for c in long.matches[0].alternatives} == {"recurrent", "chunk"}
    # at this size the token loop is the faster one as measured (H100, benchmarks/results/kda_plan_sweep.md:
    # N=2, T=64, K=64, V=128: recurrent 20.6 µs, chunk 54.6: two chunks cannot fill the GPU)
    assert long.matches[0].plan.params["plan"] == "recurrent"
    _, large = fuse(blog_loop, *_inputs("bhtk", t=3, k=300, v=8))
    assert {c.params.get("plan") for c in large.matches[0].alternatives} == {"recurrent", "parallel"}


# -- the chunk plan's dots: fuser.plan kda.output_precision / kda.dots ---------------------------

@pytest.mark.parametrize("forced,dots,precision", [
    (None, "float32", "ieee"),  # the interpreter's default: the state path's (IEEE)
    ("kda.output_precision=tf32", "float32", "tf32"),
    ("kda.output_precision=tf32x3", "float32", "tf32x3"),
    ("kda.dots=bfloat16", "bfloat16", "ieee"),
])
def test_the_chunk_plans_dots_forced_show_in_explain_and_in_the_kernels(forced, dots, precision):
    import fuser

    args = _inputs("bhtk", t=40, k=20, v=36)
    options = {"fuser.plan": "kda.plan=chunk" + (f",{forced}" if forced else "")}
    ms = assert_fuses(blog_loop, *args, pattern="kda", options=options)
    plan = ms[0].plan
    assert (plan.params["plan"], plan.params["dots"], plan.params["output_precision"]) == ("chunk", dots, precision)
    # the op gets what was forced (the default rule is applied when it runs)
    assert plan.params["plan_string"] == "plan=chunk;chunk=64" + (f";{forced.split('.')[1]}" if forced else "")
    # the interpreter's default config runs kernel 1's strips variant
    assert [k.name for k in ms[0].kernels] == [f"kda_chunk_prep_strips_c64_o{precision}_interp",
                                               f"kda_chunk_scan_c64_kb2_o{precision}_interp"]
    # the output-path dots (A_qk; Qg S, A_qk D) render the precision in, the state path's take INPUT_PRECISION
    prep, scan = (k.source.splitlines() for k in ms[0].kernels)

    def dot_lines(lines, start):
        got = [ln for ln in lines if ln.strip().startswith(start) and "tl.dot(" in ln]
        assert got, start
        return got
    output_path = dot_lines(prep, "acc_qk +=") + dot_lines(scan, "o +=")
    state_path = (dot_lines(prep, "acc_kk +=") + dot_lines(prep, "w =") + dot_lines(prep, "u =") + dot_lines(scan, "d -=")
                  + dot_lines(scan, "s0 ="))
    assert all(f'input_precision="{precision}"' in ln for ln in output_path)
    assert all("input_precision=INPUT_PRECISION" in ln for ln in state_path)
    text = str(fuser.explain(blog_loop, *args, options=options))
    if dots == "bfloat16":
        assert "bfloat16 dots (forced" in " ".join(text.split())
    else:
        assert f"output path {precision} ({'forced' if forced else 'Triton'}" in " ".join(text.split())
    (o, s), _ = _run_with(blog_loop, args, options)
    want_o, want_s = blog_loop(*args)
    tol = 3e-2 if dots == "bfloat16" else 2e-4  # bfloat16 dots: the interpreter rounds toward zero
    _close(o, want_o, tol)
    _close(s, want_s, tol)
    if dots == "bfloat16":  # they ran: float32 dots are ~1e-6 off eager here, bfloat16 ones ~1e-2
        assert _rel(s, want_s.double()) > 1e-3


def test_the_chunk_plans_dots_choices_name_their_valid_values():
    from fuser import FuserOptionError

    args = _inputs("bhtk", t=40, k=20, v=36)
    with pytest.raises(FuserOptionError, match="kda.output_precision takes one of: tf32, tf32x3, ieee"):
        fuse(blog_loop, *args, options={"fuser.plan": "kda.output_precision=fp16"})
    with pytest.raises(FuserOptionError, match="kda.dots takes one of: float32, bfloat16"):
        fuse(blog_loop, *args, options={"fuser.plan": "kda.dots=float16"})
    # TF32 on the output path with bfloat16 dots: every dot takes bfloat16 operands, nothing to force
    with pytest.raises(FuserOptionError, match=r"offers output_precision in \['ieee'\]"):
        fuse(blog_loop, *args, options={"fuser.plan": "kda.plan=chunk,kda.dots=bfloat16,kda.output_precision=tf32"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunk_estimate_counts_each_paths_products(dtype):
    # the cost model as on a GPU: state-path dots tf32x3 (3 TF32 products), output-path dots TF32 (1)
    # by default for a bfloat16 o, tf32x3 for a float32 o
    from fuser.codegen import kda_chunk
    from fuser.patterns import kda_plans

    _, result = fuse(fp32_state_loop, *_inputs("bhtk", dtype=dtype, t=70, k=32, v=32))
    m = result.matches[0]
    x = kda_plans.shapes(m)
    n, t, kd, vd = (x[s] for s in (kda_plans.N, kda_plans.T, kda_plans.KD, kda_plans.VD))
    out_f = kda_chunk.flops(n=n, t=t, k_dim=kd, v_dim=vd, path="output")
    state_f = kda_chunk.flops(n=n, t=t, k_dim=kd, v_dim=vd, path="state")
    assert out_f + state_f == kda_chunk.flops(n=n, t=t, k_dim=kd, v_dim=vd) and 0 < out_f < state_f

    def tf32_products(**kw):
        terms = kda_plans.cost_terms(m, "chunk", 64, **kw)
        assert set(terms["flops_by_kind"]) == {"tf32"}
        return int(terms["flops_by_kind"]["tf32"].subs(x))

    default = tf32_products()
    assert tf32_products(output_precision="tf32x3") == 3 * (out_f + state_f)
    assert tf32_products(output_precision="tf32") == 3 * state_f + out_f
    assert default == (3 * state_f + out_f if dtype == torch.bfloat16 else 3 * (out_f + state_f))
    chunk = next(c for c in m.alternatives if c.params.get("plan") == "chunk")
    assert int(chunk.cost["flops"].subs(x)) == default
    # IEEE output-path dots run on the FMA units: counted at that rate, the estimate higher
    ieee = kda_plans.cost_terms(m, "chunk", 64, output_precision="ieee")
    assert int(ieee["flops_by_kind"]["fp32"].subs(x)) == out_f
    # at a training size (B=1, T=4096, H=16, K=V=128) the dots bound the estimate: fewer products, less time
    model = kda_plans.cm.device_model(None, None)
    big = {kda_plans.N: 16, kda_plans.T: 4096, kda_plans.KD: 128, kda_plans.VD: 128}
    est = {p: kda_plans.estimate(kda_plans.cost_terms(m, "chunk", 64, output_precision=p), big, model, "bf16")
           for p in ("tf32", "tf32x3", "ieee")}
    assert est["tf32"] < est["tf32x3"] < est["ieee"], est


@pytest.mark.parametrize("n,t,k,v,graphs,want,measured", [
    # device µs on the H100 (benchmarks/results/kda_plan_sweep.md, kda_plan_sweep_t16.md: CUDA-graph
    # replays): recurrent / parallel / chunk; the default mode adds 4 µs of host time a launch (1 / 4 / 2)
    (2, 8, 512, 16384, False, "parallel", "98 / 47 / -"),      # the kernel blog's shape the old rates got wrong
    (2, 8, 8192, 1024, False, "parallel", "550 / 47 / -"),
    (2, 16, 64, 128, False, "recurrent", "6.7 / 17 / 54"),
    (2, 64, 256, 8192, False, "recurrent", "140 / 312 / 563"),  # the chunk plan's first kernel: two programs
    (2, 64, 128, 1024, False, "recurrent", "30 / 86 / 128"),
    (16, 4096, 128, 128, False, "chunk", "- / - / 854"),         # the training shape
    # the kernel blog's 256 x 8192 (T=8, B=1, H=2): the launches decide
    (2, 8, 256, 8192, False, "recurrent", "19.8 + 4 / 17.1 + 16"),
    (2, 8, 256, 8192, True, "parallel", "19.8 / 17.1 replayed"),
    # the parallel form's solve runs its T rows one after another (kda_plans.PARALLEL_STEPS_1_ROW_US)
    (2, 16, 256, 128, True, "recurrent", "9.9 / 14.7 replayed"),
    (2, 16, 256, 16384, True, "parallel", "65.6 / 31.4 replayed"),
])
def test_the_planner_picks_the_plan_measured_fastest(monkeypatch, n, t, k, v, graphs, want, measured):
    import types

    from fuser.codegen import launch
    from fuser.options import Options
    from fuser.patterns import kda_plans

    monkeypatch.setattr(launch, "device_properties",
                        lambda index: {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": (9, 0)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cands = kda_plans.candidates(kda_plans.stand_in_match(n, t, k, v),
                                 types.SimpleNamespace(options=Options(cuda_graphs=graphs)))
    est = {c.params.get("plan", c.name): c.estimate_ms for c in cands}
    assert min(est, key=est.get) == want, (est, measured)


def test_an_input_written_inside_the_loop_is_declined():
    def loop(q, k, v, g, beta):
        v = v.clone()
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
            if t + 1 < q.shape[1]:
                v[:, t + 1] *= 2  # later steps read the doubled values: one read before the loop cannot
        return o

    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="written in place")
    graphs, _ = fuse(loop, *_inputs("bthk"))
    _close(run_rewritten(graphs, *_inputs("bthk")), loop(*_inputs("bthk")))


def test_one_loop_feeding_the_next():
    # the second loop's v is the first loop's o: the second match was found before the first
    # output was replaced (two layers of a model written without projections between them)
    def two(q, k, v, g, beta):
        o1, s1 = blog_loop(q, k, v, g, beta)
        o2, s2 = blog_loop(q * 0.5, k, o1, g, beta)
        return o2, s1 + s2

    args = _inputs("bhtk")
    assert_fuses(two, *args, pattern="kda", count=2)
    got, _ = _run(two, *args)
    for a, b in zip(got, two(*args)):
        _close(a, b)


def test_a_grad_mode_switch_inside_the_loop_is_declined():
    # eager records no gradient through the first two steps; one fused op would record all of them
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.zeros_like(v)
        for t in range(q.shape[1]):
            with torch.set_grad_enabled(t >= 2):
                s = s * g[:, t][..., None].exp()
                s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                     v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
                o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    args = [x.requires_grad_(True) for x in _inputs("bthk")]
    assert_declines(loop, *args, pattern="kda", reason="partly with gradients on and partly off")
    o, _ = _run(loop, *args)
    grads = torch.autograd.grad(o.square().sum(), args, allow_unused=True)
    ref = [x.detach().clone().requires_grad_(True) for x in args]
    want = torch.autograd.grad(loop(*ref).square().sum(), ref, allow_unused=True)
    for a, b in zip(grads, want):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a, b, 1e-5)


def test_a_buffer_longer_than_the_loop_is_declined():
    # o has one more time step than the loop writes: its last row keeps the zeros the op would lose
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = v.new_zeros(v.shape[0], v.shape[1] + 1, *v.shape[2:])
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    args = _inputs("bthk")
    assert_declines(loop, *args, pattern="kda", reason="fills completely")
    got, _ = _run(loop, *args)
    _close(got, loop(*args))


def test_a_buffer_with_a_symbolic_time_axis_is_declined():
    # found by the KDA fuzzer: recompiled under dynamic shapes at a second length, Dynamo
    # specialises q's time axis (range(T)) but gives v its own symbol, so o = zeros_like(v) may be
    # longer than the loop in calls the graph serves; the pattern took the example's length for
    # it, and the pass's last shape check caught the rewrite ("internal error", a FuserWarning)
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.zeros_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o

    args = _inputs("bthk")
    torch._dynamo.mark_dynamic(args[2], 1)  # what the recompile does to v's time axis
    graphs, result = fuse(loop, *args)
    assert not [m for m in result.matches if m.pattern == "kda" and m.fused]
    reasons = [r.reason for r in result.rejected if r.pattern == "kda"]
    assert reasons and all("internal error" not in r for r in reasons), reasons
    assert any("symbolic" in r for r in reasons), reasons
    _close(run_rewritten(graphs, *args), loop(*args))
    # and the stack spelling, whose output is exactly the loop's steps, is still fused
    def stacked(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        outs = []
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
        return torch.stack(outs, 1)

    args = _inputs("bthk")
    torch._dynamo.mark_dynamic(args[2], 1)
    graphs, result = fuse(stacked, *args)
    assert [m for m in result.matches if m.pattern == "kda" and m.fused], result.rejected
    _close(run_rewritten(graphs, *args), stacked(*args))


# -- a state kept in half precision ----------------------------------------------------------------

def half_state_loop(q, k, v, g, beta):
    """Everything in the inputs' dtype, the state too: eager rounds it to float16 every step."""
    b, h, t_len, kd = q.shape
    s = q.new_zeros(b, h, kd, v.shape[-1])
    o = torch.empty_like(v)
    for t in range(t_len):
        s = s * g[:, :, t][..., None].exp()
        v_hat = (k[:, :, t][..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, :, t][..., None] * k[:, :, t], v[:, :, t] - v_hat)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t] * kd ** -0.5, s)
    return o, s


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("t_len,plan", [(8, None), (64, None), (64, "parallel"), (8, "chunk"), (100, "chunk")])
def test_a_half_precision_state_is_fused_closer_to_the_exact_result_than_eager(t_len, plan):
    # fuser carries the state in float32 where eager rounds it every step: the fused result may
    # differ from eager's, so it must be at least as close as eager's to the same program in float64
    # (o and the final state, several seeds). The chunk plan with its float32 dots is offered (with
    # bfloat16 dots it was not: float16 inputs, T=64, o 1.6e-2 against eager's 5.7e-4)
    options = {"fuser.plan": f"kda.plan={plan}"} if plan else None
    for seed in range(3):
        args = _inputs("bhtk", dtype=torch.float16, t=t_len, seed=seed)
        ms = assert_fuses(half_state_loop, *args, pattern="kda", options=options)
        assert "carried in float32" in ms[0].summary["state"]
        assert "chunk" in {c.params.get("plan") for c in ms[0].alternatives}
        assert ms[0].plan.params["plan"] == (plan or ms[0].plan.params["plan"])
        (o, s), _ = _run_with(half_state_loop, args, options)
        eo, es = half_state_loop(*args)
        wo, ws = half_state_loop(*(x.double() for x in args))
        assert o.dtype == s.dtype == torch.float16
        for got, own, want in ((o, eo, wo), (s, es, ws)):
            assert _rel(got, want) <= _rel(own, want), (seed, _rel(got, want), _rel(own, want))


def _run_with(fn, args, options):
    graphs, result = fuse(fn, *args, options=options)
    return run_rewritten(graphs, *args), result


@pytest.mark.parametrize("plan,shape,reason", [
    ("kda.plan=parallel", dict(t=70), r"offers plan in \['chunk', 'recurrent'\]: the parallel form runs .* at most 64 "
                                      r"steps; this loop has 70"),
    ("kda.plan=chunk", dict(k=300), r"offers plan in \['parallel', 'recurrent'\]: the chunked kernels take a key dim "
                                    r"K ≤ 256; this state has K = 300"),
])
def test_forcing_a_plan_these_sizes_do_not_allow_says_why(plan, shape, reason):
    from fuser import FuserOptionError

    with pytest.raises(FuserOptionError, match=reason):
        fuse(blog_loop, *_inputs("bhtk", **shape), options={"fuser.plan": plan})


def test_forcing_bfloat16_chunk_dots_on_a_half_precision_state_names_the_plans_offered():
    from fuser import FuserOptionError

    with pytest.raises(FuserOptionError, match="recurrent.*keeps its state in float16"):
        fuse(half_state_loop, *_inputs("bhtk", dtype=torch.float16, t=8),
             options={"fuser.plan": "kda.plan=chunk,kda.dots=bfloat16"})


def fp32_state_loop(q, k, v, g, beta):
    """FLA's naive loop in [B, H, T, K]: a float32 state, each step's 16-bit slices upcast (eager:
    float32 products, only o rounded to the inputs' dtype)."""
    b, h, t_len, kd = q.shape
    s = q.new_zeros(b, h, kd, v.shape[-1], dtype=torch.float32)
    o = torch.empty_like(v)
    for t in range(t_len):
        q_t, k_t, v_t = q[:, :, t].float(), k[:, :, t].float(), v[:, :, t].float()
        s = s * g[:, :, t].float()[..., None].exp()
        v_hat = (k_t[..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, :, t].float()[..., None] * k_t, v_t - v_hat)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q_t * kd ** -0.5, s)
    return o, s


def _chunk_plan_against_eager(dtype, t_len, device="cpu"):
    """The chunk plan (forced) on ``fp32_state_loop`` with ``dtype`` inputs: errors of o and of the
    final state against the same recurrence in float64, fused and eager."""
    args = tuple(x.to(device) for x in _inputs("bhtk", dtype=dtype, t=t_len, k=32, v=32))
    options = {"fuser.plan": "kda.plan=chunk"}
    (o, s), result = _run_with(fp32_state_loop, args, options)
    assert [m.plan.params["plan"] for m in result.matches if m.pattern == "kda" and m.fused] == ["chunk"]
    eo, es = fp32_state_loop(*args)
    wo, ws = half_state_loop(*(x.double() for x in args))  # the same recurrence in float64
    assert o.dtype == dtype and s.dtype == torch.float32
    return (_rel(o, wo), _rel(eo, wo)), (_rel(s, ws), _rel(es, ws))


# issue 10: with bfloat16 dot operands the chunk plan was 20x (float16) / 2.5x (bfloat16) eager's
# error on o and 1e5x on the state (H100, T=64); its dots take float32 operands now
# (codegen/kda_chunk.workspace_dtype). Criterion: within 2x of eager's own error, o and state.
@pytest.mark.parametrize("t_len", [64, 100])  # one chunk; two, the second partial
def test_the_chunk_plan_with_half_inputs_is_as_close_as_eager(t_len):
    for got, own in _chunk_plan_against_eager(torch.float16, t_len):
        assert got <= 2 * own, (t_len, got, own)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("t_len", [64, 100, 200])
def test_the_chunk_plan_with_half_inputs_is_as_close_as_eager_on_gpu(dtype, t_len):
    # compiled kernels (float32 dots as tf32x3) and Inductor's compiled loop around them; eager on
    # the GPU (IEEE float32 einsums). bfloat16 only here: the interpreter rounds o to bfloat16
    # toward zero (twice the GPU's rounding error). Bound 3x: tf32x3 is not IEEE float32; measured
    # on the H100 (torch 2.11, Triton 3.6) the final state 1.18-1.26e-7 against eager's 5.7-5.8e-8
    # (2.0-2.2x; bfloat16 dots were 1e5x), o within 2x. Since then the output-path dots (A_qk, Qg S,
    # A_qk D) of a bfloat16 o run as single-pass TF32 (codegen/kda_chunk.resolve_output_precision;
    # predicted 1.03x eager's o error, NOT MEASURED yet); a float16 o keeps tf32x3
    for got, own in _chunk_plan_against_eager(dtype, t_len, device="cuda"):
        assert got <= 3 * own, (dtype, t_len, got, own)


def _negative_index_loop(lo, hi, shift):
    """A loop over range(lo, hi) reading time index t + shift (negative indices count from the end)."""
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        outs = []
        for t in range(lo, hi):
            i = t + shift
            s = s * g[:, i][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, i][..., None] * k[:, i],
                                 v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], s))
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], s))
        return torch.stack(outs, 1), s
    return loop


@pytest.mark.parametrize("lo,hi,shift", [(0, T, -T), (2, T, -T), (-T, 0, 0)])
def test_negative_time_indices_are_fused(lo, hi, shift):
    # x[:, t - T]: the same time steps as x[:, t]
    loop = _negative_index_loop(lo, hi, shift)
    ms = assert_fuses(loop, *_inputs("bthk"), pattern="kda", steps=hi - lo)
    assert ms[0].bindings["t0"] == lo + shift + T
    got, _ = _run(loop, *_inputs("bthk"))
    for a, b in zip(got, loop(*_inputs("bthk"))):
        _close(a, b)


def test_time_indices_wrapping_around_zero_are_declined():
    # found by hand after the fuzzer: range(-2, 3) reads steps T-2, T-1, 0, 1, 2 — consecutive
    # integers, but not consecutive time steps; fused as one run from -2 it raised at run time
    loop = _negative_index_loop(-2, 3, 0)
    assert_declines(loop, *_inputs("bthk"), pattern="kda", reason="time index")
    got, _ = _run(loop, *_inputs("bthk"))
    for a, b in zip(got, loop(*_inputs("bthk"))):
        _close(a, b)


def test_negative_time_indices_into_a_buffer_are_fused():
    def loop(q, k, v, g, beta):
        s = q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])
        o = torch.zeros_like(v)
        n = q.shape[1]
        for t in range(n):
            i = t - n
            s = s * g[:, i][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, i][..., None] * k[:, i],
                                 v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], s))
            o[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], s)
        return o

    _check(loop, *_inputs("bthk"), steps=T, assembly="index writes into a buffer")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("t_len", [64, 200])
def test_a_half_precision_state_with_the_chunk_plan_on_gpu(dtype, t_len):
    """The chunk plan (tf32x3 state path; single-pass TF32 output path for a bfloat16 o) on a
    loop that keeps its state in the inputs' half dtype: compiled on the GPU, o and the final
    state at least as close to the float64 recurrence as eager's (which rounds the state every
    step)."""
    import fuser

    options = {"fuser.plan": "kda.plan=chunk"}
    for seed in range(2):
        args = tuple(x.cuda() for x in _inputs("bhtk", dtype=dtype, t=t_len, k=64, v=64, seed=seed))
        torch._dynamo.reset()
        with fuser.report.collecting() as rep:
            o, s = torch.compile(half_state_loop, backend="fuser", options=options)(*args)
        assert [m.plan.params["plan"] for m in rep.matches if m.pattern == "kda" and m.fused] == ["chunk"]
        eo, es = half_state_loop(*args)
        wo, ws = half_state_loop(*(x.double() for x in args))
        for got, own, want in ((o, eo, wo), (s, es, ws)):
            assert _rel(got, want) <= _rel(own, want), (seed, _rel(got, want), _rel(own, want))
