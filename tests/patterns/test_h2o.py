"""The H2O pattern: spellings matched with their bindings, near-misses declined with their
reasons, and compiled results against float64 eager (CPU, Triton's interpreter)."""

from __future__ import annotations

import math
import re

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


# -- issue 9 part B: the remaining spellings of the score ------------------------------------
# Batch of 2 so that sums over the batch are seen; every case runs compiled (the kernels in
# Triton's interpreter) against float64 eager, and its bindings are checked in the report.

B2, N2 = 2, 24


@pytest.fixture
def qkv2():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(B2, H, N2, D, generator=g) for _ in range(3))


def _to64(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _fused(fn, *args, rtol=2e-5, atol=2e-5, dynamic=None, **expected):
    """``fn`` compiled with fuser (one fused H2O region whose summary has ``expected``), its
    outputs equal to float64 eager's within the tolerances, in the dtypes and shapes eager
    gives; returns the match."""
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(fn, *args, dynamic=dynamic)
        want, like = fn(*_to64(args)), fn(*args)
    assert [m.pattern for m in rep.fused] == ["h2o"], str(rep)
    m = rep.fused[0]
    for key, value in expected.items():
        assert m.summary.get(key) == value, f"{key}: {m.summary.get(key)!r} != {value!r}\n{rep}"
    got = rep.output if isinstance(rep.output, tuple) else (rep.output,)
    want = want if isinstance(want, tuple) else (want,)
    like = like if isinstance(like, tuple) else (like,)
    assert len(got) == len(want)
    for g, w, e in zip(got, want, like):
        assert (g.shape, g.dtype) == (e.shape, e.dtype)  # eager's, at the inputs' dtype
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol)
    return m


def _declined(fn, *args, reason, compare=True):
    """Nothing fused; ``explain()`` names the H2O near-miss with ``reason`` (a regular
    expression), and the program's results are eager's (unless ``compare`` is False: dropout
    draws other random numbers compiled)."""
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(fn, *args)
        want = fn(*args)
    assert not rep.fused, str(rep)
    assert any(r.pattern == "h2o" and re.search(reason, r.reason) for r in rep.rejected), str(rep)
    assert re.search(reason, str(rep).replace("\n        ", " "))
    got = rep.output if isinstance(rep.output, tuple) else (rep.output,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want) if compare else ():
        torch.testing.assert_close(g, w)


def _p(q, k):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)


def _with_pv(p, v, score):
    """``(P V, score(P))``."""
    return p @ v, score(p)


def _causal_p(q, k, fill=float("-inf")):
    # top-left causal with a -inf fill, the mask built from sizes (proven causal by its values)
    n, m = q.size(-2), k.size(-2)
    hide = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(hide, fill), dim=-1)


REDUCTIONS = [
    # the H2O reference code: batch, then queries
    ("sum0_sum1", lambda q, k, v: _p(q, k).sum(0).sum(1), "sum over batch, then sum over queries"),
    ("sum_dims_0_2", lambda q, k, v: _p(q, k).sum(dim=(0, 2)), "sum over batch, queries"),
    ("sum_dims_1_2", lambda q, k, v: _p(q, k).sum((1, 2)), "sum over heads, queries"),
    ("queries_then_heads", lambda q, k, v: torch.sum(_p(q, k), 2).sum(1), "sum over queries, then sum over heads"),
    ("keepdim", lambda q, k, v: _p(q, k).sum(-2, keepdim=True), "sum over queries (keepdim)"),
    ("keepdim_chain", lambda q, k, v: _p(q, k).sum(2, keepdim=True).sum(0), "sum over queries, then sum over batch (keepdim)"),
    ("mean", lambda q, k, v: _p(q, k).mean(-2), "mean over queries"),
    ("torch_mean_with_pv", lambda q, k, v: _with_pv(_p(q, k), v, lambda p: torch.mean(p, dim=2)), "mean over queries"),
    ("mean_batch_queries", lambda q, k, v: _p(q, k).mean((0, 2)), "mean over batch, queries"),
    ("sum_then_mean", lambda q, k, v: _p(q, k).sum(0).mean(1), "sum over batch, then mean over queries"),
    ("bmm_layout", lambda q, k, v: torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).mT) * 0.25, -1).sum((0, 1)),
     "sum over batch·heads, queries"),
]


@pytest.mark.parametrize("case", REDUCTIONS, ids=[c[0] for c in REDUCTIONS])
def test_reductions_over_batch_heads_and_queries(case, qkv2):
    # the fused op sums the queries per (b, h); what else the program reduces is an ordinary
    # torch sum on the small [B, H, Nk] result
    _, fn, words = case
    _fused(fn, *qkv2, score=words)


SLICES = [
    # slices of the other axes commute with the sum over the queries: applied to the score
    ("heads", lambda q, k, v: _p(q, k)[:, 1:3].sum(2), "heads[1:3]"),
    ("keys_strided", lambda q, k, v: _p(q, k)[..., ::2].sum(-2), "keys[::2]"),
    # two windows of the queries, one after the other: q is sliced twice the same way
    ("two_windows", lambda q, k, v: _p(q, k)[:, :, 2:][:, :, -5:].mean(-2), "queries[2:], queries[-5:]"),
    ("bmm_window", lambda q, k, v: torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).mT), -1)[:, -4:].sum(1),
     "queries[-4:]"),
    # an empty window: eager's sum over no rows is 0, and so is the op's
    ("empty_window", lambda q, k, v: _p(q, k)[:, :, N2 + 1:].sum(-2), f"queries[{N2 + 1}:]"),
    # a slice of the score (after the last sum) reads the region's output: not in the region
    ("slice_after_the_sum", lambda q, k, v: _p(q, k).sum(2, keepdim=True)[..., 2:], None),
]


@pytest.mark.parametrize("case", SLICES, ids=[c[0] for c in SLICES])
def test_slices_of_p(case, qkv2):
    _, fn, words = case
    m = _fused(fn, *qkv2, window=words)
    assert m.outputs["score"].name.startswith(("sum", "mean"))


