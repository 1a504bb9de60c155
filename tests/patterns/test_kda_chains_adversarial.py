"""Adversarial programs for KDA loops that hand the state on (one op per loop: the chain ends
where the next step does not read the next time step of the same gate tensor and writes its
outputs elsewhere; patterns/kda.py ``_continues_another_loop``).

Each program is compared with eager PyTorch in float64 (forward and, where marked, gradients).
The last group are the findings of the adversarial review of the first version of the split (a
second loop after ``s = s * 2`` left unfused, two loops continuing one state, a gate changing
within one loop split into one-step chains, a follower's near-miss declining the loop before
it, loops over the same gate tensor, a loop whose q is an earlier loop's output), each fixed.
Shapes are tiny: the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from fuser.testing import fuse, run_rewritten
from test_kda import B, H, K, T, V, _inputs, _segment, blog_loop, two_segments


def _zeros(q, v):
    return q.new_zeros(q.shape[0], q.shape[2], q.shape[-1], v.shape[-1])


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for e in x for t in _flat(e)]


def _err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _fused(result):
    return [m for m in result.matches if m.pattern == "kda" and m.fused]


def _kda_rejections(result):
    return [r for r in result.rejected if r.pattern == "kda"]


def _run_and_compare(fn, args, *, train=False, dynamic=None, tol=2e-4, gtol=1e-3):
    """Fuse ``fn``, run the rewritten graph and compare it (and its gradients when ``train``) with
    ``fn`` run eagerly in float64. Returns the pass result."""
    args = [x.clone().requires_grad_(train) for x in args]
    graphs, result = fuse(fn, *args, dynamic=dynamic)
    got = _flat(run_rewritten(graphs, *args))
    ref = [x.detach().double().requires_grad_(train) for x in args]
    want = _flat(fn(*ref))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"output {i}: {tuple(a.shape)} != {tuple(b.shape)}"
        assert _err(a, b) < tol, f"output {i}: relative error {_err(a, b):.3g}"
    if train:
        gen = torch.Generator().manual_seed(7)
        pairs = [(a, b) for a, b in zip(got, want) if b.requires_grad]
        gw = [torch.randn(b.shape, generator=gen, dtype=torch.float64) for _, b in pairs]
        dg = torch.autograd.grad([a for a, _ in pairs], args, [x.to(a.dtype) for x, (a, _) in zip(gw, pairs)],
                                 allow_unused=True)
        dw = torch.autograd.grad([b for _, b in pairs], ref, gw, allow_unused=True)
        for i, (a, b) in enumerate(zip(dg, dw)):
            assert (a is None) == (b is None), f"gradient {i}: fused {a is None and 'None'}, eager {b is None and 'None'}"
            if a is not None:
                assert _err(a, b) < gtol, f"gradient {i}: relative error {_err(a, b):.3g}"
    return result


A1 = _inputs("bthk")  # T = 5 steps
A2 = _inputs("bthk", seed=1, t=3)  # 3 steps, other tensors
A3 = _inputs("bthk", seed=2, t=4)


# ------------------------------------------------------------------------------------------------
# regressions: what the split gets right
# ------------------------------------------------------------------------------------------------

def test_a_single_blog_loop_is_still_exactly_one_match():
    args = _inputs("bhtk")
    result = _run_and_compare(blog_loop, args)
    fused = _fused(result)
    assert [m.summary["steps"] for m in fused] == [T] and not _kda_rejections(result)
    assert fused[0].summary["initial_state"] == "zeros" and fused[0].summary["outputs"] == "o, state"


def three_segments(q, k, v, g, beta, q2, k2, v2, g2, beta2, q3, k3, v3, g3, beta3):
    s = _zeros(q, v)
    o1, s = _segment(s, q, k, v, g, beta)
    o2, s = _segment(s, q2, k2, v2, g2, beta2)
    o3, s = _segment(s, q3, k3, v3, g3, beta3)
    return o1, o2, o3, s


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_three_loops_chained_are_three_matches(train):
    result = _run_and_compare(three_segments, A1 + A2 + A3, train=train)
    fused = _fused(result)
    assert [m.summary["steps"] for m in fused] == [T, 3, 4] and not _kda_rejections(result)
    assert [m.summary["initial_state"] for m in fused] == ["zeros", "s", "s"]


def test_a_third_loop_over_the_first_loops_tensors_again():
    # the gate tensor changes g -> g2 -> g: the third loop is a chain of its own, its time index from 0
    def aba(q, k, v, g, beta, q2, k2, v2, g2, beta2):
        s = _zeros(q, v)
        o1, s = _segment(s, q, k, v, g, beta)
        o2, s = _segment(s, q2, k2, v2, g2, beta2)
        o3, s = _segment(s, q, k, v, g, beta)
        return o1, o2, o3, s

    result = _run_and_compare(aba, A1 + A2)
    assert [m.summary["steps"] for m in _fused(result)] == [T, 3, T]


def test_the_first_loops_final_state_returned_too():
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2):
        o1, s1 = _segment(_zeros(q, v), q, k, v, g, beta)
        o2, s2 = _segment(s1, q2, k2, v2, g2, beta2)
        return o1, o2, s1, s2

    result = _run_and_compare(fn, A1 + A2, train=True)
    assert [m.summary["outputs"] for m in _fused(result)] == ["o, state", "o, state"]


@pytest.mark.parametrize("between", ["detach", "clone"])
def test_a_detached_or_cloned_state_between_the_loops(between):
    # detach: the gradients of the first loop's inputs must not see the second loop
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        s = s.detach() if between == "detach" else s.clone()
        o2, s = _segment(s, q2, k2, v2, g2, beta2)
        return o1, o2, s

    result = _run_and_compare(fn, A1 + A2, train=True)
    assert len(_fused(result)) == 2


@pytest.mark.parametrize("which", [1, 2])
def test_no_grad_around_one_of_the_loops(which):
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2):
        s = _zeros(q, v)
        with torch.set_grad_enabled(which != 1):
            o1, s = _segment(s, q, k, v, g, beta)
        with torch.set_grad_enabled(which != 2):
            o2, s = _segment(s, q2, k2, v2, g2, beta2)
        return o1, o2, s

    result = _run_and_compare(fn, A1 + A2, train=True)
    assert len(_fused(result)) == 2


def test_an_initial_state_from_the_caller_then_a_second_loop():
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2, s0):
        o1, s = _segment(s0, q, k, v, g, beta)
        o2, s = _segment(s, q2, k2, v2, g2, beta2)
        return o1, o2, s

    s0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(3)) * 0.3
    result = _run_and_compare(fn, A1 + A2 + (s0,), train=True)
    assert [m.summary["initial_state"] for m in _fused(result)] == ["s0", "s"]


@pytest.mark.parametrize("t2", [1, 3], ids=["decode_step", "prefill_chunk"])
def test_dynamic_shapes(t2):
    # dynamic=True; t2 = 1: a one-token loop after a prefill loop (a decode step continuing the state)
    result = _run_and_compare(two_segments, A1 + _inputs("bthk", seed=1, t=t2), dynamic=True, train=True)
    assert [m.summary["steps"] for m in _fused(result)] == [T, t2]


def test_second_loop_stacks_in_another_layout_with_a_scale():
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2):  # the second loop's inputs [B, H, T, *]
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        outs = []
        for t in range(q2.shape[2]):
            s = s * g2[:, :, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta2[:, :, t][..., None] * k2[:, :, t],
                                 v2[:, :, t] - torch.einsum("bhk,bhkv->bhv", k2[:, :, t], s))
            outs.append(torch.einsum("bhk,bhkv->bhv", q2[:, :, t], s) * 0.25)
        return o1, torch.stack(outs, 2), s

    result = _run_and_compare(fn, A1 + _inputs("bhtk", seed=1, t=4), train=True)
    fused = _fused(result)
    assert [m.summary["assembly"] for m in fused] == ["index writes into a buffer", "torch.stack"]
    assert fused[1].summary["scale"] == "0.25"


def test_second_loop_with_a_scalar_gate():
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        o2 = torch.empty_like(v2)
        for t in range(q2.shape[1]):
            s = s * g2[:, t].exp()[..., None, None]
            s = s + torch.einsum("bhk,bhv->bhkv", beta2[:, t][..., None] * k2[:, t],
                                 v2[:, t] - torch.einsum("bhk,bhkv->bhv", k2[:, t], s))
            o2[:, t] = torch.einsum("bhk,bhkv->bhv", q2[:, t], s)
        return o1, o2, s

    result = _run_and_compare(fn, A1 + _inputs("bthk", seed=1, t=3, scalar_gate=True), train=True)
    assert [m.summary["gate"] for m in _fused(result)] == ["per key channel", "scalar per head"]


def test_the_same_q_k_v_with_another_gate():
    def fn(q, k, v, g, beta, g2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        o2, s = _segment(s, q, k, v, g2, beta)
        return o1, o2, s

    result = _run_and_compare(fn, A1 + (_inputs("bthk", seed=4)[3],), train=True)
    assert [m.summary["g"] for m in _fused(result)] == ["g", "g2"]


def test_slices_of_one_sequence():
    def fn(q, k, v, g, beta):
        o1, s = _segment(_zeros(q, v), q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3])
        o2, s = _segment(s, q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], beta[:, 3:])
        return torch.cat([o1, o2], 1), s

    result = _run_and_compare(fn, A1, train=True)
    assert [m.summary["steps"] for m in _fused(result)] == [3, T - 3]


def test_the_second_loop_reads_the_first_loops_output_as_v():
    def fn(q, k, v, g, beta, q2, k2, g2, beta2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        o2, s = _segment(s, q2, k2, o1, g2, beta2)
        return o1, o2, s

    a2 = _inputs("bthk", seed=1)
    result = _run_and_compare(fn, A1 + (a2[0], a2[1], a2[3], a2[4]), train=True)
    assert len(_fused(result)) == 2


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_the_second_loop_overwrites_the_first_loops_buffer(train):
    # both loops write one buffer, the second over the first: one chain of 2T steps whose writes
    # restart at index 0, declined ("step 5 differs") (nothing fused; the values are eager's)
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2):
        s = _zeros(q, v)
        o = torch.empty_like(v)
        for qq, kk, vv, gg, bb in ((q, k, v, g, beta), (q2, k2, v2, g2, beta2)):
            for t in range(qq.shape[1]):
                s = s * gg[:, t][..., None].exp()
                s = s + torch.einsum("bhk,bhv->bhkv", bb[:, t][..., None] * kk[:, t],
                                     vv[:, t] - torch.einsum("bhk,bhkv->bhv", kk[:, t], s))
                o[:, t] = torch.einsum("bhk,bhkv->bhv", qq[:, t], s)
        return o, s

    result = _run_and_compare(fn, A1 + _inputs("bthk", seed=1), train=train)
    assert not _fused(result)
    assert any("step 5 of the loop differs" in r.reason for r in _kda_rejections(result)), \
        [r.reason for r in _kda_rejections(result)]


def test_a_half_precision_state_handed_on_is_closer_to_exact_than_eager():
    args = _inputs("bthk", dtype=torch.float16) + _inputs("bthk", seed=1, t=3, dtype=torch.float16)
    graphs, result = fuse(two_segments, *args)
    assert len(_fused(result)) == 2
    got = _flat(run_rewritten(graphs, *args))
    eager = _flat(two_segments(*args))
    exact = _flat(two_segments(*[x.double() for x in args]))
    for a, e, x in zip(got, eager, exact):
        assert a.dtype == e.dtype == torch.float16
        assert _err(a, x) <= 1.2 * _err(e, x) + 1e-5


def gate_switch_mid_loop(q, k, v, g, g2, beta):
    """One loop over one q/k/v/β whose gate tensor changes after two steps, each part stacked apart:
    two chains, the second from time index 2 (t0 != 0) with the first's state as h0."""
    s = _zeros(q, v)
    oa, ob = [], []
    for t in range(q.shape[1]):
        s = s * (g if t < 2 else g2)[:, t][..., None].exp()
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                             v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
        (oa if t < 2 else ob).append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(oa, 1), torch.stack(ob, 1), s


