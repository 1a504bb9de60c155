"""The H2O examples run as a user runs them (a subprocess, CPU, Triton's interpreter, small
sizes): they exit 0 (their results match eager within the tolerance they print) and say that
the H2O regions were fused."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(name: str, *args: str) -> str:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def test_kvpress_scorer_example():
    out = _run("kvpress_scorer.py")
    # on the CPU (interpreter) the planner offers no Inductor plan: every scorer is fused
    assert out.count("h2o matched: 1, fused: 1;") == 3, out
    assert "window=queries[-8:], keys[:-8], window_causal=bottom_right" in " ".join(out.split())
    assert "every scorer was found (h2o) and matches eager" in out


def test_h2o_llama_example():
    pytest.importorskip("transformers.masking_utils", reason="the example needs transformers 5.x")
    out = _run("h2o_llama.py")
    # a 2-layer model: the prefill and two decode steps, every attention call fused
    assert "h2o regions fused: 6 of 6 attention calls" in out, out
    assert re.search(r"h2o at h2o_llama\.py:\d+ \(graph 0\) -> plan fuser", out), out
    assert "score=sum over batch, then sum over queries" in " ".join(out.split()), out


def test_h2o_llama_example_with_transformers_eager_mask():
    # transformers' own eager mask in the graph: a causal mask with a finite fill (finfo.min
    # added): fused (two_kernel), the fill shown in explain()
    pytest.importorskip("transformers.masking_utils", reason="the example needs transformers 5.x")
    out = _run("h2o_llama.py", "--mask", "eager", "--decode-steps", "1")
    assert "h2o regions fused: 4 of 4 attention calls" in out, out
    assert "causal_fill=-3.40282e+38 (add)" in " ".join(out.split()), out