def test_mean_over_a_symbolic_number_of_queries(qkv2):
    # P.mean(-2) divides by Nq: a size read at run time, so a new length does not recompile
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(q, k, v):
        p = _p(q, k)
        return p @ v, p.mean(-2), p.sum(0).mean(1)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("fuser")
    c = torch.compile(fn, backend=counter, dynamic=True)
    with torch.no_grad():
        for n in (19, 31):
            x = [torch.randn(B2, H, n, D) for _ in range(3)]
            with pytest.raises(AssertionError):  # not the sum: the division by n is there
                torch.testing.assert_close(c(*x)[1], _p(*x[:2]).sum(-2))
            for g, w in zip(c(*x), fn(*_to64(x))):
                torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)
    assert counter.frame_count == 1


def kvpress_causal_mean(q, k):
    # kvpress' ObservedAttention on a causal prefill: key j is seen by the n - j queries after
    # it, so its mean attention is the column sum divided by n - j (outside the fused region)
    n = q.size(-2)
    p = _causal_p(q, k)
    return p.sum(2) / torch.arange(n, 0, -1, device=q.device)


def kvpress_gqa_mean(q, k):
    # the scores of the query heads that share a kv head, averaged (kvpress with GQA): k repeated
    # the repeat_kv way, no P V; the view and the mean read the score, outside the region
    b, h, n, _ = q.shape
    k2 = _rep_kv(k[:, : h // 2], 2)
    scores = _p(q, k2).sum(2)
    return scores.view(b, h // 2, 2, n).mean(2)


def test_kvpress_causal_mean_and_gqa_mean(qkv2):
    q, k, _ = qkv2
    m = _fused(kvpress_causal_mean, q, k, causal="top_left", outputs="score", score="sum over queries")
    assert m.outputs["score"].name.startswith("sum")  # the division is not in the region
    _fused(kvpress_gqa_mean, q, k, gqa_group=2, outputs="score", v="-")


def snapkv(q, k, v, w):
    # SnapKV: the observation window is the last w queries; O over every row
    p = _causal_p(q, k)
    return p @ v, p[..., -w:, :].sum(-2)


def snapkv_score_only(q, k, w):
    p = _causal_p(q, k)
    return p[:, :, -w:].sum(dim=-2)


def snapkv_mean_padding(q, k, v, keep, w):
    s = (q @ k.mT * 0.25).masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1)
    return p @ v, p[:, :, -w:].mean(2)


def test_snapkv_window(qkv2):
    q, k, v = qkv2
    # top-left causal on Nq = Nk: the window's rows are bottom-right aligned
    _fused(snapkv, q, k, v, 8, window="queries[-8:]", causal="top_left", window_causal="bottom_right",
           outputs="out, score")
    _fused(snapkv_score_only, q, k, 5, window="queries[-5:]", window_causal="bottom_right", outputs="score")
    # a window longer than the rows is all of them, in eager as in the sliced q
    _fused(snapkv_score_only, q, k, N2 + 9, window=f"queries[-{N2 + 9}:]")
    keep = torch.ones(B2, 1, 1, N2, dtype=torch.bool)
    keep[0, ..., N2 - 7:] = False
    _fused(snapkv_mean_padding, q, k, v, keep, 6, window="queries[-6:]", score="mean over queries",
           mask="bool_drop (2, 1, 1, 24)")


def test_snapkv_window_slices_a_mask_with_rows(qkv2):
    # an additive mask [B, 1, Nq, Nk] (transformers' eager mask, finfo.min where hidden) has a
    # row per query: the op reads the window's rows of it
    q, k, v = qkv2
    bias = torch.randn(B2, 1, N2, N2)
    bias[..., 3:, :2] = torch.finfo(torch.float32).min

    def fn(q, k, v, bias):
        p = torch.softmax(q @ k.mT * 0.25 + bias, -1)
        return p @ v, p[:, :, -7:].sum(-2)

    _fused(fn, q, k, v, bias, window="queries[-7:]", mask="additive (2, 1, 24, 24)")


def test_snapkv_window_with_a_symbolic_width_does_not_recompile(qkv2):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("fuser")
    c = torch.compile(snapkv, backend=counter, dynamic=True)
    with torch.no_grad():
        for n, w in ((19, 4), (31, 9)):
            x = [torch.randn(B2, H, n, D) for _ in range(3)]
            for g, want in zip(c(*x, w), snapkv(*_to64(x), w)):
                torch.testing.assert_close(g.double(), want, rtol=2e-5, atol=2e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(snapkv, *qkv2, 6, dynamic=True)
    assert [m.summary["window"] for m in rep.fused] == ["queries[-w:]"]


def kvpress_snapkv_from_attentions(q, k, v):
    # kvpress' SnapKVPress.score with the eager attentions: the window's queries and the keys
    # before it, averaged over the window (the key slice commutes with the sum over queries)
    w = 6
    attentions = _causal_p(q, k)
    return attentions @ v, attentions[..., -w:, :-w].mean(dim=-2)


def kvpress_snapkv_window_attention(q, k):
    # kvpress' SnapKVPress.compute_window_attention: the window's queries against every key with
    # a bottom-right causal mask, softmax in float32, the keys before the window, the mean over
    # the queries, then pooled (outside the region)
    w, n = 6, k.shape[2]
    attn = torch.matmul(q[:, :, -w:], k.transpose(2, 3)) / math.sqrt(D)
    attn += torch.full((w, n), float("-inf"), device=q.device).triu(n - w + 1)
    attn = torch.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
    scores = attn[..., :-w].mean(dim=-2)
    return F.avg_pool1d(scores, kernel_size=5, padding=2, stride=1)


def test_kvpress_snapkv_spellings(qkv2):
    q, k, v = qkv2
    _fused(kvpress_snapkv_from_attentions, q, k, v, window="queries[-6:], keys[:-6]", window_causal="bottom_right",
           score="mean over queries")
    _fused(kvpress_snapkv_window_attention, q, k, causal="bottom_right", window="keys[:-6]", outputs="score")
    # kvpress itself builds that mask as torch.ones_like(attn_weights) * -inf: test_kvpress_ones_like_mask


def test_window_causal_alignments(qkv2):
    q, k, _ = qkv2
    # a prefix of top-left rows stays top-left
    _fused(lambda q, k: _causal_p(q, k)[:, :, :9].sum(-2), q, k, window="queries[:9]", window_causal="top_left")

    # bottom-right causal (a chunk of 10 queries against 24 keys): a suffix stays bottom-right
    # without Nq = Nk
    def chunk(q, k):
        n, m = q.size(-2), k.size(-2)
        hide = torch.ones(n, m, dtype=torch.bool).triu(m - n + 1)
        p = torch.softmax((q @ k.mT * 0.25).masked_fill(hide, float("-inf")), -1)
        return p[:, :, -4:].sum(-2)

    _fused(chunk, q[:, :, :10], k, causal="bottom_right", window_causal="bottom_right")

    # a prefix of bottom-right rows with Nq < Nk has no alignment the kernels compute
    def chunk_prefix(q, k):
        n, m = q.size(-2), k.size(-2)
        hide = torch.ones(n, m, dtype=torch.bool).triu(m - n + 1)
        return torch.softmax((q @ k.mT * 0.25).masked_fill(hide, float("-inf")), -1)[:, :, :4].sum(-2)

    _declined(chunk_prefix, q[:, :, :10], k, reason=r"window of queries \[:4\] under a bottom_right causal mask.*Nq = Nk")
    # rows from the middle: neither alignment
    _declined(lambda q, k: _causal_p(q, k)[:, :, 3:9].sum(-2), q, k,
              reason=r"\[3:9\] under a top_left causal mask.*neither a prefix nor a suffix")
    # a strided window under a causal mask: declined; without one, any slice, strided too
    _declined(lambda q, k: _causal_p(q, k)[:, :, ::2].sum(-2), q, k, reason=r"strided window of queries \(::2\)")
    _fused(lambda q, k: _p(q, k)[:, :, 3:20:3].sum(-2), q, k, window="queries[3:20:3]")


def fp32_softmax_half_sum(q, k, v):
    # HF eager: the softmax in float32, cast back to the input dtype; the score sums the cast P
    p = torch.softmax(q @ k.mT * 0.25, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v, p.sum(0).sum(1)


def fp32_softmax_fp32_sum(q, k, v):
    # the score summed in float32 before the cast (accumulated at full precision)
    p = torch.softmax(q @ k.mT * 0.25, dim=-1, dtype=torch.float32)
    return p.to(q.dtype) @ v, p.sum(0).sum(1)


def test_fp32_softmax_cast_before_or_after_the_sum(qkv2):
    q, k, v = (t.half() for t in qkv2)
    # Cast first: eager rounds each P to float16 (relative error u = 2^-11 each, so at most u of
    # the column sum, all terms being positive) and the sum to float16 (u again): 2u ≈ 1e-3
    # relative; fuser sums float32 P and rounds once. The tolerance, 2e-3 relative, is 2u with
    # room for the float32 sums; atol covers columns near 0. O: P and v in float16 as in eager.
    m = _fused(fp32_softmax_half_sum, q, k, v, rtol=2e-3, atol=2e-3)
    assert m.bindings["score_dtype"] == torch.float16
    # Sum first: eager's score is float32 (P not rounded; the softmax's dtype=float32 holds in the
    # float64 run too, so the reference is float32 P from float64 scores): fuser's float32 column
    # sums agree to float32 accumulation error, far below float16's; O as above.
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(fp32_softmax_fp32_sum, q, k, v)
        want = fp32_softmax_fp32_sum(*_to64((q, k, v)))
    assert [m.pattern for m in rep.fused] == ["h2o"]
    out, score = rep.output
    assert (out.dtype, score.dtype) == (torch.float16, torch.float32)
    torch.testing.assert_close(out.double(), want[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(score.double(), want[1].double(), rtol=2e-5, atol=1e-4)


# found by an adversarial review (2026-12-07): P rounded below the dtype the scores are computed in
# (float32 inputs) was summed unrounded (1e-3 off the score, 2e-3 off the output)
@pytest.mark.parametrize("spelling", ["both", "score_only", "softmax_dtype"])
def test_p_rounded_below_the_compute_dtype_is_declined(qkv2, spelling):
    def f(q, k, v):
        if spelling == "softmax_dtype":
            p = torch.softmax(q @ k.mT * 0.25, -1, dtype=torch.bfloat16).float()
            return p @ v, p.sum(-2)
        p = torch.softmax(q @ k.mT * 0.25, -1)
        if spelling == "both":
            p = p.bfloat16().float()
            return p @ v, p.sum(-2)
        return p @ v, p.bfloat16().float().sum(-2)

    # the declined region runs as Inductor's, which drops the same round trip (its choice:
    # emulate_precision_casts is off): compared with backend="inductor" instead of eager
    _declined(f, *qkv2, reason="rounded to torch.bfloat16|softmax in torch.bfloat16", compare=False)
    torch._dynamo.reset()
    with torch.no_grad():
        got = fuser.explain(f, *qkv2).output
        torch._dynamo.reset()
        want = torch.compile(f, backend="inductor")(*qkv2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_a_score_rounded_as_its_last_step_is_still_fused(qkv2):
    def f(q, k, v):
        p = torch.softmax(q @ k.mT * 0.25, -1)
        return p @ v, p.sum(-2).bfloat16()  # the score's own dtype: the op rounds once, as eager does

    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(f, *qkv2)
        want = f(*_to64(qkv2))
    assert [m.pattern for m in rep.fused] == ["h2o"], str(rep)
    out, score = rep.output
    assert score.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(score.double(), want[1].double(), rtol=8e-3, atol=0)  # one bf16 rounding each


def test_masks_layouts_and_gqa(qkv2):
    q, k, v = qkv2

    def bnhd(q, k, v):
        # [B, N, H, D] tensors, heads moved the usual way
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        p = torch.softmax(qt @ kt.transpose(2, 3) * 0.25, dim=-1)
        return (p @ vt).transpose(1, 2), p.sum(0).sum(1)

    _fused(bnhd, *(x.transpose(1, 2).contiguous() for x in (q, k, v)), outputs="out, score")

    def gqa_batch_sum(q, k, v):
        k2, v2 = _rep_kv(k[:, :2], 2), _rep_kv(v[:, :2], 2)
        p = _causal_p(q, k2)
        return p @ v2, p.sum(0).sum(1)

    _fused(gqa_batch_sum, q, k, v, gqa_group=2, causal="top_left")

    def additive_padding(q, k, bias):
        return torch.softmax(q @ k.mT * 0.25 + bias, -1).sum((0, 2))

    bias = torch.zeros(B2, 1, 1, N2)
    bias[1, ..., N2 - 5:] = torch.finfo(torch.float32).min
    _fused(additive_padding, q, k, bias, mask="additive (2, 1, 1, 24)")


def test_near_misses_are_declined_with_reasons(qkv2):
    q, k, v = qkv2

    def p_reused(q, k, v):
        p = _p(q, k)
        return p @ v, p.sum(0).sum(1), p.amax(-1)

    def dropout_before_the_sum(q, k, v):
        p = _p(q, k)
        return p @ v, F.dropout(p, 0.1, training=True).sum(-2)

    def dropout_before_pv(q, k, v):
        p = _p(q, k)
        return F.dropout(p, 0.1, training=True) @ v, p.sum(-2)

    def not_p(q, k, w):
        p = _p(q, k)
        return (p * w).sum(-2)

    def keys_then_queries(q, k):
        return _p(q, k).sum(-1).sum(-1)

    def causal_before_a_finite_padding_fill(q, k, pad):
        # the causal -inf first, then the padding's finite fill replaces it where both hide: the
        # kernels apply the data mask first (a padded key above the diagonal would be -inf there)
        n, m = q.size(-2), k.size(-2)
        hide = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(hide, float("-inf"))
        return torch.softmax(s.masked_fill(~pad, -1e4), dim=-1).sum(-2)

    _declined(p_reused, q, k, v, reason=r"also read by 'amax")
    _declined(dropout_before_the_sum, q, k, v, reason=r"dropout on the attention weights is active .*p=0\.1",
              compare=False)
    _declined(dropout_before_pv, q, k, v, reason=r"dropout on the attention weights is active", compare=False)
    _declined(not_p, q, k, torch.rand(B2, H, N2, N2), reason=r"sums 'mul\w*' over the queries.*not P itself")
    _declined(keys_then_queries, q, k, reason=r"summed over the keys")
    pad = torch.rand(B2, 1, 1, N2, generator=torch.Generator().manual_seed(2)) > 0.2
    _declined(causal_before_a_finite_padding_fill, q, k, pad, reason=r"order the fused kernels do not follow")
    # eval-mode dropout passes P on unchanged: fused
    _fused(lambda q, k, v: _with_pv(_p(q, k), v, lambda p: F.dropout(p, 0.1, training=False).sum(-2)), q, k, v)


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


def test_forcing_diag_cache_where_nothing_can_be_cached_says_why_and_how():
    """A decode-like recompile (N = 1) of a graph compiled with h2o.plan=diag_cache: the error says
    why this call's sizes have nothing to cache and what to do, not only which plans exist."""
    opts = {"fuser.plan": "h2o.plan=diag_cache"}
    q, k, v = (torch.randn(1, 2, 1, 16) for _ in range(3))
    with torch.no_grad(), pytest.raises(fuser.FuserOptionError,
                                        match=r"offers plan in \['one_kernel', 'two_kernel'\]: diag_cache keeps .* at "
                                              r"N_q=1, N_k=1 .*nothing to keep.*drop h2o.plan"):
        fuser.explain(scores_and_out, q, k, v, options=opts)


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
        out, score = torch.ops.fuser.h2o(q, k, v, None, 0.25, "bottom_right", "none", True, text, float("-inf"), "replace",
                                         float("-inf"))
        torch.testing.assert_close(score.double(), want, rtol=2e-5, atol=2e-5)
    assert h2o_ops.parse_plan("plan=diag_cache;diagonals=3;cache=causal;try=one_kernel/0/balanced") == {
        "plan": "diag_cache", "diagonals": 3, "cache": "causal", "tries": [("one_kernel", 0, "balanced")]}
    with pytest.raises(ValueError, match="plan entry"):
        h2o_ops.parse_plan("plan=one_kernel;split=2")


@pytest.mark.parametrize("with_max", [True, False])
def test_softmax_by_hand(with_max):
    """exp(S - amax(S)) / sum and exp(S) / sum (the fuzzer's hand-written softmax) feeding a
    column sum and P V: found as H2O (the div is an anchor), equal to eager."""
    def program(q, k, v):
        s = (q @ k.transpose(-2, -1)) * 0.25
        e = (s - s.amax(dim=-1, keepdim=True)).exp() if with_max else s.exp()
        p = e / e.sum(dim=-1, keepdim=True)
        return p @ v, p.sum(-2)

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 13, 8, generator=gen) for _ in range(3))
    with torch.no_grad():
        report = fuser.explain(program, q, k, v)
        want = program(q.double(), k.double(), v.double())
    assert [m.pattern for m in report.fused] == ["h2o"], str(report)
    for got, ref in zip(report.output, want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spelling", ["masked_fill_finfo_min", "hf_additive_finfo_min", "masked_fill_small"])
@pytest.mark.parametrize("with_pv", [True, False])
def test_finite_causal_fill(spelling, with_pv):
    """Causal masks with a finite fill — masked_fill(hide, finfo.min), transformers' eager
    additive mask where(allowed, 0, finfo.min), and a small fill (-3) whose hidden keys carry
    weight — are fused (two_kernel) and equal float64 eager, the fill shown in explain()."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 19, 8, generator=gen) for _ in range(3))

    def program(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        n, m = q.size(-2), k.size(-2)
        allowed = torch.arange(m, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
        if spelling == "hf_additive_finfo_min":
            zero = torch.zeros((), dtype=s.dtype, device=s.device)
            s = s + torch.where(allowed, zero, torch.finfo(s.dtype).min)
        else:
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min if spelling == "masked_fill_finfo_min" else -3.0)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return (p @ v, p.sum(-2)) if with_pv else p.sum(-2)

    mode = "add" if spelling == "hf_additive_finfo_min" else "replace"
    m = _fused(program, q, k, v, causal="top_left")
    assert m.summary["causal_fill"].endswith(f"({mode})"), m.summary
    assert [c.name for c in m.alternatives] == ["fuser[two_kernel]"]  # the only plan taking a finite fill
    # the kernels explain() points at are the ones that run: the forward and column pass taking the fill
    suffix = "_causaladd" if mode == "add" else "_causalfill"
    assert [k.name.split(suffix)[0] for k in m.kernels] == ["attention_fwd", "h2o_colsum"], [k.name for k in m.kernels]


def test_normalised_over_the_queries_is_not_a_softmax():
    """exp(S) / exp(S).sum(dim=-2): normalised over the queries, not the keys. The division is an
    anchor (hand-written softmax), but the rule wants the sum over the last dim: nothing is
    fused, and the compiled program equals eager."""
    def program(q, k, v):
        e = (q @ k.transpose(-2, -1) * 0.25).exp()
        p = e / e.sum(dim=-2, keepdim=True)
        return p @ v, p.sum(-2)

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 11, 8, generator=gen) for _ in range(3))
    with torch.no_grad():
        report = fuser.explain(program, q, k, v)
        want = program(q, k, v)
    assert not [m for m in report.fused if m.pattern == "h2o"], str(report)
    for got, ref in zip(report.output, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_window_under_a_finite_causal_fill_is_declined():
    """A SnapKV window of P under transformers' finfo.min causal mask: the window's rows would need
    the fill realigned; declined with the reason, results eager's."""
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(B2, H, N2, 8, generator=gen) for _ in range(2))

    def window(q, k):
        s = q @ k.transpose(-2, -1) * 0.25
        n = q.size(-2)
        hide = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        p = torch.softmax(s.masked_fill(hide, torch.finfo(s.dtype).min), dim=-1)
        return p[..., -4:, :].sum(-2)

    _declined(window, q, k, reason=r"query window of P under a causal mask with a finite fill")


# -- finite fills of a boolean data mask (masked_fill(~pad, finfo.min)) and a finite causal fill
# beside a data mask: fused, equal to float64 eager (a row whose keys are all hidden by a finite
# fill is uniform in eager, finfo.min - finfo.min = 0; a small fill gives hidden keys weight) ----

F32_MIN = torch.finfo(torch.float32).min


def _pad(b=B2, n=N2, left=False):
    """Key padding ``[B, 1, 1, N]`` (True = visible): batch 0 padded (at the end, or on the left),
    batch 1 entirely padded (every row of it is hidden: uniform under a finite fill)."""
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    if left:
        keep[0, ..., :5] = False
    else:
        keep[0, ..., n - 7:] = False
    keep[1:] = False
    return keep


def _padded_scores(spelling, s, pad):
    """The scores hidden by ``pad`` (True = visible) as the spelling writes it."""
    lo = torch.finfo(s.dtype).min
    if spelling == "masked_fill_finfo_min":
        return s.masked_fill(~pad, lo)
    if spelling == "where_finfo_min":
        return torch.where(pad, s, lo)
    if spelling == "masked_fill_small":  # hidden keys carry weight
        return s.masked_fill(~pad, -3.0)
    if spelling == "int_mask_eq_0":  # an integer attention_mask, hidden where it is 0 (older transformers)
        return s.masked_fill(pad.long() == 0, lo)
    if spelling == "additive_from_bool":  # transformers' eager style: a float mask from the bool, added
        return s + torch.where(pad, torch.zeros((), dtype=s.dtype, device=s.device), lo)
    raise AssertionError(spelling)


FILL_SPELLINGS = ["masked_fill_finfo_min", "where_finfo_min", "masked_fill_small", "int_mask_eq_0",
                  "additive_from_bool"]


@pytest.mark.parametrize("spelling", FILL_SPELLINGS)
@pytest.mark.parametrize("with_pv", [True, False])
def test_finite_fill_of_a_padding_mask(spelling, with_pv, qkv2):
    q, k, v = qkv2
    pad = _pad()

    def program(q, k, v, pad):
        p = torch.softmax(_padded_scores(spelling, q @ k.transpose(-2, -1) * 0.25, pad), dim=-1)
        return (p @ v, p.sum(-2)) if with_pv else p.sum(-2)

    m = _fused(program, q, k, v, pad)
    if spelling == "additive_from_bool":
        assert m.summary["mask"].startswith("additive") and "mask_fill" not in m.summary
    else:
        fill = -3.0 if spelling == "masked_fill_small" else F32_MIN
        assert m.summary["mask_fill"] == f"{fill:g}" and m.summary["mask"].startswith("bool_")
        assert all("fill" in kern.name for kern in m.kernels[-1:]), [kern.name for kern in m.kernels]
    with torch.no_grad():
        score = torch.compile(program, backend="fuser")(q, k, v, pad)
    score = score[1] if with_pv else score
    # batch 1: every key of every row hidden by a finite fill: uniform, as in eager
    torch.testing.assert_close(score[1], torch.full_like(score[1], 1.0), rtol=1e-5, atol=1e-5)
    if spelling == "masked_fill_small":
        assert (score[0, :, N2 - 7:] > 1e-3).all()  # the padded keys carry weight


@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel", "diag_cache"])
def test_finite_padding_fill_every_plan(plan):
    """Each plan forced on a padding mask with finfo.min beside a causal -inf mask (applied after
    it, so the causal mask wins above the diagonal) and a left-padded batch; the kernels that run
    take the fill."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B2, H, N_PLANS, D, generator=g) for _ in range(3))
    pad = _pad(n=N_PLANS, left=True)

    def program(q, k, v, pad):
        n = q.size(-2)
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~pad, torch.finfo(q.dtype).min)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        return p @ v, p.sum(-2)

    opts = {"fuser.plan": f"h2o.plan={plan}"}
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(program, q, k, v, pad, options=opts)
        (m,) = rep.fused
        assert m.plan.params["plan"] == plan and m.summary["causal"] == "top_left"
        assert m.kernels and all("_maskdropfill" in kk.name for kk in m.kernels), [kk.name for kk in m.kernels]
        want = program(*_to64((q, k, v)), pad)
    for g_, w in zip(rep.output, want):
        torch.testing.assert_close(g_.double(), w, rtol=2e-5, atol=2e-5)
    # the left-padded batch's first rows see no visible key: causal keys 0..i all filled, uniform
    torch.testing.assert_close(want[1][1], rep.output[1][1].double(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("causal_spelling", ["masked_fill_finfo_min", "hf_additive_finfo_min", "masked_fill_small"])
@pytest.mark.parametrize("pad_fill", [float("-inf"), "finfo_min"])
def test_finite_causal_fill_beside_padding(causal_spelling, pad_fill, qkv2):
    """Padding (-inf or finfo.min) then a causal mask with a finite fill: fused with two_kernel,
    both fills shown in explain()."""
    q, k, v = qkv2
    pad = _pad(left=True)
    if pad_fill != "finfo_min":
        # not a whole padded batch: its last row would be all -inf (eager NaN, fuser 0: README, Limits)
        pad[1, ..., 3:] = True

    def program(q, k, v, pad):
        s = q @ k.transpose(-2, -1) * 0.25
        s = s.masked_fill(~pad, float("-inf") if pad_fill != "finfo_min" else torch.finfo(s.dtype).min)
        n, m = q.size(-2), k.size(-2)
        allowed = torch.arange(m, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
        if causal_spelling == "hf_additive_finfo_min":
            s = s + torch.where(allowed, torch.zeros((), dtype=s.dtype, device=s.device), torch.finfo(s.dtype).min)
        else:
            s = s.masked_fill(~allowed, torch.finfo(s.dtype).min if causal_spelling != "masked_fill_small" else -3.0)
        p = torch.softmax(s, dim=-1)
        return p @ v, p.sum(-2)

    m = _fused(program, q, k, v, pad, causal="top_left")
    mode = "add" if causal_spelling == "hf_additive_finfo_min" else "replace"
    assert m.summary["causal_fill"].endswith(f"({mode})")
    assert ("mask_fill" in m.summary) == (pad_fill == "finfo_min")
    assert [c.name for c in m.alternatives] == ["fuser[two_kernel]"]
    suffix = "_causaladd" if mode == "add" else "_causalfill"
    assert [kk.name.split(suffix)[0] for kk in m.kernels] == ["attention_fwd", "h2o_colsum"]


def test_transformers_masks_with_padding(qkv2):
    """transformers' own masks on a left-padded batch, built in the graph: ``sdpa_mask`` (True =
    visible; causal and padding in one boolean mask from the data) applied with
    ``masked_fill(~mask, finfo.min)`` — a boolean data mask with a finite fill — and
    ``eager_mask`` (``where(mask, 0, finfo.min)``, added: an additive data mask). The padded
    rows see no visible key: uniform in eager, and here."""
    mu = pytest.importorskip("transformers.masking_utils", reason="needs transformers 5.x")
    q, k, v = qkv2
    attention_mask = torch.ones(B2, N2, dtype=torch.bool)  # as create_causal_mask hands it to the mask functions
    attention_mask[0, :5] = False
    attention_mask[1, :2] = False

    def with_sdpa_mask(q, k, v, attention_mask):
        mask = mu.sdpa_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                            attention_mask=attention_mask, allow_is_causal_skip=False, device=q.device)
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~mask, torch.finfo(q.dtype).min)
        p = torch.softmax(s, dim=-1)
        return p @ v, p.sum(0).sum(1)

    def with_eager_mask(q, k, v, attention_mask):
        mask = mu.eager_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                             attention_mask=attention_mask, dtype=q.dtype, device=q.device)
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1)
        return p @ v, p.sum(0).sum(1)

    m = _fused(with_sdpa_mask, q, k, v, attention_mask, mask_fill=f"{F32_MIN:g}")
    assert m.summary["mask"].startswith("bool_")
    m = _fused(with_eager_mask, q, k, v, attention_mask)
    assert m.summary["mask"].startswith("additive")


def test_snapkv_window_of_a_padded_batch_with_a_finite_fill(qkv2):
    """SnapKV's window over a mask with rows ([B, 1, Nq, Nk]: the op reads the window's rows of it)
    and a finfo.min fill; O over every row from the attention op, which takes the fill too."""
    q, k, v = qkv2
    keep = torch.rand(B2, 1, N2, N2, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[1, :, -2] = False  # a window row with every key hidden: uniform

    def fn(q, k, v, keep):
        s = (q @ k.mT * 0.25).masked_fill(~keep, torch.finfo(q.dtype).min)
        p = torch.softmax(s, -1)
        return p @ v, p[:, :, -6:].sum(-2)

    _fused(fn, q, k, v, keep, window="queries[-6:]", mask_fill=f"{F32_MIN:g}", outputs="out, score")


def test_finite_fill_padding_masks_change_between_calls_and_lengths_do_not_recompile():
    """Dynamic shapes: the padding is data (a new mask each call, read at run time), the fill a
    runtime value; a new length does not recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def program(q, k, v, pad):
        s = (q @ k.mT * 0.25).masked_fill(~pad, torch.finfo(q.dtype).min)
        p = torch.softmax(s, -1)
        return p @ v, p.sum(-2)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("fuser")
    c = torch.compile(program, backend=counter, dynamic=True)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n in (19, 31, 26):
            x = [torch.randn(B2, H, n, D, generator=g) for _ in range(3)]
            pad = torch.rand(B2, 1, 1, n, generator=g) > 0.4
            pad[n % 2] = False  # a fully padded batch, a different one each call
            for got, want in zip(c(*x, pad), program(*_to64(x), pad)):
                torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(program, *x, pad, dynamic=True)
    assert [m.pattern for m in rep.fused] == ["h2o"]


def test_batch_broadcast_padding_mask_with_a_finite_fill(qkv2):
    # one padding row [1, 1, 1, N] shared by both batches
    q, k, v = qkv2
    pad = _pad(b=1)

    def fn(q, k, v, pad):
        p = torch.softmax((q @ k.mT * 0.25).masked_fill(~pad, -5.0), -1)
        return p @ v, p.sum(-2)

    _fused(fn, q, k, v, pad, mask="bool_drop (1, 1, 1, 24)", mask_fill="-5")


def test_fill_known_only_at_run_time_is_declined(qkv2):
    # the fill a tensor input: its value is not known when the kernels are chosen
    q, k, v = qkv2

    def fn(q, k, v, pad, fill):
        p = torch.softmax(torch.where(pad, q @ k.mT * 0.25, fill), -1)
        return p @ v, p.sum(-2)

    _declined(fn, q, k, v, _pad(), torch.tensor(-3.0), reason=r"fill value .* only known at run time")


def test_finite_padding_fill_fp16(qkv2):
    q, k, v = (t.half() for t in qkv2)
    pad = _pad(left=True)

    def fn(q, k, v, pad):
        # fp16's finfo.min as the model writes it (the float64 reference fills the same value)
        s = (q @ k.mT * 0.25).masked_fill(~pad, torch.finfo(torch.float16).min)
        p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
        return p @ v, p.sum(-2)

    m = _fused(fn, q, k, v, pad, rtol=2e-3, atol=2e-3)
    assert m.summary["mask_fill"] == f"{torch.finfo(torch.float16).min:g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spelling", ["masked_fill_finfo_min", "masked_fill_small"])
def test_gpu_finite_padding_fill(dtype, spelling):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 8, 1000, 128, generator=g).to(dev, dtype) for _ in range(3))
    pad = torch.ones(2, 1, 1, 1000, dtype=torch.bool)
    pad[0, ..., :300] = False
    pad[1] = False
    pad = pad.to(dev)

    def program(q, k, v, pad):
        n = q.size(-2)
        s = _padded_scores(spelling, q @ k.transpose(-2, -1) * 128 ** -0.5, pad)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)  # (a float32 softmax would turn float64's finfo.min into -inf)
        return p @ v, p.sum(-2)

    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(program, q, k, v, pad)
        want = program(q.double(), k.double(), v.double(), pad)
    assert [m.pattern for m in rep.fused] == ["h2o"], str(rep)
    for got, ref in zip(rep.output, want):
        assert (got.double() - ref).norm() / ref.norm() < 2e-2