@pytest.mark.parametrize("plan", ["kda.plan=recurrent", "kda.plan=parallel", "kda.plan=chunk",
                                  "kda.plan=chunk,kda.save=workspaces"])
@pytest.mark.parametrize("program", ["two_segments", "gate_switch_mid_loop"])
def test_chains_under_every_plan_with_gradients(program, plan):
    fn = two_segments if program == "two_segments" else gate_switch_mid_loop
    q, k, v, g, beta = A1
    args = A1 + A2 if program == "two_segments" else (q, k, v, g, _inputs("bthk", seed=3)[3], beta)
    args = [x.clone().requires_grad_() for x in args]
    graphs, result = fuse(fn, *args, options={"fuser.plan": plan})
    want_steps = [T, 3] if program == "two_segments" else [2, T - 2]
    assert [m.summary["steps"] for m in _fused(result)] == want_steps
    got = _flat(run_rewritten(graphs, *args))
    ref = [x.detach().double().requires_grad_() for x in args]
    want = _flat(fn(*ref))
    for a, b in zip(got, want):
        assert _err(a, b) < 2e-4
    gw = [torch.randn(b.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
          for i, b in enumerate(want)]
    for a, b in zip(torch.autograd.grad(got, args, [x.float() for x in gw]), torch.autograd.grad(want, ref, gw)):
        assert _err(a, b) < 1e-3


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_first_loop_left_unfused_hands_its_state_to_a_fused_second(train):
    # the first loop is a near-miss (β computed inside it): the second is fused, its h0 the eager state
    def fn(q, k, v, g, b, q2, k2, v2, g2, beta2):
        s = _zeros(q, v)
        o1 = torch.empty_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t][..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", b[:, t].sigmoid()[..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o1[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        o2, s = _segment(s, q2, k2, v2, g2, beta2)
        return o1, o2, s

    result = _run_and_compare(fn, A1 + A2, train=train)
    assert [m.summary["steps"] for m in _fused(result)] == [3]
    assert any("β_t" in r.reason for r in _kda_rejections(result))


# ------------------------------------------------------------------------------------------------
# the review's findings, fixed: each asserts the intended behaviour after checking eager's values
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("between", ["s * 2", "s.mul_(2)", "s * mask"])
def test_a_state_scaled_between_the_loops(between):
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2, mask):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        if between == "s * 2":
            s = s * 2
        elif between == "s.mul_(2)":
            s.mul_(2)
        else:
            s = s * mask
        o2, s = _segment(s, q2, k2, v2, g2, beta2)
        return o1, o2, s

    mask = torch.rand(B, H, 1, 1, generator=torch.Generator().manual_seed(5))
    result = _run_and_compare(fn, A1 + A2 + (mask,))
    assert [m.summary["steps"] for m in _fused(result)] == [T, 3]


