"""Reports and the objects in them: short reprs, per-report graph numbering, CPU notes, compile
times per phase."""

from __future__ import annotations

import logging
import re
import time

import torch

import fuser
from fuser.codegen import render
from fuser.report import CompileTimes, PhaseTimer


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


# -- where fuser's compile time goes ------------------------------------------------------------

FIXED_PHASES = ["canonicalise", "static masks", "regions", "plan", "render", "import kernels", "emit", "recompile",
                "other"]


def _check_times(t, patterns=("attention", "attention_kl", "h2o", "kda")):
    assert isinstance(t, CompileTimes)
    want = FIXED_PHASES[:2] + [f"match[{p}]" for p in patterns] + FIXED_PHASES[2:]
    assert list(t.phases) == want, list(t.phases)
    assert all(isinstance(ms, float) and ms >= 0.0 for ms in t.phases.values()), t.phases
    assert sum(t.phases.values()) <= t.total_ms + 1e-9 and t.total_ms > 0
    assert t.inductor_ms is not None and t.inductor_ms > 0


def test_compile_times_per_graph_in_the_report():
    rep = _report()
    (t,) = rep.compile_times
    _check_times(t)
    assert t.graph_index == 0
    # a fused attention was matched, planned, rendered and emitted: those phases took time
    assert all(t.phases[p] > 0 for p in ("canonicalise", "match[attention]", "plan", "render", "emit")), t.phases
    text = str(rep)
    assert "compile time, graph 0 (ms): canonicalise " in text and "Inductor's compile_fx" in text
    assert fuser.report.TRITON_COMPILE_NOTE in " ".join(text.split())
    assert re.search(r"total \d+\.\d", text)


def test_compile_times_with_a_graph_break_and_some_patterns():
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 16, 16, generator=g) for _ in range(3)]

    def f(q, k, v):
        a = causal(q, k, v)
        torch._dynamo.graph_break()
        return causal(a, k, v)

    rep = fuser.explain(f, q, k, v, options={"fuser.patterns": "attention,kda"})
    assert rep.graphs == 2 and [t.graph_index for t in rep.compile_times] == [0, 1]
    for t in rep.compile_times:
        _check_times(t, patterns=("attention", "kda"))
    assert "compile time, graph 1 (ms)" in str(rep)


def test_disabled_graphs_have_no_compile_times():
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 16, 16, generator=g) for _ in range(3)]
    rep = fuser.explain(causal, q, k, v, options={"fuser.enabled": False})
    assert rep.compile_times == [] and "compile time" not in str(rep)


def test_compile_phases_are_logged_once_per_graph(caplog):
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 16, 16, generator=g) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="fuser"):
        fuser.explain(causal, q, k, v)
    lines = [r.getMessage() for r in caplog.records if "compile phases" in r.getMessage()]
    assert len(lines) == 1, lines
    m = re.fullmatch(r"fuser: compile phases, graph \d+ \(ms\): (.*); Inductor's compile_fx ([0-9.]+) \(not fuser's\); "
                     + re.escape(fuser.report.TRITON_COMPILE_NOTE), lines[0])
    assert m, lines[0]
    parts = dict(p.rsplit(" ", 1) for p in m.group(1).split(", "))
    assert list(parts)[:3] == ["canonicalise", "static masks", "match[attention]"] and list(parts)[-1] == "total"
    assert abs(sum(float(x) for name, x in parts.items() if name != "total") - float(parts["total"])) < 0.1 * len(parts)


def test_phase_timer_counts_nested_phases_once():
    timer = PhaseTimer()
    inner = timer.wrap("inner", lambda: time.sleep(0.02))
    t0 = time.perf_counter()
    with timer.phase("outer"):
        time.sleep(0.01)
        inner()
        with timer.phase("outer"):  # re-entered: still counted once
            inner()
    wall = (time.perf_counter() - t0) * 1e3
    assert set(timer.ms) == {"outer", "inner"}
    assert timer.ms["inner"] >= 40 and timer.ms["outer"] >= 10
    assert timer.ms["outer"] < 40  # the inner sleeps are not in it
    assert sum(timer.ms.values()) <= wall + 1e-6


def test_rendering_and_imports_are_timed_inside_a_timer(monkeypatch):
    import jinja2

    env = jinja2.Environment(loader=jinja2.DictLoader({"probe.py.jinja": "X = {{ x }}\n"}),
                             undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "_env", env)
    timer = PhaseTimer()
    with render.timing(timer.phase):
        k = render.render("probe.py.jinja", "timing_probe", x=time.time_ns())
        render.load_module(k)
    assert timer.ms.get("render", 0) > 0 and timer.ms.get("import kernels", 0) > 0
    assert render._phase.get() is None
    outside = render.render("probe.py.jinja", "timing_probe", x=time.time_ns() + 1)  # untimed, still rendered
    assert render.load_module(outside).X > 0 and set(timer.ms) == {"render", "import kernels"}