# -- kvpress' own mask: torch.ones_like(attn_weights) * -inf, then triu --------------------------


def kvpress_compute_window_attention(q, k, w):
    """kvpress' ``SnapKVPress.compute_window_attention`` as written (GQA through repeat_kv): the
    window's mask is ``torch.ones_like(attn_weights) * -inf`` — it reads the scores, for their
    shape, dtype and device only — made causal with ``triu`` and added in place; then the
    score's own steps (the mean over the window, pooling, the GQA mean) outside the region."""
    bsz, h_kv, q_len, _ = k.shape
    key_states = _rep_kv(k, q.shape[1] // h_kv)
    attn_weights = torch.matmul(q[:, :, -w:], key_states.transpose(2, 3)) / math.sqrt(q.shape[-1])
    attention_mask = torch.ones_like(attn_weights) * float("-inf")
    attention_mask = torch.triu(attention_mask, diagonal=q_len - w + 1)
    attn_weights += attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_weights = attn_weights[..., :-w]
    scores = attn_weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=5, padding=2, stride=1)
    return scores.view(bsz, h_kv, q.shape[1] // h_kv, q_len - w).mean(2)


def test_kvpress_ones_like_mask(qkv2):
    """``ones_like(scores)`` reads the scores' shape, dtype and device, never their values, so
    the mask built from it is static: evaluated, it is the window's bottom-right causal mask,
    and the kernels skip the hidden tiles instead of loading a ``[B, H, w, N]`` mask."""
    q, k, _ = qkv2
    m = _fused(kvpress_compute_window_attention, q, k[:, :2], 6, outputs="score", gqa_group=2, window="keys[:-6]",
               causal="bottom_right")
    assert m.summary["mask"] == "none", m.summary


def kvpress_mask_from_data(q, k, w):
    """The same window, but the mask's fill is read from the scores' values (``x * 0 - inf``
    instead of ``ones_like(x) * -inf``): data, so it is loaded, never assumed causal."""
    bsz, h_kv, q_len, _ = k.shape
    attn_weights = torch.matmul(q[:, :, -w:], _rep_kv(k, q.shape[1] // h_kv).transpose(2, 3)) / math.sqrt(q.shape[-1])
    attention_mask = torch.triu(attn_weights * 0 + float("-inf"), diagonal=q_len - w + 1)
    attn_weights = attn_weights + attention_mask
    p = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
    return p[..., :-w].sum(-2)


def kvpress_mask_written_with_data(q, k, w, first_key):
    """kvpress' window mask, then its first key's column overwritten with an input tensor in
    place: no longer a function of the sizes."""
    bsz, h_kv, q_len, _ = k.shape
    attn_weights = torch.matmul(q[:, :, -w:], _rep_kv(k, q.shape[1] // h_kv).transpose(2, 3)) / math.sqrt(q.shape[-1])
    attention_mask = torch.triu(torch.ones_like(attn_weights) * float("-inf"), diagonal=q_len - w + 1)
    attention_mask[..., 0] = first_key
    attn_weights = attn_weights + attention_mask
    p = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
    return p[..., :-w].sum(-2)


def test_kvpress_mask_written_with_data_is_not_taken_as_causal(qkv2):
    """The write of data into the ones_like mask is part of its value: not causal, equal to
    float64 eager (the first key's column hidden for some rows by the input)."""
    q, k, _ = qkv2
    first_key = torch.where(torch.rand(q.shape[0], q.shape[1], 6, generator=torch.Generator().manual_seed(3)) < 0.5,
                            float("-inf"), 0.0)
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(kvpress_mask_written_with_data, q, k[:, :2], 6, first_key)
        want = kvpress_mask_written_with_data(*_to64((q, k[:, :2])), 6, first_key.double())
    torch.testing.assert_close(rep.output.double(), want.double(), rtol=2e-5, atol=2e-5)
    for m in rep.matches:
        if m.pattern == "h2o" and m.fused:
            assert m.summary["mask"] != "none", m.summary


def test_mask_reading_score_values_is_not_static(qkv2):
    """``x * 0 - inf`` is NaN where x is ±inf: unlike ``ones_like(x)`` it reads x's values, so the
    mask is not static (the region is declined: the scores escape to the mask)."""
    q, k, _ = qkv2
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(kvpress_mask_from_data, q, k[:, :2], 6)
        want = kvpress_mask_from_data(*_to64((q, k[:, :2])), 6)
    torch.testing.assert_close(rep.output.double(), want.double(), rtol=2e-5, atol=2e-5)
    for m in rep.matches:
        if m.pattern == "h2o" and m.fused:
            assert m.summary["causal"] == "none" and m.summary["mask"] != "none", m.summary


def test_kvpress_ones_like_mask_dynamic_shapes():
    """Under dynamic shapes the proxy's sizes are read off the graph's inputs at run time: new
    lengths and windows do not recompile, and every call equals float64 eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("fuser")
    c = torch.compile(kvpress_compute_window_attention, backend=counter, dynamic=True)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n, w in ((19, 4), (31, 9), (26, 6)):
            q, k = torch.randn(B2, H, n, D, generator=g), torch.randn(B2, 2, n, D, generator=g)
            torch.testing.assert_close(c(q, k, w).double(), kvpress_compute_window_attention(*_to64((q, k)), w),
                                       rtol=2e-5, atol=2e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(kvpress_compute_window_attention, q, k, w, dynamic=True)
    assert [m.pattern for m in rep.fused] == ["h2o"], str(rep)


@pytest.mark.parametrize("fill", [float("inf"), float("nan")])
def test_nan_and_plus_inf_fills_are_declined(fill, qkv2):
    # eager's softmax gives NaN rows there; the kernels take finite fills or -inf (a fused op
    # would have raised at run time): declined before anything is rewritten, results eager's
    q, k, v = qkv2

    def fn(q, k, v, pad):
        p = torch.softmax((q @ k.mT * 0.25).masked_fill(~pad, fill), -1)
        return p @ v, p.sum(-2)

    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(fn, q, k, v, _pad(left=True))
        want = fn(q, k, v, _pad(left=True))
    assert not rep.fused
    assert any(r.pattern == "h2o" and "gives NaN rows" in r.reason for r in rep.rejected), str(rep)
    for g_, w in zip(rep.output, want):
        torch.testing.assert_close(g_, w, equal_nan=True)


@pytest.mark.parametrize("with_score", [True, False], ids=["h2o", "attention"])
def test_a_finite_fill_that_a_later_scale_overflows_is_declined(with_score, qkv2):
    # masked_fill(~pad, 3e38) then * 4: eager's hidden scores are +inf (float32), its softmax rows
    # NaN; the mask analysis (shared by the patterns) declines before anything is rewritten
    q, k, v = qkv2

    def fn(q, k, v, pad):
        p = torch.softmax((q @ k.mT).masked_fill(~pad, 3e38) * 4.0, -1)
        return (p @ v, p.sum(-2)) if with_score else p @ v

    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(fn, q, k, v, _pad(left=True))
        want = fn(q, k, v, _pad(left=True))
    assert not rep.fused
    assert any("gives NaN rows" in r.reason for r in rep.rejected), str(rep)
    for g_, w in zip(rep.output if with_score else (rep.output,), want if with_score else (want,)):
        torch.testing.assert_close(g_, w, equal_nan=True)


def test_a_finite_padding_fill_beside_an_additive_mask_is_declined(qkv2):
    # the kernels apply one boolean mask with a finite fill, and no other mask tensor beside it
    q, k, v = qkv2
    bias = torch.randn(B2, 1, 1, N2)

    def fn(q, k, v, pad, bias):
        p = torch.softmax((q @ k.mT * 0.25 + bias).masked_fill(~pad, -1e4), -1)
        return p @ v, p.sum(-2)

    _declined(fn, q, k, v, _pad(), bias, reason=r"finite value -10000 combined with other mask tensors")


def test_autotune_with_a_finite_padding_fill():
    # plan=autotune times the best-estimated plans with the fill (one_kernel, diag_cache and
    # two_kernel all take it) and runs the winner
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(B2, 2, 34, D, generator=g) for _ in range(3))
    pad = _pad(n=34, left=True)

    def program(q, k, v, pad):
        p = torch.softmax((q @ k.mT * 0.25).masked_fill(~pad, -3.0), -1)
        return p @ v, p.sum(-2)

    opts = {"fuser.autotune": True}
    torch._dynamo.reset()
    with torch.no_grad():
        rep = fuser.explain(program, q, k, v, pad, options=opts)
        want = program(*_to64((q, k, v)), pad)
    (m,) = rep.fused
    assert m.plan.name == "fuser[plan=autotune]" and len(m.plan.params["tries"]) == 3, str(rep)
    for g_, w in zip(rep.output, want):
        torch.testing.assert_close(g_.double(), w, rtol=2e-5, atol=2e-5)


def test_scores_with_gradients_and_a_softmax_under_no_grad():
    """The scores carry a gradient (a learned temperature), only the softmax and what reads P run
    under torch.no_grad(): the outputs need none, so it is fused — with its operands detached,
    the op having no backward (found by the soundness fuzzer: compiling raised "no autograd
    formula" for fuser.h2o)."""
    temperature = torch.nn.Parameter(torch.tensor(1.5))

    def program(q, k, v):
        s = torch.matmul(q, k.mT) / temperature
        with torch.no_grad():
            p = s.softmax(dim=-1)
        return p @ v, p.sum(-2)

    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    torch._dynamo.reset()
    rep = fuser.explain(program, q, k, v)
    assert [m.pattern for m in rep.fused] == ["h2o"], str(rep)
    torch._dynamo.reset()
    got = torch.compile(program, backend="fuser")(q, k, v)
    want = program(*_to64((q, k, v)))
    for g_, w in zip(got, want):
        assert not g_.requires_grad
        torch.testing.assert_close(g_.double(), w, rtol=2e-5, atol=2e-5)
