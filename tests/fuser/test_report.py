"""Reports and the objects in them: short reprs, per-report graph numbering, CPU notes."""

from __future__ import annotations

import re

import torch

import fuser
from fuser.codegen import render


def causal(q, k, v):
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax((q @ k.mT * 0.25).masked_fill(mask, float("-inf")), -1) @ v


def _report():
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 16, 16, generator=g, requires_grad=True) for _ in range(3)]

    def f(q, k, v):
        p = torch.softmax(q @ k.mT, -1)
        return causal(q, k, v), p @ v, p  # the second attention returns its weights: a near-miss

    return fuser.explain(f, q, k, v)


def test_reprs_are_short_and_say_what_matters():
    rep = _report()
    assert repr(rep) == "<fuser.Report: 1 graph, 1 fused, 0 left to Inductor, 1 near-miss>"
    (m,) = rep.matches
    r = repr(m)
    assert len(r) < 160 and m.pattern in r and m.location in r and m.plan.name in r, r
    assert re.fullmatch(r"fuser\[backward=\w+\] \(est\. [0-9.e+-]+ ms\)", str(m.plan)), str(m.plan)
    assert len(str(m.plan)) < 60 and len(repr(m.plan)) < 70
    assert all(len(repr(c)) < 80 for c in m.alternatives)
    (rej,) = rep.rejected
    assert repr(rej).startswith("<Rejection attention at ") and len(repr(rej)) < 260
    for kernel in m.kernels + rep.kernels:  # RenderedKernel, KernelInfo: no source
        assert "@triton.jit" not in repr(kernel) and len(repr(kernel)) < 300, repr(kernel)
    assert isinstance(m.kernels[0], render.RenderedKernel)
    assert len(repr(rep.matches)) < 200


def test_cpu_matches_say_the_estimates_are_for_a_nominal_gpu():
    text = str(_report())
    assert "nominal GPU" in text and "Triton's interpreter" in text and "nothing is timed" in text


def test_autotune_note_on_the_interpreter():
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 16, 16, generator=g, requires_grad=True) for _ in range(3)]
    text = str(fuser.explain(causal, q, k, v, options={"fuser.autotune": True}))
    assert "on the interpreter nothing is timed" in text


def test_report_lines_are_wrapped():
    assert max(len(line) for line in str(_report()).splitlines() if "kernel " not in line) <= 110