def test_two_loops_continuing_the_same_state():
    def fn(q, k, v, g, beta, q2, k2, v2, g2, beta2, q3, k3, v3, g3, beta3):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        o2, s2 = _segment(s, q2, k2, v2, g2, beta2)
        o3, s3 = _segment(s, q3, k3, v3, g3, beta3)
        return o1, o2, o3, s2, s3

    result = _run_and_compare(fn, A1 + A2 + A3, train=True)
    assert [m.summary["steps"] for m in _fused(result)] == [T, 3, 4]


@pytest.mark.parametrize("spelling", ["alternating", "cast_inside"])
def test_a_gate_read_from_another_tensor_at_every_step_names_the_gate(spelling):
    def fn(q, k, v, g, g2, beta):
        s = _zeros(q, v)
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            gt = (g if t % 2 == 0 else g2)[:, t] if spelling == "alternating" else g.float()[:, t]
            s = s * gt[..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t],
                                 v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        return o, s

    # one loop, the gate tensor another at every step: nothing may be fused (each step alone writes
    # one index of the buffer), the program's values are kept, and one near-miss names the gate
    q, k, v, g, beta = A1
    result = _run_and_compare(fn, (q, k, v, g, _inputs("bthk", seed=3)[3], beta))
    rej = _kda_rejections(result)
    assert not _fused(result)
    assert any("reads g from" in r.reason for r in rej) and len(rej) == 1, [r.reason for r in rej]


