"""The H2O pattern: spellings matched with their bindings, near-misses declined with their
reasons, and compiled results against float64 eager (CPU, Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser import testing

B, H, N, D = 1, 4, 37, 16


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, N, D, generator=g) for _ in range(3))


def _rep_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def scores_and_out(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * (q.size(-1) ** -0.5), dim=-1)
    return p @ v, p.sum(-2)


def score_only(q, k):
    # a prefill eviction scorer: no P V
    p = F.softmax(torch.matmul(q, k.transpose(2, 3)) / 4.0, dim=-1)
    return p.sum(dim=2)


def causal_fp32_softmax(q, k, v):
    # the HF eager spelling patched the H2O way: fp32 softmax cast back, then the column sum
    n = q.size(-2)
    s = q @ k.transpose(-2, -1) * 0.25
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=s.device), 1), float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v, p.sum(-2)


def padding(q, k, v, keep):
    s = (q @ k.transpose(-2, -1)) * 0.25
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return p @ v, p.sum(-2)


def additive_padding(q, k, v, bias):
    # transformers' eager path: a float mask with finfo.min on padded keys, added to the scores
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, -1)
    return p @ v, p.sum(-2)


def _bias():
    bias = torch.zeros(B, 1, 1, N)
    bias[..., N - 9:] = torch.finfo(torch.float32).min
    return bias


def bmm_layout(q, k, v):
    # FlexGen/OPT: [B·H, N, D] operands through bmm, the score summed with torch.sum(P, 1)
    q3, k3, v3 = (t.reshape(B * H, N, D) for t in (q, k, v))
    p = torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) * 0.25, dim=-1)
    return torch.bmm(p, v3), torch.sum(p, 1)


def gqa(q, k, v):
    k2, v2 = _rep_kv(k[:, :2], 2), _rep_kv(v[:, :2], 2)
    p = torch.softmax(q @ k2.transpose(-2, -1) * 0.25, -1)
    return p @ v2, p.sum(-2)


def gated(q, k, v, w):
    # the score is used before P V is computed: the replacement goes before that reader
    p = torch.softmax(q @ k.mT * 0.25, -1)
    score = p.sum(-2) * w
    return p @ v, score


def _keep():
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[..., N - 9:] = False
    return keep


CASES = [
    ("scores_and_out", scores_and_out, lambda q, k, v: (q, k, v), dict(outputs="out, score")),
    ("score_only", score_only, lambda q, k, v: (q, k), dict(outputs="score", scale=0.25)),
    ("causal_fp32_softmax", causal_fp32_softmax, lambda q, k, v: (q, k, v), dict(causal="top_left")),
    ("padding", padding, lambda q, k, v: (q, k, v, _keep()), dict(mask="bool_drop")),
    ("additive_padding", additive_padding, lambda q, k, v: (q, k, v, _bias()), dict(mask="additive")),
    ("gqa", gqa, lambda q, k, v: (q, k, v), dict(gqa_group=2)),
    ("bmm_layout", bmm_layout, lambda q, k, v: (q, k, v), dict(outputs="out, score")),
    ("gated", gated, lambda q, k, v: (q, k, v, torch.randn(B, H, N)), {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_spellings_fuse_and_match_eager(case, qkv):
    _, fn, make, expected = case
    args = make(*qkv)
    with torch.no_grad():
        testing.assert_fuses(fn, *args, pattern="h2o", **{k: v for k, v in expected.items() if k != "mask"})
        rep = fuser.explain(fn, *args)
        # attention declined the softmax (P also feeds the sum); the report shows the H2O match only
        assert [m.pattern for m in rep.matches] == ["h2o"] and not rep.rejected
        if "mask" in expected:
            assert expected["mask"] in rep.matches[0].summary["mask"]
        torch._dynamo.reset()
        got = torch.compile(fn, backend="fuser")(*args)
        want = fn(*[a.double() if a.is_floating_point() else a for a in args])
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        assert g.dtype == (torch.float32 if w.dtype == torch.float64 else w.dtype)
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)


def test_a_new_length_does_not_recompile(qkv):
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = qkv
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("fuser")
    c = torch.compile(scores_and_out, backend=counter, dynamic=True)
    with torch.no_grad():
        for n in (29, 45):
            x = [t[:, :, :n].contiguous() for t in (q, k, v)] if n <= N else [torch.randn(B, H, n, D) for _ in range(3)]
            for g, w in zip(c(*x), scores_and_out(*[t.double() for t in x])):
                torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)
    assert counter.frame_count == 1


def test_declines_with_reasons(qkv):
    q, k, v = qkv

    def p_returned(q, k, v):
        p = torch.softmax(q @ k.mT * 0.25, -1)
        return p @ v, p.sum(-2), p

    def key_sum(q, k):
        p = torch.softmax(q @ k.mT * 0.25, -1)
        return p.sum(-1)

    with torch.no_grad():
        testing.assert_declines(p_returned, q, k, v, pattern="h2o", reason="also read by")
        testing.assert_declines(key_sum, q, k, pattern="h2o", reason="summed over the keys")
    # gradients through the outputs: the op has no backward yet
    qg = q.clone().requires_grad_()
    testing.assert_declines(scores_and_out, qg, k, v, pattern="h2o", reason="need gradients")


def test_fp16_close_to_float64(qkv):
    q, k, v = (t.half() for t in qkv)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(causal_fp32_softmax, backend="fuser")(q, k, v)
        want = causal_fp32_softmax(*(t.double() for t in (q, k, v)))
    for g, w in zip(got, want):
        assert g.dtype == torch.float16
        torch.testing.assert_close(g.double(), w, rtol=2e-3, atol=2e-3)


def _compiled_vs_eager(fn, *args, grad_leaves=()):
    """Run ``fn`` compiled with fuser and in float64 eager on copies of ``args``; compare
    outputs (and gradients of ``grad_leaves``, indices into args) and return fuser's report."""
    torch._dynamo.reset()
    rep = fuser.explain(fn, *[a.detach().clone().requires_grad_(a.requires_grad) for a in args])
    torch._dynamo.reset()
    mine = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    ref = [a.detach().double().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args]
    got, want = torch.compile(fn, backend="fuser")(*mine), fn(*ref)
    for g, w in zip(got, want):
        assert g.requires_grad == w.requires_grad
        torch.testing.assert_close(g.detach().double(), w.detach(), rtol=2e-5, atol=2e-5)
    for i in grad_leaves:
        gg = torch.autograd.grad(sum(x.sum() for x in got if x.requires_grad), mine[i], retain_graph=True)[0]
        gw = torch.autograd.grad(sum(x.sum() for x in want if x.requires_grad), ref[i])[0]
        torch.testing.assert_close(gg.double(), gw, rtol=1e-4, atol=1e-4)
    return rep


