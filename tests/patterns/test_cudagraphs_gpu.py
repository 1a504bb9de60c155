"""Fused ops under ``mode="reduce-overhead"`` (CUDA graphs): every replay reads the call's
inputs and equals eager, and every graph is captured (Inductor skips CUDA graphs for a graph it
thinks writes its inputs: torch 2.11 once thought so of the attention-KL forward, whose kernel
its access analysis could not lower). Fresh input values on every call, so a replay that read
stale buffers or a workspace captured at recording time would be caught. Marked ``gpu``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fuser
from fuser import report

from test_kda import blog_loop as kda_loop  # the kernel blogs' loop: [B, H, T, K], o by index writes

pytestmark = pytest.mark.gpu


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def causal_attn(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    hide = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(hide, float("-inf")).float(), dim=-1).to(q.dtype) @ v


def h2o_scores(q, k, v):
    n = q.size(-2)
    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=s.device), 1), float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v, p.sum(-2)


@pytest.fixture(autouse=True)
def _fuser_kernels(monkeypatch):
    # the planner may leave small shapes to SDPA/Inductor; these tests are about fuser's ops
    # (torch.compile refuses options= beside mode=, so the environment forces the plans)
    monkeypatch.setenv("FUSER_PLAN", "attention.impl=fuser,kda.impl=fuser,h2o.impl=fuser")


def _graphed(fn):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, backend="fuser", mode="reduce-overhead")


def _captured():
    """No graph of the last ``_graphed`` function ran outside CUDA graphs (Inductor counts each
    skip, e.g. "mutated inputs"), and at least one was recorded."""
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    return True


def attention_kl(q1, k1, q2, k2):
    """Attention distillation's loss: KL(teacher's attention ‖ student's), causal, per row summed."""
    n = q1.shape[-2]
    hidden = torch.ones(n, n, dtype=torch.bool, device=q1.device).triu(1)
    s1 = (q1 @ k1.transpose(-2, -1)).float() * q1.size(-1) ** -0.5
    s2 = (q2 @ k2.transpose(-2, -1)).float() * q2.size(-1) ** -0.5
    kl = F.kl_div(F.log_softmax(s2.masked_fill(hidden, float("-inf")), -1),
                  F.log_softmax(s1.masked_fill(hidden, float("-inf")), -1), reduction="none", log_target=True)
    return kl.masked_fill(hidden, 0.0).sum(-1).mean()


def test_attention_forward_and_backward_replays_equal_eager():
    f = _graphed(causal_attn)
    with report.collecting() as rep:
        for step in range(4):  # warm-up, recording, replays
            torch.manual_seed(step)
            q, k, v = (torch.randn(1, 4, 333, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            torch.compiler.cudagraph_mark_step_begin()
            out = f(q, k, v)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
            ref = causal_attn(*ref_in)
            ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
            assert _rel(out, ref) < 2e-2, step
            for a, b in zip(grads, ref_grads):
                assert _rel(a, b) < 3e-2, step
    assert [m.pattern for m in rep.fused] == ["attention"] and _captured()


@pytest.mark.parametrize("n,split", [(333, "1"), (2048, "auto")], ids=["one_pass", "split_k"])
def test_attention_kl_forward_and_backward_replays_equal_eager(n, split, monkeypatch):
    # 2048 keys at B=1, H=2 with split_k=auto: the keys split (the split-K forward and its merge)
    monkeypatch.setenv("FUSER_PLAN", f"attention_kl.split_k={split}")
    f = _graphed(attention_kl)
    with report.collecting() as rep:
        for step in range(4):
            torch.manual_seed(30 + step)
            q1, k1 = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            q2, k2 = (torch.randn(1, 2, n, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            torch.compiler.cudagraph_mark_step_begin()
            loss = f(q1, k1, q2, k2)
            grads = torch.autograd.grad(loss, (q2, k2))
            ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in (q1, k1, q2, k2)]
            ref = attention_kl(*ref_in)
            ref_grads = torch.autograd.grad(ref, ref_in[2:])
            assert _rel(loss, ref) < 2e-2, step
            for a, b in zip(grads, ref_grads):
                assert _rel(a, b) < 3e-2, step
    assert [m.pattern for m in rep.fused] == ["attention_kl"] and _captured()


def test_kda_replays_equal_eager():
    f = _graphed(kda_loop)
    with torch.no_grad(), report.collecting() as rep:
        for step in range(4):
            torch.manual_seed(10 + step)
            b, h, t, kd, vd = 1, 2, 37, 32, 48
            q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, kd, device="cuda"), dim=-1) for _ in range(2))
            v = torch.randn(b, h, t, vd, device="cuda")
            g = -torch.rand(b, h, t, kd, device="cuda") * 0.5
            beta = torch.rand(b, h, t, device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            o, s = f(q, k, v, g, beta)
            o, s = o.clone(), s.clone()
            want_o, want_s = kda_loop(*(x.double() for x in (q, k, v, g, beta)))
            assert _rel(o, want_o) < 1e-4 and _rel(s, want_s) < 1e-4, step
    assert [m.pattern for m in rep.fused] == ["kda"] and _captured()


def test_h2o_replays_equal_eager():
    f = _graphed(h2o_scores)
    with torch.no_grad(), report.collecting() as rep:
        for step in range(4):
            torch.manual_seed(20 + step)
            q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
            torch.compiler.cudagraph_mark_step_begin()
            o, score = f(q, k, v)
            o, score = o.clone(), score.clone()
            want_o, want_score = h2o_scores(*(x.double() for x in (q, k, v)))
            assert _rel(o, want_o) < 5e-3 and _rel(score, want_score) < 5e-3, step
    assert [m.pattern for m in rep.fused] == ["h2o"] and _captured()