@pytest.mark.parametrize("follower", ["beta_inside", "subtracted", "decode_step"])
def test_a_near_miss_after_a_loop_leaves_that_loop_fused(follower):
    def fn(q, k, v, g, beta, q2, k2, v2, g2, b2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        if follower == "decode_step":  # one token, its inputs [B, H, *]
            s = s * g2[..., None].exp()
            s = s + torch.einsum("bhk,bhv->bhkv", b2[..., None] * k2, v2 - torch.einsum("bhk,bhkv->bhv", k2, s))
            return o1, torch.einsum("bhk,bhkv->bhv", q2, s), s
        o2 = torch.empty_like(v2)
        for t in range(q2.shape[1]):
            s = s * g2[:, t][..., None].exp()
            bt = b2[:, t].sigmoid() if follower == "beta_inside" else b2[:, t]
            u = torch.einsum("bhk,bhv->bhkv", bt[..., None] * k2[:, t],
                             v2[:, t] - torch.einsum("bhk,bhkv->bhv", k2[:, t], s))
            s = s + u if follower == "beta_inside" else s - u
            o2[:, t] = torch.einsum("bhk,bhkv->bhv", q2[:, t], s)
        return o1, o2, s

    a2 = tuple(x[:, 0] for x in A2) if follower == "decode_step" else A2
    result = _run_and_compare(fn, A1 + a2)
    assert [m.summary["steps"] for m in _fused(result)] == [T], [r.reason for r in _kda_rejections(result)]
    assert not any(r.reason.startswith("step 5 of the loop") for r in _kda_rejections(result))


@pytest.mark.parametrize("second", ["same_g_other_qkv", "same_tensors"])
def test_two_loops_sharing_the_gate_tensor(second):
    def fn(q, k, v, g, beta, q2, k2, v2, beta2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        if second == "same_tensors":
            q2, k2, v2, beta2 = q, k, v, beta
        o2, s = _segment(s, q2, k2, v2, g, beta2)
        return o1, o2, s

    a2 = _inputs("bthk", seed=1)
    result = _run_and_compare(fn, A1 + (a2[0], a2[1], a2[2], a2[4]))
    assert [m.summary["steps"] for m in _fused(result)] == [T, T]


@pytest.mark.parametrize("chained", [True, False], ids=["state_handed_on", "own_state"])
def test_a_loop_whose_q_is_computed_from_the_previous_loops_output(chained):
    def fn(q, k, v, g, beta, k2, v2, g2, beta2):
        o1, s = _segment(_zeros(q, v), q, k, v, g, beta)
        o2, s2 = _segment(s if chained else _zeros(q, v), o1[..., :q.shape[-1]] * 0.5, k2, v2, g2, beta2)
        return o1, o2, s2

    a2 = _inputs("bthk", seed=1)
    result = _run_and_compare(fn, A1 + a2[1:])
    assert len(_fused(result)) == 2, [r.reason for r in _kda_rejections(result)]