def test_in_place_write_between_a_score_reader_and_pv(qkv):
    # v written after the score is read and before P V: eager's P V sees the new v. The
    # replacement would have to go before the score's reader, where the new v does not exist yet:
    # declined, and the program runs as written.
    q, k, v = qkv

    def fn(q, k, v, w):
        p = torch.softmax(q @ k.mT * 0.25, -1)
        gated = p.sum(-2) * w
        v.add_(1.0)
        return p @ v, gated

    with torch.no_grad():
        rep = _compiled_vs_eager(fn, q, k, v, torch.randn(B, H, N))
    assert not rep.matches
    assert any(r.pattern == "h2o" and "before one of its inputs" in r.reason for r in rep.rejected)


def test_in_place_write_to_k_after_the_scores(qkv):
    # k written after the scores, before the sum: the fused op must read k as the program did
    q, k, v = qkv

    def fn(q, k, v):
        p = torch.softmax(q @ k.mT * 0.25, -1)
        k.mul_(2.0)
        return p @ v, p.sum(-2)

    with torch.no_grad():
        _compiled_vs_eager(fn, q, k, v)


def test_no_grad_block_inside_a_training_program(qkv):
    # q needs a gradient, but the H2O scores are computed under torch.no_grad(), as H2O does
    # during training with eviction: no gradient flows through them, in eager or in fuser
    q, k, v = qkv

    def fn(q, k, v):
        out = q * 2.0
        with torch.no_grad():
            p = torch.softmax(q @ k.mT * 0.25, -1)
            score = p.sum(-2)
        return out, score

    rep = _compiled_vs_eager(fn, q.clone().requires_grad_(), k, v, grad_leaves=(0,))
    assert [m.pattern for m in rep.matches] == ["h2o"]


# --- plans: what the planner offers, forcing a plan, autotune -----------------------------------

N_PLANS = 70  # several 16-row tiles of the interpreter's diag_cache config


def _plan_qkv(n=N_PLANS):
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(B, H, n, D, generator=g) for _ in range(3))


def test_explain_lists_every_plan_with_its_estimate():
    q, k, v = _plan_qkv()
    with torch.no_grad():
        rep = fuser.explain(causal_fp32_softmax, q, k, v)
    (m,) = rep.matches
    names = [c.name for c in m.alternatives]
    assert names[:2] == ["fuser[two_kernel]", "fuser[one_kernel]"]
    diag = [c for c in m.alternatives if c.params.get("plan") == "diag_cache"]
    # K in {n/4, n/2} of the 5 block diagonals (n/8 rounds to 0), both layouts under causal masking
    assert sorted((c.params["diagonals"], c.params["cache"]) for c in diag) == [
        (1, "balanced"), (1, "causal"), (2, "balanced"), (2, "causal")]
    assert "fuser[diag_cache K=2 causal]" in names
    for c in diag:
        assert c.cost["workspace"] != 0 and "tiles of 16x16" in c.note
    one = m.alternatives[1]
    assert not one.deterministic and "atomics" in one.cost
    text = str(rep)
    for name in names:
        assert name in text
    assert m.plan in m.alternatives and m.plan.estimate_ms == min(c.estimate_ms for c in m.alternatives)


def test_non_causal_offers_only_the_balanced_layout():
    q, k, v = _plan_qkv()
    with torch.no_grad():
        rep = fuser.explain(scores_and_out, q, k, v)
    caches = {c.params.get("cache") for c in rep.matches[0].alternatives if c.params.get("plan") == "diag_cache"}
    assert caches == {"balanced"}


@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel", "diag_cache"])
def test_forced_plan_runs_and_matches_eager(plan):
    q, k, v = _plan_qkv()
    opts = {"fuser.plan": f"h2o.plan={plan}"}
    with torch.no_grad():
        rep = fuser.explain(causal_fp32_softmax, q, k, v, options=opts)
        assert rep.matches[0].plan.params["plan"] == plan and "forced" in rep.matches[0].reason
        if plan == "diag_cache":
            assert any("_cache1" in kern.name or "_cache2" in kern.name for kern in rep.matches[0].kernels)
        torch._dynamo.reset()
        got = torch.compile(causal_fp32_softmax, backend="fuser", options=opts)(q, k, v)
        want = causal_fp32_softmax(*(t.double() for t in (q, k, v)))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)


def test_deterministic_algorithms_leave_out_one_kernel():
    q, k, v = _plan_qkv()
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            rep = fuser.explain(causal_fp32_softmax, q, k, v, options={"fuser.autotune": True})
    finally:
        torch.use_deterministic_algorithms(old)
    m = rep.matches[0]
    assert m.plan.params["plan"] != "one_kernel"
    tune = [c for c in m.alternatives if c.params["plan"] == "autotune"][0]
    assert all(p != "one_kernel" for p, _, _ in tune.params["tries"]) and tune.deterministic


def test_autotune_times_the_best_plans_on_the_interpreter():
    from fuser.codegen import launch

    q, k, v = _plan_qkv(66)  # a shape bucket no other test tunes
    opts = {"fuser.autotune": True}
    before = {key for key in launch._tune_mem if key.startswith("h2o.plan|")}
    with torch.no_grad():
        rep = fuser.explain(causal_fp32_softmax, q, k, v, options=opts)
        m = rep.matches[0]
        assert m.plan.name == "fuser[plan=autotune]", str(rep)
        tries = m.plan.params["tries"]
        ranked = sorted((c for c in m.alternatives if c.params["plan"] != "autotune"), key=lambda c: c.estimate_ms)
        assert list(tries) == [(c.params["plan"], c.params["diagonals"], c.params["cache"]) for c in ranked[:3]]
        torch._dynamo.reset()
        got = torch.compile(causal_fp32_softmax, backend="fuser", options=opts)(q, k, v)
        want = causal_fp32_softmax(*(t.double() for t in (q, k, v)))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)
    tuned = {key for key in launch._tune_mem if key.startswith("h2o.plan|")} - before
    assert len(tuned) == 1
    winner = launch._tune_mem[tuned.pop()]
    assert (winner["plan"], winner["diagonals"], winner["cache"]) in tries


def test_h2o_op_plan_strings():
    from fuser.patterns import h2o_ops
    from fuser.patterns.h2o_reference import reference

    q, k, v = _plan_qkv(45)
    _, want = reference(q, k, v, scale=0.25, causal="bottom_right")
    for text in ("", h2o_ops.plan_string("one_kernel"), h2o_ops.plan_string("diag_cache", 2, "causal"),
                 h2o_ops.plan_string("diag_cache", 99, "causal")):  # K clamped to this shape's 3 diagonals
        out, score = torch.ops.fuser.h2o(q, k, v, None, 0.25, "bottom_right", "none", True, text)
        torch.testing.assert_close(score.double(), want, rtol=2e-5, atol=2e-5)
    assert h2o_ops.parse_plan("plan=diag_cache;diagonals=3;cache=causal;try=one_kernel/0/balanced") == {
        "plan": "diag_cache", "diagonals": 3, "cache": "causal", "tries": [("one_kernel", 0, "balanced")]}
    with pytest.raises(ValueError, match="plan entry"):
        h2o_ops.parse_plan("plan=one_kernel;split=2")
